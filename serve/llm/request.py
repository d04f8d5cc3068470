"""A completion or chat request as the generation service takes it: what the OpenAI protocol's
parsers (serve/protocols/openai.py) make of a request body, and what the served model
(serve/llm/model.py) turns into prompt ids and sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.generation import Constraint
    from serve.llm.tools import ToolRequest


@dataclass
class GenerationRequest:
    model: str
    prompt: str | None = None  # completions: text ...
    prompt_ids: list[int] | None = None  # ... or token ids
    messages: list[dict] | None = None  # chat: [{role, content}] with content as plain text
    max_tokens: int | None = None  # None: as many as the limits allow
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    constraint: Constraint | None = None  # response_format / structured_outputs (serve/llm/structured.py)
    constraint_param: str = "response_format"  # the field a refusal of the constraint names
    tools: ToolRequest | None = None  # chat: tools and tool_choice (serve/llm/tools.py)
