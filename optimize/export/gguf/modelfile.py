"""An Ollama Modelfile for a GGUF file: FROM the file beside it, TEMPLATE (Ollama's Go template
syntax) rendering the chat as the file's own chat template does, PARAMETER stop for the end-of-turn
tokens. ChatML templates (<|im_start|>role ... <|im_end|>, SmolLM2 and Qwen2) are translated, the
default system turn the template adds when the chat has none included; for any other template the
Modelfile has no TEMPLATE and Ollama reads tokenizer.chat_template from the file."""

from __future__ import annotations

START, END = "<|im_start|>", "<|im_end|>"
PROBE = "\x00user-text\x00"


def chatml_default_system(template: str) -> str | None:
    """The text the chat template puts before the first user turn when the chat has no system turn
    (its default system turn, or '' for none); None where the template is not ChatML."""
    if START not in template or END not in template:
        return None
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        text = env.from_string(template).render(
            messages=[{"role": "user", "content": PROBE}], add_generation_prompt=True, bos_token="", eos_token=END
        )
    except jinja2.TemplateError:
        return None
    turn = f"{START}user\n{PROBE}{END}\n{START}assistant\n"
    if turn not in text:
        return None
    return text[: text.index(turn)]


def chatml_template(default_system: str) -> str:
    """Ollama's Go template for a ChatML chat, the default system turn where the chat has none."""
    return (
        '{{- if or (not .Messages) (ne (index .Messages 0).Role "system") }}'
        + go_text(default_system)
        + "{{ end }}\n"
        + "{{- range .Messages }}"
        + START
        + "{{ .Role }}\n{{ .Content }}"
        + END
        + "\n{{ end }}"
        + START
        + "assistant\n"
    )


def go_text(text: str) -> str:
    """Literal text in a Go template (its only markup is '{{')."""
    return text.replace("{{", '{{ "{{" }}')


def modelfile(gguf_name: str, chat_template: str | None, stops: list[str], parameters: dict | None = None) -> str:
    lines = [f"FROM ./{gguf_name}", ""]
    default_system = chatml_default_system(chat_template) if chat_template else None
    if default_system is not None:
        lines += ['TEMPLATE """' + chatml_template(default_system) + '"""', ""]
    for stop in dict.fromkeys(s for s in stops if s):
        lines.append(f"PARAMETER stop {quoted(stop)}")
    for key, value in (parameters or {}).items():
        lines.append(f"PARAMETER {key} {value}")
    return "\n".join(lines) + "\n"


def quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def for_gguf(path) -> str:
    """The Modelfile for the GGUF at `path`: its template and end-of-turn tokens read from the file."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def value(key):
        field = reader.fields.get(key)
        return field.contents() if field is not None else None

    tokens = value("tokenizer.ggml.tokens") or []
    template = value("tokenizer.chat_template")
    stops = []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eos_token_id"):
        token_id = value(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            stops.append(tokens[token_id])
    if template and END in template:
        stops.append(END)
    return modelfile(path.name, template, stops)
