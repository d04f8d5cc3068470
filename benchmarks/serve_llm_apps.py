"""What applications ask of a served causal LM, checked with the official `openai` client against
`python -m serve ARTIFACT` on loopback (or a server already running, --url).

    .venv/bin/python -m benchmarks.serve_llm_apps ARTIFACT [--markdown out.md] [--json out.json]

Each check is one request (or one stream) the way an application sends it, greedy unless it says so:

- parse: `chat.completions.parse(response_format=<pydantic model>)` returns the parsed object;
- json_object: `response_format={"type": "json_object"}` returns text that parses as a JSON object;
- tool_required / tool_named / tool_streamed: a forced tool call (`tool_choice="required"`, a named
  function, and "required" streamed and assembled by the client) returns `tool_calls` whose arguments
  validate against the called tool's schema, finish_reason "tool_calls";
- tool_round_trip: a history with the assistant's `tool_calls` and the `tool` message is answered;
- logprobs: one entry per generated token (with --top-logprobs K, a greedy token is its position's best);
- n: `n=2` (sampled) returns two choices, or a 400 that names the engine that cannot.

A table, one row per check: passed or failed, and the reply's key figures (tokens, finish_reason,
seconds, what came back). Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from benchmarks import figure_record
from optimize.evaluate.served import ServedServer
from serve import arguments as cli

ASK_PET = "Invent a pet and describe it as JSON with its name, kind and age."
ASK_JSON = "Describe a city as a JSON object with a few fields."
ASK_WEATHER = "What is the weather in Paris right now?"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


class Pet(BaseModel):
    name: str = Field(max_length=24)
    kind: Literal["cat", "dog", "bird", "fish"]
    age: int = Field(ge=0, le=30)


@dataclass
class Outcome:
    passed: bool
    figures: str


@dataclass
class Context:
    client: Any  # openai.OpenAI
    model: str
    max_tokens: int
    top_logprobs: int


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def finish(reply, started: float) -> str:
    """The figures every reply has: completion tokens, finish_reason, seconds."""
    usage = reply.usage.completion_tokens if reply.usage else "?"
    return f"{usage} tokens, finish {reply.choices[0].finish_reason}, {time.perf_counter() - started:.2f} s"


def clip(text: str | None, width: int = 70) -> str:
    text = (text or "").replace("\n", " ").replace("|", "\\|")
    return text if len(text) <= width else text[: width - 3] + "..."


# --- the checks ------------------------------------------------------------------------------------


def check_parse(ctx: Context) -> Outcome:
    started = time.perf_counter()
    reply = ctx.client.chat.completions.parse(
        model=ctx.model, messages=user(ASK_PET), response_format=Pet, max_tokens=ctx.max_tokens, temperature=0
    )
    pet = reply.choices[0].message.parsed
    return Outcome(isinstance(pet, Pet), f"{finish(reply, started)}; {clip(repr(pet))}")


def check_json_object(ctx: Context) -> Outcome:
    started = time.perf_counter()
    reply = ctx.client.chat.completions.create(
        model=ctx.model,
        messages=user(ASK_JSON),
        response_format={"type": "json_object"},
        max_tokens=ctx.max_tokens,
        temperature=0,
    )
    text = reply.choices[0].message.content or ""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        return Outcome(False, f"{finish(reply, started)}; does not parse ({exc.msg}): {clip(text, 50)}")
    return Outcome(isinstance(parsed, dict), f"{finish(reply, started)}; {clip(text)}")


def validate_calls(calls) -> tuple[bool, str]:
    """Every call names one of TOOLS and its arguments validate against that tool's schema."""
    import jsonschema_rs

    if not calls:
        return False, "no tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    shown = []
    for call in calls:
        schema = schemas.get(call.function.name)
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            return False, f"{call.function.name}: arguments do not parse: {clip(call.function.arguments, 50)}"
        if schema is None or not jsonschema_rs.validator_for(schema).is_valid(arguments):
            return False, f"{call.function.name}({clip(call.function.arguments, 50)}) does not validate"
        if not call.id:
            return False, "a tool call without an id"
        shown.append(f"{call.function.name}({call.function.arguments})")
    return True, clip("; ".join(shown))


def forced_call(ctx: Context, choice, tools: list[dict]) -> Outcome:
    started = time.perf_counter()
    reply = ctx.client.chat.completions.create(
        model=ctx.model,
        messages=user(ASK_WEATHER),
        tools=tools,
        tool_choice=choice,
        max_tokens=ctx.max_tokens,
        temperature=0,
    )
    valid, shown = validate_calls(reply.choices[0].message.tool_calls)
    return Outcome(valid and reply.choices[0].finish_reason == "tool_calls", f"{finish(reply, started)}; {shown}")


def check_tool_required(ctx: Context) -> Outcome:
    return forced_call(ctx, "required", TOOLS)


def check_tool_named(ctx: Context) -> Outcome:
    return forced_call(ctx, {"type": "function", "function": {"name": "get_weather"}}, TOOLS)


def check_tool_streamed(ctx: Context) -> Outcome:
    started = time.perf_counter()
    with ctx.client.chat.completions.stream(
        model=ctx.model,
        messages=user(ASK_WEATHER),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=ctx.max_tokens,
        temperature=0,
        stream_options={"include_usage": True},
    ) as stream:
        chunks = sum(1 for _ in stream)
        reply = stream.get_final_completion()
    valid, shown = validate_calls(reply.choices[0].message.tool_calls)
    passed = valid and reply.choices[0].finish_reason == "tool_calls"
    return Outcome(passed, f"{finish(reply, started)}, {chunks} events; {shown}")


def check_tool_round_trip(ctx: Context) -> Outcome:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    call["function"]["arguments"] = json.dumps({"city": "Paris", "unit": "celsius"})
    history = [
        *user(ASK_WEATHER),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18, "sky": "sunny"})},
    ]
    started = time.perf_counter()
    reply = ctx.client.chat.completions.create(
        model=ctx.model, messages=history, tools=TOOLS, max_tokens=ctx.max_tokens, temperature=0
    )
    message = reply.choices[0].message
    answered = bool(message.content) or bool(message.tool_calls)
    return Outcome(answered, f"{finish(reply, started)}; {clip(message.content or str(message.tool_calls))}")


def check_logprobs(ctx: Context) -> Outcome:
    started = time.perf_counter()
    extra = {"top_logprobs": ctx.top_logprobs} if ctx.top_logprobs else {}
    reply = ctx.client.chat.completions.create(
        model=ctx.model,
        messages=user("Name three colours."),
        max_tokens=min(ctx.max_tokens, 32),
        temperature=0,
        logprobs=True,
        **extra,
    )
    entries = (reply.choices[0].logprobs.content or []) if reply.choices[0].logprobs else []
    generated = reply.usage.completion_tokens
    passed = len(entries) == generated and all(e.logprob <= 0 for e in entries)
    # greedy: the chosen token is the most likely one at its position
    best = sum(1 for e in entries if e.top_logprobs and e.logprob >= max(t.logprob for t in e.top_logprobs) - 1e-6)
    if ctx.top_logprobs:
        passed = passed and best == len(entries)
    mean = sum(e.logprob for e in entries) / len(entries) if entries else float("nan")
    figures = f"{len(entries)} entries for {generated} tokens, mean logprob {mean:.3f}"
    if ctx.top_logprobs:
        figures += f", greedy token the best of {ctx.top_logprobs} at {best}/{len(entries)}"
    return Outcome(passed, f"{figures}; {time.perf_counter() - started:.2f} s")


def check_n(ctx: Context) -> Outcome:
    import openai

    started = time.perf_counter()
    try:
        reply = ctx.client.chat.completions.create(
            model=ctx.model,
            messages=user("Write a one-line greeting."),
            max_tokens=min(ctx.max_tokens, 24),
            temperature=0.8,
            n=2,
        )
    except openai.BadRequestError as exc:  # an engine that cannot must say which it is
        body = exc.body if isinstance(exc.body, dict) else {}
        message = str(body.get("message") or exc)
        named = any(name in message for name in ("onnxruntime-genai", "openvino-genai", "engine"))
        return Outcome(named, f"400 ({body.get('param')}): {clip(message)}")
    texts = [c.message.content for c in reply.choices]
    return Outcome(
        len(reply.choices) == 2 and [c.index for c in reply.choices] == [0, 1],
        f"{len(texts)} choices, {finish(reply, started)}; " + " / ".join(clip(t, 30) for t in texts),
    )


CHECKS: dict[str, Callable[[Context], Outcome]] = {
    "parse": check_parse,
    "json_object": check_json_object,
    "tool_required": check_tool_required,
    "tool_named": check_tool_named,
    "tool_streamed": check_tool_streamed,
    "tool_round_trip": check_tool_round_trip,
    "logprobs": check_logprobs,
    "n": check_n,
}


def run_check(name: str, ctx: Context) -> dict:
    """One check; an exception (a refusal, a parse error in the client) is its failure, in one line."""
    try:
        outcome = CHECKS[name](ctx)
    except Exception as exc:
        outcome = Outcome(False, f"{type(exc).__name__}: {clip(str(exc), 120)}")
    return {"check": name, "passed": outcome.passed, "figures": outcome.figures}


# --- the run ---------------------------------------------------------------------------------------


def model_name(artifact: Path) -> str:
    manifest = json.loads((artifact / "manifest.json").read_text())
    return (manifest.get("recipe") or {}).get("name") or artifact.name


def engine_format(artifact: Path) -> str:
    return json.loads((artifact / "manifest.json").read_text()).get("engine", {}).get("format", "?")


def run(args) -> dict:
    import openai

    from optimize.environment import benchmark_machine

    report = {
        "machine": benchmark_machine(("openvino-genai", "onnxruntime-genai", "openai")),
        "artifact": str(args.artifact),
        "engine": engine_format(args.artifact),
    }
    server = None
    if args.url is None:
        command = [sys.executable, "-m", "serve", str(args.artifact), "--port", "0", "--allow-failed-gate"]
        server = ServedServer("serve", [*command, "--max-tokens", str(args.max_tokens)], "/v2/health/ready")
    try:
        if server is not None:
            server.wait_ready()
        url = args.url or server.url
        client = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key, max_retries=0, timeout=args.timeout_s)
        ctx = Context(client, args.model or model_name(args.artifact), args.max_tokens, args.top_logprobs)
        report["checks"] = []
        for name in args.checks:
            row = run_check(name, ctx)
            print(f"  {name}: {'passed' if row['passed'] else 'FAILED'}: {row['figures']}")
            report["checks"].append(row)
    finally:
        if server is not None:
            server.stop()
    return report


def record_fields(args, report: dict) -> dict:
    """The row of docs/figures.md's table this run measures: how many of the clients' cases the served
    artifact answered as the `openai` client expects."""
    failed = [r["check"] for r in report["checks"] if not r["passed"]]
    passed = len(report["checks"]) - len(failed)
    return {
        "measure": "What applications ask of a served LM: the openai client against python -m serve "
        f"({', '.join(r['check'] for r in report['checks'])}), greedy, max_tokens {args.max_tokens}, on the "
        f"{report['engine']} artifact of {model_name(args.artifact)}",
        "figure": f"{passed} of {len(report['checks'])} checks passed"
        + (f" (failed: {', '.join(failed)})" if failed else ""),
        "ratio": None,
    }


def markdown(report: dict) -> str:
    m = report["machine"]
    passed = sum(r["passed"] for r in report["checks"])
    lines = [
        f"{m['date']}, {m['cpu']}, {m['cores']} cores; {report['engine']} artifact {report['artifact']}: "
        f"{passed}/{len(report['checks'])} checks passed",
        "",
        "| Check | Result | Figures |",
        "|---|---|---|",
    ]
    lines += [
        f"| {r['check']} | {'passed' if r['passed'] else '**failed**'} | {r['figures']} |" for r in report["checks"]
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = cli.OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path, help="a causal-LM artifact (its manifest names the model)")
    p.add_argument(
        "--url",
        type=cli.url(("http", "https"), path=True),
        default=None,
        help="a server already running on the artifact (default: start one)",
    )
    p.add_argument("--model", default=None, help="the model name clients send (default: the recipe's name)")
    p.add_argument("--api-key", default="none")
    p.add_argument("--max-tokens", type=cli.count(1 << 17), default=128)
    p.add_argument(
        "--top-logprobs", type=cli.count(20, low=0), default=0, help="alternatives asked in the logprobs check"
    )
    p.add_argument("--timeout-s", type=cli.seconds(), default=300)
    p.add_argument("--checks", type=cli.names(list(CHECKS)), default=list(CHECKS), help=f"of {','.join(CHECKS)}")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    figure_record.add_option(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from benchmarks.artifact_input import artifact_manifest, refuse_unwritable
    from optimize.evaluate.served import ServerNotReady

    args = parse_args(argv)
    refuse_unwritable(args.json, args.markdown, args.record)
    artifact_manifest(args.artifact, serves="causal_lm")
    try:
        report = run(args)
    except ServerNotReady as exc:  # the server this benchmark started did not come up: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    table = markdown(report)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.record:
        figure_record.write(args, "benchmarks.serve_llm_apps", argv, **record_fields(args, report))
    return 0 if all(r["passed"] for r in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
