"""Tool calls in a model's output text, as OpenAI's `message.tool_calls`.

The forms read (the first that matches wins):
- Hermes / Qwen style: one or more `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, with
  any text around them kept as the message content;
- a bare JSON object `{"name": .., "arguments": {..}}` (also "parameters" for "arguments"): what a
  constrained call (tool_choice "required" or a named function) is written as;
- `{"tool_calls": [{"name": .., "arguments": ..}, ..]}` (the tool-call format OpenVINO GenAI's
  chat templates describe to a model whose own template has no tools) or a JSON list of calls.

A call whose name is not one of the request's tools, or whose arguments are not a JSON object, is
not a call: the text stays content.
"""

from __future__ import annotations

import json
import re
import uuid

TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
OPEN_TAG = "<tool_call>"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def as_call(obj, names: set[str]) -> dict | None:
    """One OpenAI tool call from a parsed {"name", "arguments"} object, or None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if name not in names or not isinstance(arguments, dict):
        return None
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a model's output; no calls found: (text, [])."""
    if OPEN_TAG in text:
        calls = [as_call(loads(m.group(1)), names) for m in TOOL_CALL_TAG.finditer(text)]
        if calls and all(calls):
            content = TOOL_CALL_TAG.sub("", text).strip()
            return content or None, [c for c in calls if c]
        return text, []
    parsed = loads(text.strip())
    if isinstance(parsed, dict) and isinstance(parsed.get("tool_calls"), list):
        parsed = parsed["tool_calls"]
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = [as_call(item, names) for item in items]
    if items and all(calls):
        return None, [c for c in calls if c]
    return text, []


def may_start_a_call(text: str) -> bool:
    """Whether streamed text so far could be the start of a tool call (so it is held back, not sent
    as content, until that is known)."""
    head = text.lstrip()
    return not head or head.startswith(("{", "[", OPEN_TAG)) or OPEN_TAG.startswith(head)
