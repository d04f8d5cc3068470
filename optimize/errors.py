"""Errors the user can act on. Each becomes one line on stderr and exit code 2.

`bad_input_message` is the one place that recognises what libraries raise for a bad input (an ONNX
file the checker or ONNX Runtime cannot read, a model that needs remote code, a refused pickle, an
output path that cannot be written) and turns it into that line; anything else stays a bug (exit 3).
"""

from __future__ import annotations

import argparse
import errno
import sys


class RecipeError(Exception):
    """The recipe, an override or an input is wrong. Raised before anything is written."""


class ArgumentParser(argparse.ArgumentParser):
    """The tools' command lines (verify, export, publish, compare): a bad argument is one line, exit 2."""

    def error(self, message):
        # An argument quoted in the message may hold line breaks: the refusal stays one line.
        print("error: " + " ".join(str(message).splitlines()), file=sys.stderr)
        sys.exit(2)


# Exception classes, by module prefix and name, that only a bad input raises.
_ONNX_INPUT_ERRORS = {
    ("onnx", "ValidationError"): "the ONNX checker refuses the model",
    ("google.protobuf", "DecodeError"): "not a valid ONNX (protobuf) file",
    ("onnxruntime", "InvalidGraph"): "ONNX Runtime cannot load the graph",
    ("onnxruntime", "InvalidProtobuf"): "ONNX Runtime cannot parse the model",
    ("onnxruntime", "NoSuchFile"): "ONNX Runtime cannot find a file of the model",
    ("onnxruntime", "NotImplemented"): "ONNX Runtime has no kernel for an operator of the model",
    ("onnxruntime", "InvalidArgument"): "ONNX Runtime refuses the model",
}
# OSError numbers that mean "this path cannot be used", not "the program is wrong".
_PATH_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOSPC,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EDQUOT,
    errno.ENAMETOOLONG,
    errno.ELOOP,
    errno.EEXIST,
}


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).strip().splitlines()[0].split()) if str(exc).strip() else type(exc).__name__
    return text[:300]


def _classes(exc: BaseException) -> list[tuple[str, str]]:
    return [(cls.__module__ or "", cls.__name__) for cls in type(exc).__mro__]


def bad_input_message(exc: BaseException) -> str | None:
    """The one-line message for an exception that means bad input, or None for a bug."""
    from calibration import DataError
    from engines.artifact import ArtifactError

    if isinstance(exc, (RecipeError, DataError, ArtifactError)):
        return str(exc)
    for module, name in _classes(exc):
        for (prefix, wanted), meaning in _ONNX_INPUT_ERRORS.items():
            if name == wanted and module.startswith(prefix):
                return f"{meaning}: {_first_line(exc)}"
    if any(module.startswith("omegaconf") and name == "OmegaConfBaseException" for module, name in _classes(exc)):
        return f"the recipe cannot be resolved: {_first_line(exc)}"
    text = str(exc)
    if isinstance(exc, ValueError) and "trust_remote_code" in text:
        return (
            "the model needs custom code from its repository, which runs on this machine; "
            "set model.trust_remote_code=true only if you trust it"
        )
    if any(name == "UnpicklingError" for _, name in _classes(exc)) or "weights_only" in text:
        return (
            "the model's weights are a pickle, refused (loading one can run code); convert them to "
            f"safetensors or set model.allow_pickle=true if you trust them ({_first_line(exc)})"
        )
    if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS:
        where = f"{exc.filename}: " if exc.filename else ""
        return f"cannot use {where}{exc.strerror or _first_line(exc)}"
    return None
