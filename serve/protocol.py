"""Request parsers for the two protocols: KServe v2 (tensors) and OpenAI (text).

Pure functions from bytes or decoded JSON to plain dataclasses. Each one either returns a request
the server can act on or raises HTTPError with a 4xx status: no other exception may escape, which
tests/serve/test_serve_fuzz.py checks with hypothesis on arbitrary input.

Checks that need the model (input names, dtypes, token ranges, prompt length) live with the model
(serve/encoder.py, serve/llm.py); here only the protocol's own schema is enforced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, overload

import numpy as np

from engines.artifact import JSONInputError, parse_json
from serve.errors import bad_request, unprocessable
from serve.fields import CHAT, COMPLETIONS, refuse_unserved_fields

if TYPE_CHECKING:
    from engines.generation import Constraint
    from serve.tools import ToolRequest

# KServe v2 datatypes this server can read, as little-endian numpy dtypes (the binary extension
# sends raw little-endian bytes). BYTES is left out: the served graphs take no string tensors.
KSERVE_DTYPES = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("u1"),
    "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
NUMPY_TO_KSERVE = {dtype: name for name, dtype in KSERVE_DTYPES.items()}
MAX_DIMS = 8
# Elements one shape may describe: a terabyte of data, far past any request body, and small enough
# that numpy's byte count (elements x 8) stays inside its index range.
MAX_ELEMENTS = 2**40


def load_json(body: bytes) -> object:
    """The one strict parse for JSON from outside (engines.artifact.parse_json): UTF-8 only, no lone
    surrogates (escaped or raw-encoded), integers of at most 64 digits, bounded nesting; else 400."""
    try:
        return parse_json(body)
    except JSONInputError as exc:
        raise bad_request(f"malformed JSON: {exc}") from None


def json_object(body: bytes) -> dict:
    data = load_json(body)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


# --- small typed getters: one clear message per wrong field --------------------------------------


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@overload
def get_str(data: dict, key: str, default: str) -> str: ...
@overload
def get_str(data: dict, key: str, default: None = None, *, required: Literal[True]) -> str: ...
@overload
def get_str(data: dict, key: str, default: None = None, required: bool = False) -> str | None: ...
def get_str(data: dict, key: str, default=None, required: bool = False) -> str | None:
    value = data.get(key, default)
    if value is None and not required:
        return default
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string", param=key)
    return value


def get_int(data: dict, key: str, default=None, low: int | None = None, high: int | None = None) -> int | None:
    value = data.get(key)
    if value is None:
        return default
    if not is_int(value):
        raise bad_request(f"'{key}' must be an integer", param=key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad_request(f"'{key}' must be between {low} and {high}, got {value}", param=key)
    return value


def get_number(data: dict, key: str, default: float, low: float, high: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number", param=key)
    if not low <= value <= high:
        raise bad_request(f"'{key}' must be between {low:g} and {high:g}, got {value:g}", param=key)
    return float(value)


def get_object(data: dict, key: str, where: str = "") -> dict:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{where + ': ' if where else ''}'{key}' must be an object", param=key)
    return value


def get_bool(data: dict, key: str, default: bool = False) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be true or false", param=key)
    return value


# --- KServe v2 inference requests ----------------------------------------------------------------


@dataclass
class RequestedOutput:
    name: str
    binary: bool


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    outputs: list[RequestedOutput] | None  # None: every output of the model
    binary_output: bool  # request-level default for outputs (tritonclient's binary_data_output)
    id: str | None = None


def split_binary_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """Binary tensor extension: a JSON header of `Inference-Header-Content-Length` bytes, then raw tensors."""
    if header_length is None:
        return body, b""
    try:
        length = int(header_length)
    except ValueError:
        raise bad_request("Inference-Header-Content-Length must be an integer") from None
    if not 0 < length <= len(body):
        raise bad_request(f"Inference-Header-Content-Length {length} does not fit a body of {len(body)} bytes")
    return body[:length], body[length:]


def parse_infer_request(body: bytes, header_length: str | None = None) -> InferRequest:
    header, binary = split_binary_body(body, header_length)
    data = json_object(header)
    raw_inputs = data.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise bad_request("'inputs' must be a non-empty list of tensors", param="inputs")
    inputs, offset = {}, 0
    for i, raw in enumerate(raw_inputs):
        name, array, offset = parse_input_tensor(raw, i, binary, offset)
        if name in inputs:
            raise bad_request(f"input {name!r} is given twice", param="inputs")
        inputs[name] = array
    if offset != len(binary):
        raise bad_request(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    parameters = get_object(data, "parameters")
    request_id = data.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad_request("'id' must be a string", param="id")
    return InferRequest(
        inputs=inputs,
        outputs=parse_requested_outputs(data.get("outputs")),
        binary_output=get_bool(parameters, "binary_data_output"),
        id=request_id,
    )


def parse_shape(raw, where: str) -> list[int]:
    if not isinstance(raw, list) or len(raw) > MAX_DIMS or not all(is_int(d) and d >= 0 for d in raw):
        raise bad_request(f"{where}: 'shape' must be a list of at most {MAX_DIMS} non-negative integers")
    # A zero dim makes the element count 0 whatever the others are, so [2**63, 0] would pass every
    # size check and then fail in numpy (past its index range): bound the dims as if zeros were ones.
    if math.prod(max(d, 1) for d in raw) > MAX_ELEMENTS:
        raise bad_request(f"{where}: 'shape' {raw} is too large: its non-zero dims multiply to over {MAX_ELEMENTS}")
    return raw


def parse_input_tensor(raw, index: int, binary: bytes, offset: int) -> tuple[str, np.ndarray, int]:
    where = f"inputs[{index}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object")
    name = get_str(raw, "name", required=True)
    datatype = get_str(raw, "datatype", required=True)
    if datatype not in KSERVE_DTYPES:
        raise unprocessable(
            f"{where} ({name}): datatype {datatype!r} is not supported (one of {', '.join(KSERVE_DTYPES)})"
        )
    shape = parse_shape(raw.get("shape"), where)
    count = math.prod(shape)
    parameters = get_object(raw, "parameters", where)
    size = get_int(parameters, "binary_data_size", low=0)
    if size is not None:
        array, offset = binary_tensor(binary, offset, size, KSERVE_DTYPES[datatype], count, where)
    else:
        array = json_tensor(raw.get("data"), datatype, count, where)
    return name, array.reshape(shape), offset


def binary_tensor(binary: bytes, offset: int, size: int, dtype: np.dtype, count: int, where: str):
    if size != count * dtype.itemsize:
        raise bad_request(
            f"{where}: binary_data_size {size} does not match the shape ({count} x {dtype.itemsize} bytes)"
        )
    if offset + size > len(binary):
        raise bad_request(f"{where}: binary data ends early ({len(binary) - offset} of {size} bytes)")
    array = np.frombuffer(binary, dtype=dtype, count=count, offset=offset)
    return array.astype(dtype.newbyteorder("="), copy=True), offset + size


def json_tensor(data, datatype: str, count: int, where: str) -> np.ndarray:
    """Tensor data as JSON: a flat list in row-major order (nested lists are accepted too)."""
    if not isinstance(data, list):
        raise bad_request(f"{where}: 'data' must be a list (or use binary_data_size)")
    try:
        array = np.array(data)
    except (ValueError, OverflowError, RecursionError):
        raise bad_request(f"{where}: 'data' must be a list of numbers (nested lists must be rectangular)") from None
    kinds = {"BOOL": "b"}.get(datatype, "iu" if datatype[0] in "IU" else "iuf")
    if array.size and array.dtype.kind not in kinds:
        raise unprocessable(f"{where}: 'data' holds {array.dtype.kind!r}-kind values, not {datatype}")
    if array.size != count:
        raise unprocessable(f"{where}: 'data' has {array.size} elements but the shape needs {count}")
    target = KSERVE_DTYPES[datatype]
    if array.size and array.dtype.kind in "iu" and target.kind in "iu":
        info = np.iinfo(target)  # type: ignore[type-var]  # numpy's stubs: an integer dtype is checked above
        if array.min() < info.min or array.max() > info.max:
            raise unprocessable(f"{where}: values out of range for {datatype}")
    return array.astype(target.newbyteorder("=")).reshape(-1)


def parse_requested_outputs(raw) -> list[RequestedOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("'outputs' must be a list", param="outputs")
    outputs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"outputs[{i}] must be an object", param="outputs")
        parameters = get_object(item, "parameters", f"outputs[{i}]")
        outputs.append(RequestedOutput(get_str(item, "name", required=True), get_bool(parameters, "binary_data")))
    return outputs


# --- OpenAI: embeddings ---------------------------------------------------------------------------


@dataclass
class EmbeddingsRequest:
    model: str
    texts: list[str] | None = None  # either texts ...
    token_ids: list[list[int]] | None = None  # ... or token arrays
    encoding_format: str = "float"
    dimensions: int | None = None

    @property
    def count(self) -> int:
        return len(self.texts) if self.texts is not None else len(self.token_ids or [])


def parse_embeddings_request(data: dict, max_inputs: int) -> EmbeddingsRequest:
    model = get_str(data, "model", required=True)
    raw = data.get("input")
    request = EmbeddingsRequest(
        model=model,
        encoding_format=get_str(data, "encoding_format", "float"),
        dimensions=get_int(data, "dimensions", low=1),
    )
    get_str(data, "user")  # accepted and unused, but it must be what the API says it is
    if request.encoding_format not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    if isinstance(raw, str):
        request.texts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        request.texts = raw
    elif isinstance(raw, list) and raw and all(is_int(x) for x in raw):
        request.token_ids = [raw]
    elif isinstance(raw, list) and raw and all(is_token_list(x) for x in raw):
        request.token_ids = raw
    else:
        raise bad_request("'input' must be a string, a non-empty list of strings, or token arrays", param="input")
    if request.count > max_inputs:
        raise bad_request(f"'input' has {request.count} items; at most {max_inputs} per request", param="input")
    return request


def is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(x) for x in value)


# --- OpenAI: completions and chat completions -----------------------------------------------------


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
    constraint: Constraint | None = None  # response_format / structured_outputs (serve/structured.py)
    constraint_param: str = "response_format"  # the field a refusal of the constraint names
    tools: ToolRequest | None = None  # chat: tools and tool_choice (serve/tools.py)


MAX_CHOICES = 16  # `n`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on `top_logprobs`
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_sampling(data: dict, request: GenerationRequest, max_tokens_key: str = "max_tokens") -> None:
    request.max_tokens = get_int(data, max_tokens_key, request.max_tokens, low=1)
    request.temperature = get_number(data, "temperature", 1.0, 0.0, 2.0)
    request.top_p = get_number(data, "top_p", 1.0, 0.0, 1.0)
    request.stream = get_bool(data, "stream")
    request.seed = get_int(data, "seed")
    request.stop = parse_stop(data.get("stop"))
    options = get_object(data, "stream_options")
    request.include_usage = get_bool(options, "include_usage")
    if set(options) - {"include_usage"}:
        raise bad_request("'stream_options' takes 'include_usage' only", param="stream_options")
    request.n = get_int(data, "n", low=1, high=MAX_CHOICES) or 1
    request.top_k = max(get_int(data, "top_k", low=-1) or 0, 0)  # vLLM's -1, like 0: no cut
    request.min_p = get_number(data, "min_p", 0.0, 0.0, 1.0)
    request.repetition_penalty = get_number(data, "repetition_penalty", 1.0, 0.01, 10.0)
    request.presence_penalty = get_number(data, "presence_penalty", 0.0, -2.0, 2.0)
    request.frequency_penalty = get_number(data, "frequency_penalty", 0.0, -2.0, 2.0)


def parse_chat_logprobs(data: dict, request: GenerationRequest) -> None:
    """Chat: `logprobs: true`, and `top_logprobs: k` alternatives, which need it."""
    request.logprobs = get_bool(data, "logprobs")
    top = get_int(data, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    # As OpenAI's API: any top_logprobs, 0 included, needs logprobs (0 without it would ask nothing).
    if top is not None and not request.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    request.top_logprobs = top or 0


def parse_completion_logprobs(data: dict, request: GenerationRequest) -> None:
    """Completions (the legacy API): `logprobs: k` asks for the chosen token's and k alternatives."""
    k = get_int(data, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
    request.logprobs, request.top_logprobs = k is not None, k or 0


def parse_stop(raw) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return stops


def parse_completion_request(data: dict) -> GenerationRequest:
    refuse_unserved_fields(data, COMPLETIONS)
    request = GenerationRequest(model=get_str(data, "model", required=True), max_tokens=16)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one: the shape some clients always send
    if isinstance(prompt, str):
        request.prompt = prompt
    elif is_token_list(prompt):
        request.prompt_ids = prompt
    else:
        raise bad_request("'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")
    parse_sampling(data, request)
    parse_completion_logprobs(data, request)
    parse_structured(data, request)
    return request


def parse_structured(data: dict, request: GenerationRequest, chat: bool = False) -> None:
    """response_format / structured_outputs, and on chat tools / tool_choice: the constraint the
    output is decoded under (a forced tool call's, or the response format's)."""
    from serve.structured import parse_response_format
    from serve.tools import call_constraint, parse_tools

    request.constraint = parse_response_format(data)
    if data.get("structured_outputs") is not None:
        request.constraint_param = "structured_outputs"
    if not chat:
        for key in ("tools", "tool_choice"):
            if data.get(key) is not None:
                raise bad_request(f"'{key}' is taken on /v1/chat/completions only", param=key)
        return
    request.tools = parse_tools(data)
    if request.tools is not None and request.tools.forced:
        if request.constraint is not None:
            raise bad_request(
                f"'{request.constraint_param}' and a forced tool call both constrain the output: give one",
                param="tool_choice",
            )
        request.constraint, request.constraint_param = call_constraint(request.tools), "tools"


def parse_chat_request(data: dict) -> GenerationRequest:
    refuse_unserved_fields(data, CHAT)
    request = GenerationRequest(model=get_str(data, "model", required=True))
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    request.messages = [parse_message(m, i) for i, m in enumerate(raw)]
    key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    parse_sampling(data, request, key)
    parse_chat_logprobs(data, request)
    parse_structured(data, request, chat=True)
    return request


def parse_message(raw, index: int) -> dict:
    if not isinstance(raw, dict):
        raise bad_request(f"messages[{index}] must be an object", param="messages")
    role = raw.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}", param="messages")
    from serve.tools import history_fields

    return {"role": role, "content": message_text(raw.get("content"), index), **history_fields(raw, index)}


def message_text(content, index: int) -> str:
    """Plain text of a message: a string, or a list of text parts (the only modality served)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content: only text parts are supported", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", param="messages")
