"""The tokenizer and chat template under llama.cpp's `tokenizer.*` keys: copied key for key from a
GGUF source (the file the run loaded: its vocabulary, merges, token types, special ids and template
exactly), or built from a Hugging Face folder's byte-level BPE tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

from optimize.export.gguf import ExportError

# A Hugging Face ByteLevel pre-tokenizer -> llama.cpp's name for the same splitting
# (tokenizer.ggml.pre), read from tokenizer.json's pre_tokenizer. A shape not listed is refused:
# llama.cpp would split the text differently from the tokenizer the model was trained with.
BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True}
DIGITS = {"type": "Digits", "individual_digits": True}
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def copy_from_gguf(writer, source: Path) -> None:
    """Every tokenizer.* key of the GGUF `source`, with its value type, into `writer`."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)


def write_from_folder(writer, folder: Path, config) -> None:
    """A byte-level BPE tokenizer.json (and its chat template) as llama.cpp's converter stores one."""
    import gguf

    spec = _tokenizer_json(folder)
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ExportError(
            f"{folder}/tokenizer.json is a {model.get('type')} tokenizer; the writer writes byte-level BPE"
        )
    tokens, types = token_table(spec, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_name(spec.get("pre_tokenizer"), folder))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    if not special.merges:
        raise ExportError(f"{folder}/tokenizer.json has no BPE merges")
    special.add_to_gguf(writer, quiet=True)


def _tokenizer_json(folder: Path) -> dict:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{folder} has no tokenizer.json to write the GGUF's tokenizer from")
    return json.loads(path.read_text(encoding="utf-8"))


def token_table(spec: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id and their types (control for special added tokens, user-defined for other added
    ones, normal for the rest), padded to the model's vocabulary size with unused placeholders."""
    import gguf

    by_id = {int(i): t for t, i in spec["model"]["vocab"].items()}
    added = {int(t["id"]): t for t in spec.get("added_tokens", [])}
    for i, t in added.items():
        by_id[i] = t["content"]
    size = max(vocab_size, max(by_id) + 1)
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.NORMAL))
    return tokens, types


def pre_name(pre: dict | None, folder: Path) -> str:
    """llama.cpp's pre-tokenizer name for tokenizer.json's pre_tokenizer, or one refusing line."""
    steps = (pre.get("pretokenizers") if pre and pre.get("type") == "Sequence" else [pre]) or []
    if _matches(steps, [BYTE_LEVEL]):
        return "gpt-2"
    if _matches(steps, [DIGITS, BYTE_LEVEL]):
        return "smollm"
    if len(steps) == 2 and _matches(steps[1:], [{"type": "ByteLevel", "use_regex": False}]):
        first = steps[0] if isinstance(steps[0], dict) else {}
        pattern = first.get("pattern") or {}
        if first.get("type") == "Split" and pattern.get("Regex") == QWEN2_SPLIT:
            return "qwen2"
    kinds = [s.get("type") if isinstance(s, dict) else s for s in steps]
    raise ExportError(
        f"{folder}/tokenizer.json splits text with {kinds}, a pre-tokenizer the GGUF writer does not know "
        "(known: ByteLevel, Digits + ByteLevel, Qwen2's Split + ByteLevel)"
    )


def _matches(steps: list, wanted: list[dict]) -> bool:
    return len(steps) == len(wanted) and all(
        isinstance(s, dict) and all(s.get(k) == v for k, v in w.items()) for s, w in zip(steps, wanted)
    )
