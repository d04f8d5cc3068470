"""Tool calls on /v1/chat/completions: the request's `tools` and `tool_choice` checked (limits in
serve/llm/structured.py), the conversation rendered with them, the output constrained where a call is
forced, and the text parsed back into `tool_calls` (serve/llm/tool_parser.py), whole or streamed.

- `tool_choice: "none"`: tools are not rendered; the model answers text.
- `"auto"` (the default with tools): tools rendered; the model answers text or a call, parsed from
  its output if it writes one (the forms serve/llm/tool_parser.py reads).
- `"required"` / `{"type": "function", "function": {"name": ..}}`: the output is constrained to a
  JSON object {"name": <one of the tools>, "arguments": <that tool's parameters>}, so even a small
  model writes a valid call; the reply is that call, `finish_reason: "tool_calls"`.

The model's chat template renders the tools when it takes them (found once at load, by rendering a
probe tool). A template that ignores them gets the conversation rewritten instead (FALLBACK, said in
the startup line): a system message lists the tools and the call format, an assistant's earlier calls
become `<tool_call>` text and tool results `<tool_response>` user turns.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from engines.generation import Constraint
from serve.errors import bad_request
from serve.llm.structured import LIMITS, check_schema
from serve.llm.tool_parser import OPEN_TAG, may_start_a_call, parse_tool_calls

TOOL_CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
PROBE_TOOL = "serve_probe_tool_7f3a"
FALLBACK = "the model's chat template ignores tools: the server describes them in a system message"


@dataclass
class ToolRequest:
    """A request's tools (OpenAI's shape, parameters filled in) and its tool_choice."""

    tools: list[dict]
    choice: str = "auto"  # none | auto | required | function
    function: str | None = None  # the name, for choice "function"
    names: set[str] = field(default_factory=set)

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")


def parse_tools(data: dict) -> ToolRequest | None:
    """The request's tools and tool_choice, or None when it has neither (each fault a 400)."""
    raw, choice = data.get("tools"), data.get("tool_choice")
    if data.get("parallel_tool_calls") not in (None, True, False):
        raise bad_request("'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    if raw is None:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", param="tools")
    if len(raw) > LIMITS.tools:
        raise bad_request(f"'tools' has {len(raw)} tools; at most {LIMITS.tools}", param="tools")
    tools = [parse_tool(t, i) for i, t in enumerate(raw)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("two tools have the same name", param="tools")
    request = ToolRequest(tools, names=set(names))
    parse_choice(choice, request)
    return request if tools else None


def parse_tool(raw, index: int) -> dict:
    where = f"tools[{index}]"
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    function = raw["function"]
    name = function.get("name")
    if not isinstance(name, str) or not LIMITS.tool_name.fullmatch(name):
        raise bad_request(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$", param="tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", param="tools")
    if function.get("strict") not in (None, True, False):
        raise bad_request(f"{where}.function.strict must be true or false", param="tools")
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:
        parameters = NO_PARAMETERS
    check_schema(parameters, "tools", f"{where}.function.parameters")
    spec = {"name": name, "parameters": parameters}
    if description:
        spec["description"] = description
    return {"type": "function", "function": spec}


def parse_choice(choice, request: ToolRequest) -> None:
    if choice is None or choice in TOOL_CHOICES:
        request.choice = choice or "auto"
        return
    ok = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    name = choice["function"].get("name") if ok else None
    if name not in request.names:
        raise bad_request(
            "'tool_choice' must be none, auto, required or {'type': 'function', 'function': {'name': <a tool's name>}}",
            param="tool_choice",
        )
    request.choice, request.function = "function", name


# --- the constraint of a forced call ---------------------------------------------------------------


def call_constraint(request: ToolRequest) -> Constraint:
    """JSON {"name": const, "arguments": parameters}: one such object per tool (anyOf when several)."""
    tools = [t["function"] for t in request.tools if request.function in (None, t["function"]["name"])]
    if len(tools) == 1:
        schema = call_schema(tools[0], "#/properties/arguments")
    else:
        schema = {"anyOf": [call_schema(t, f"#/anyOf/{i}/properties/arguments") for i, t in enumerate(tools)]}
    return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))


def call_schema(function: dict, at: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": rebased(function["parameters"], at)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def rebased(schema: dict, at: str) -> dict:
    """The schema with its local $refs ("#/...") pointing where it now sits inside a larger one."""
    schema = copy.deepcopy(schema)
    stack: list = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                node["$ref"] = at + ref[1:]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


# --- the conversation ------------------------------------------------------------------------------


def history_fields(raw: dict, index: int) -> dict:
    """What an assistant's `tool_calls` or a tool message's `tool_call_id` adds to a parsed message,
    in the shape chat templates read (arguments as an object, not the JSON text OpenAI sends)."""
    extra: dict = {}
    calls = raw.get("tool_calls")
    if calls is not None:
        if raw.get("role") != "assistant" or not isinstance(calls, list):
            raise bad_request(f"messages[{index}].tool_calls must be a list, on an assistant message", param="messages")
        extra["tool_calls"] = [history_call(c, index) for c in calls]
    call_id = raw.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise bad_request(f"messages[{index}].tool_call_id must be a string", param="messages")
        extra["tool_call_id"] = call_id
    name = raw.get("name")
    if isinstance(name, str):
        extra["name"] = name
    return extra


def history_call(raw, index: int) -> dict:
    function = raw.get("function") if isinstance(raw, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(name, str) or not isinstance(parsed, dict):
        raise bad_request(
            f"messages[{index}].tool_calls: each needs function.name and function.arguments (a JSON object as text)",
            param="messages",
        )
    return {"id": str(raw.get("id", "")), "type": "function", "function": {"name": name, "arguments": parsed}}


def takes_tools(model) -> bool:
    """Whether the model's chat template renders tools (a probe tool's name shows in the prompt)."""
    probe = [{"type": "function", "function": {"name": PROBE_TOOL, "parameters": NO_PARAMETERS}}]
    try:
        return PROBE_TOOL in model.chat_prompt([{"role": "user", "content": "hi"}], tools=probe)
    except Exception:
        return False


def chat_prompt(model, messages: list[dict], tools: ToolRequest | None, template_takes_tools: bool) -> str:
    """The prompt of a conversation, its tools rendered by the template or by the fallback."""
    rendered = tools.tools if tools is not None and tools.active else None
    if template_takes_tools:
        return model.chat_prompt(messages, tools=rendered)
    return model.chat_prompt(fallback_messages(messages, rendered))


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a template that reads only role and content."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(f"{OPEN_TAG}{json.dumps(c['function'])}</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m["content"], calls]))})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        listing = "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools)
        system = f'Tools:\n{listing}\nCall one as <tool_call>{{"name":..,"arguments":{{..}}}}</tool_call>'

        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


# --- the reply -------------------------------------------------------------------------------------


class ToolCallStream:
    """The generated text of a request with tools: passed through as content while it cannot be a
    call, held back while it may be one (all of it, where a call is forced), parsed at the end."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.held = ""
        self.passing = False  # the text is content: stream it as it comes

    def feed(self, piece: str) -> str:
        if self.passing:
            return piece
        self.held += piece
        if self.request.forced or may_start_a_call(self.held):
            return ""
        self.passing, text, self.held = True, self.held, ""
        return text

    def finish(self) -> tuple[str | None, list[dict]]:
        """(content still to send, tool calls) at the end of the generation."""
        if self.passing or not self.held:
            return self.held or None, []
        return parse_tool_calls(self.held, self.request.names)


def call_deltas(calls: list[dict]) -> list[dict]:
    """A stream's `delta.tool_calls` for whole calls, as the OpenAI client assembles them: the id,
    type and name first with empty arguments, then the arguments."""
    deltas = []
    for i, call in enumerate(calls):
        head = {"name": call["function"]["name"], "arguments": ""}
        deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function", "function": head}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
    return deltas
