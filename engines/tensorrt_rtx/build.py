"""Ahead-of-time TensorRT-RTX plans from an ONNX graph, built in a child process.

TensorRT-RTX builds without a GPU (the builder, the ONNX parser and build_serialized_network all run
on a CPU); only loading the plan needs an RTX-class GPU. Native TensorRT code can abort the whole
process (standard TensorRT does when it finds no CUDA device), so the build runs in a child
interpreter: `python -m engines.tensorrt_rtx.build REQUEST.json` reads what to build and writes a
JSON report beside the plan. The parent reads the report; a crash of the child is one line, never
the parent's death.

TensorRT-RTX networks are strongly typed: there are no FP16/INT8 builder flags, precision comes
from the graph (FP16 initializers, Q/DQ nodes). Timing-cache calls are no-ops in TensorRT-RTX
(since 1.2); the cache it has is the runtime cache of kernels compiled at load time on the GPU,
which the runner keeps outside the artifact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Compute capabilities TensorRT-RTX builds for (Turing to Blackwell consumer/workstation GPUs; not
# Hopper). The names are tensorrt_rtx.ComputeCapability members.
COMPUTE_CAPABILITIES = ("SM75", "SM80", "SM86", "SM89", "SM120")
MODULE = "tensorrt_rtx"
BUILD_TIMEOUT_S = 1800
EXIT_REFUSED = 2  # the graph cannot be built; the report says why


class BuildRefused(Exception):
    """The graph cannot be built into a plan (unsupported nodes, a builder error, a crash): one line."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report or {}


def missing_module() -> str | None:
    """One phrase naming what the build lacks here, or None."""
    import importlib.util

    if importlib.util.find_spec(MODULE) is None:
        return "TensorRT-RTX (pip install 'optimize[tensorrt-rtx]', the tensorrt-rtx wheel)"
    return None


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    profiles: list[dict[str, list[list[int]]]],
    compute_capabilities: list[str],
    timeout_s: float = BUILD_TIMEOUT_S,
) -> dict:
    """Build `plan_path` from `onnx_path` in a child process; returns the build report.

    profiles: one {input name: [min shape, opt shape, max shape]} per optimization profile.
    Raises BuildRefused (one line, the report attached) when the graph cannot be built."""
    missing = missing_module()
    if missing:
        raise BuildRefused(f"engine.method=tensorrt_rtx needs {missing}")
    request_path = plan_path.with_name(plan_path.name + ".request.json")
    report_path = plan_path.with_name(plan_path.name + ".report.json")
    request = {
        "onnx": str(onnx_path),
        "plan": str(plan_path),
        "report": str(report_path),
        "profiles": profiles,
        "compute_capabilities": list(compute_capabilities),
    }
    request_path.write_text(json.dumps(request))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "engines.tensorrt_rtx.build", str(request_path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": _project_root_on_path()},
        )
    except subprocess.TimeoutExpired:
        raise BuildRefused(f"the TensorRT-RTX build of {onnx_path.name} ran past {timeout_s:.0f} s") from None
    finally:
        request_path.unlink(missing_ok=True)
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    report_path.unlink(missing_ok=True)
    if proc.returncode == 0 and plan_path.is_file():
        return report
    plan_path.unlink(missing_ok=True)  # nothing half-written
    if report.get("refused"):
        raise BuildRefused(report["refused"], report)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    raise BuildRefused(f"the TensorRT-RTX builder stopped ({how}) on {onnx_path.name}: {tail}", report)


def _project_root_on_path() -> str:
    """The child imports engines/ from the same tree as the parent, whatever the working directory."""
    root = str(Path(__file__).resolve().parent.parent)
    current = os.environ.get("PYTHONPATH")
    return root if not current else f"{root}{os.pathsep}{current}"


# --- the child process ---------------------------------------------------------------------------


def _logger(trt, errors: list[str]):
    class Collecting(trt.ILogger):  # keeps the builder's errors for the report instead of stderr noise
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.ERROR:
                errors.append(str(msg).strip())

    return Collecting()


def _node(graph_nodes, index: int, reason: str | None = None) -> dict:
    node = graph_nodes[index]
    found = {"index": index, "name": node.name, "op_type": node.op_type, "domain": node.domain or "ai.onnx"}
    return {**found, "reason": reason} if reason else found


def unsupported_nodes(trt, logger, onnx_path: Path) -> dict:
    """What supports_model_v2 rejects: `nodes`, those the parser's errors name (the culprits, with
    the reason), and `subgraphs`, the node lists it marks unsupported (which can hold only supported
    ops beside a culprit); `errors` are parser errors that name no node."""
    import onnx

    graph_nodes = onnx.load(str(onnx_path), load_external_data=False).graph.node
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # kept in a name: the parser holds no reference to it
    parser = trt.OnnxParser(network, logger)
    parser.supports_model_v2(onnx_path.read_bytes(), str(onnx_path))
    nodes, errors = [], []
    for i in range(parser.num_errors):
        error = parser.get_error(i)
        desc = " ".join(error.desc().split())  # TensorRT's descriptions span lines; a refusal is one
        if 0 <= error.node() < len(graph_nodes):
            nodes.append(_node(graph_nodes, error.node(), desc))
        else:
            errors.append(desc)
    subgraphs = [
        [_node(graph_nodes, n) for n in parser.get_subgraph_nodes(i)]
        for i in range(parser.num_subgraphs)
        if not parser.is_subgraph_supported(i)
    ]
    return {"nodes": nodes, "subgraphs": subgraphs, "errors": errors}


def _refusal(onnx_name: str, found: dict) -> str:
    nodes = found["nodes"] or [n for subgraph in found["subgraphs"] for n in subgraph]
    if not nodes:
        return f"TensorRT-RTX cannot parse {onnx_name}: {(found['errors'] or ['no reason given'])[0]}"
    named = ", ".join(f"{n['name'] or '#' + str(n['index'])} ({n['domain']}::{n['op_type']})" for n in nodes[:5]) + (
        f" and {len(nodes) - 5} more" if len(nodes) > 5 else ""
    )
    reason = f": {nodes[0]['reason'][:300]}" if nodes[0].get("reason") else ""
    return f"TensorRT-RTX cannot build {onnx_name}: unsupported node(s) {named}{reason}"


def _configure(trt, builder, network, config, profiles: list[dict], capabilities: list[str]) -> None:
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for spec in profiles:
        unknown = set(spec) - inputs
        if unknown:
            raise ValueError(f"profile names {sorted(unknown)}, not inputs of the graph ({sorted(inputs)})")
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in spec.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    if capabilities:
        config.num_compute_capabilities = len(capabilities)
        for index, name in enumerate(capabilities):
            config.set_compute_capability(getattr(trt.ComputeCapability, name), index)


def _tensors(network) -> dict:
    def describe(t):
        return {"name": t.name, "dtype": str(t.dtype).split(".")[-1].lower(), "shape": list(t.shape)}

    return {
        "inputs": [describe(network.get_input(i)) for i in range(network.num_inputs)],
        "outputs": [describe(network.get_output(i)) for i in range(network.num_outputs)],
    }


def child(request: dict) -> int:
    import tensorrt_rtx as trt

    onnx_path, plan_path = Path(request["onnx"]), Path(request["plan"])
    report: dict = {"tensorrt_rtx": trt.__version__, "onnx": onnx_path.name}
    errors: list[str] = []
    logger = _logger(trt, errors)
    found = unsupported_nodes(trt, logger, onnx_path)
    report["unsupported"] = found
    if any(found.values()):
        report["refused"] = _refusal(onnx_path.name, found)
        return _finish(request, report, EXIT_REFUSED)
    started = time.perf_counter()
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # strongly typed: precision is the graph's
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        parse_errors = [" ".join(parser.get_error(i).desc().split()) for i in range(parser.num_errors)]
        report["refused"] = _refusal(onnx_path.name, {"nodes": [], "subgraphs": [], "errors": parse_errors})
        return _finish(request, report, EXIT_REFUSED)
    config = builder.create_builder_config()
    try:
        _configure(trt, builder, network, config, request["profiles"], request["compute_capabilities"])
    except ValueError as exc:
        report["refused"] = f"TensorRT-RTX build of {onnx_path.name}: {exc}"
        return _finish(request, report, EXIT_REFUSED)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        reason = " ".join((errors or ["no reason given"])[-1].split())[:300]
        report["refused"] = f"TensorRT-RTX could not build {onnx_path.name}: {reason}"
        return _finish(request, report, EXIT_REFUSED)
    plan_path.write_bytes(bytes(plan))
    report.update(
        _tensors(network),
        layers=network.num_layers,
        profiles=request["profiles"],
        compute_capabilities=request["compute_capabilities"] or "the library's default",
        build_s=round(time.perf_counter() - started, 3),
        plan_bytes=plan_path.stat().st_size,
        builder_errors=errors,
    )
    return _finish(request, report, 0)


def _finish(request: dict, report: dict, code: int) -> int:
    Path(request["report"]).write_text(json.dumps(report))
    return code


if __name__ == "__main__":
    sys.exit(child(json.loads(Path(sys.argv[1]).read_text())))
