"""The Kubernetes manifests in deploy/, rendered with `kubectl kustomize` and checked offline: core
kinds against Kubernetes' own JSON schemas (kubernetes-validate), KServe's kinds against the kserve
package's models (every field known, every required field there, every value of its type); and what
they say about this server (its flags, routes, port, drain) against the server itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from serve.__main__ import build_parser
from serve.config import ServeConfig
from tests.support.serve import ROOT

DEPLOY = ROOT / "deploy"
KSERVE_KINDS = {"InferenceService": "V1beta1InferenceService", "ServingRuntime": "V1alpha1ServingRuntime"}
PRE_STOP_S = 5


def render(folder: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (kubectl kustomize renders the manifests)")
    proc = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def model_class(type_name: str):
    import kserve.models
    import kubernetes.client.models

    return getattr(kserve.models, type_name, None) or getattr(kubernetes.client.models, type_name, None)


SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def build(data, type_name: str, path: str):
    """`data` as the generated model `type_name` (OpenAPI generator classes: openapi_types and
    attribute_map), refusing unknown fields, wrong types and missing required fields (the classes'
    own setters raise ValueError for those)."""
    if type_name.startswith("list["):
        assert isinstance(data, list), f"{path}: expected a list"
        return [build(item, type_name[5:-1], f"{path}[{i}]") for i, item in enumerate(data)]
    if type_name.startswith("dict("):
        assert isinstance(data, dict), f"{path}: expected a mapping"
        value_type = type_name[5:-1].split(",", 1)[1].strip()
        return {k: build(v, value_type, f"{path}.{k}") for k, v in data.items()}
    if type_name in SCALARS:
        assert isinstance(data, SCALARS[type_name]), f"{path}: expected {type_name}, got {data!r}"
        return data
    cls = model_class(type_name)
    if cls is None:  # quantities, int-or-string and the like: free-form in the generated client
        return data
    assert isinstance(data, dict), f"{path}: expected a {type_name} mapping"
    fields = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    unknown = sorted(set(data) - set(fields))
    assert not unknown, f"{path}: fields {type_name} does not have: {unknown}"
    kwargs = {fields[k]: build(v, cls.openapi_types[fields[k]], f"{path}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise AssertionError(f"{path}: {exc}") from None


def check(doc: dict):
    kind = doc["kind"]
    if kind in KSERVE_KINDS:
        return build(doc, KSERVE_KINDS[kind], kind)
    import kubernetes_validate  # the fleet extra (make install)

    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    return doc


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in docs}


@pytest.mark.parametrize("folder", ["kserve/base", "kserve/canary", "kubernetes"])
def test_manifests_render_and_validate_offline(folder):
    docs = render(DEPLOY / folder)
    assert docs
    for doc in docs:
        check(doc)


def test_a_manifest_with_an_unknown_field_is_refused():
    """The check is a check: a misspelt field (KServe would drop it silently) and a missing required
    one fail it."""
    service = by_kind(render(DEPLOY / "kserve/base"))["InferenceService"]
    service["spec"]["predictor"]["canaryTrafficPercnt"] = 10
    with pytest.raises(AssertionError, match="canaryTrafficPercnt"):
        check(service)
    runtime = by_kind(render(DEPLOY / "kserve/base"))["ServingRuntime"]
    del runtime["spec"]["containers"][0]["name"]
    with pytest.raises(AssertionError, match="name"):
        check(runtime)


def test_canary_sends_a_slice_to_the_second_artifact():
    base = by_kind(render(DEPLOY / "kserve/base"))["InferenceService"]
    canary = by_kind(render(DEPLOY / "kserve/canary"))["InferenceService"]
    assert "canaryTrafficPercent" not in base["spec"]["predictor"]
    assert 0 < canary["spec"]["predictor"]["canaryTrafficPercent"] < 100
    uri = lambda doc: doc["spec"]["predictor"]["model"]["storageUri"]  # noqa: E731
    assert uri(canary) != uri(base)
    assert canary["metadata"]["name"] == base["metadata"]["name"]  # the same service, a new revision


def containers(folder: str) -> list[tuple[dict, dict]]:
    """(container, the pod-level spec around it) of every serving container in the rendering."""
    docs = by_kind(render(DEPLOY / folder))
    if "ServingRuntime" in docs:
        predictor = docs["InferenceService"]["spec"]["predictor"]
        return [(c, predictor) for c in docs["ServingRuntime"]["spec"]["containers"]]
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    return [(c, pod) for c in pod["containers"]]


@pytest.mark.parametrize("folder", ["kserve/base", "kubernetes"])
def test_containers_run_this_server_as_it_is(folder):
    """The flags are flags of `python -m serve`, the probes hit its health routes on its port, and
    the pod is given longer to stop than the server's drain after the preStop pause."""
    from serve.protocols.kserve import routes

    paths = {route.path for route in routes()}
    for container, pod in containers(folder):
        args = build_parser().parse_args([a.replace("{{.Name}}", "minilm") for a in container["args"]])
        ports = {p["containerPort"] for p in container["ports"]}
        assert args.port in ports
        assert args.host == "0.0.0.0"
        assert args.require_signature  # the artifact is verified against a signed manifest
        for probe, path in (("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live")):
            get = container[probe]["httpGet"]
            assert get["path"] == path and path in paths
            assert get["port"] == args.port or get["port"] in {p.get("name") for p in container["ports"]}
        assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == PRE_STOP_S
        drain_s = (args.timeout_s or ServeConfig().timeout_s) + 5  # uvicorn's graceful timeout (serve.__main__)
        assert pod["terminationGracePeriodSeconds"] > PRE_STOP_S + drain_s
        assert container["resources"]["requests"] and container["resources"]["limits"]


# --- Pod Security "restricted", and what the pods run -------------------------------------------

IMAGE_USER = 10001  # serve/Dockerfile.cpu's USER


def kserve_pod(runtime: dict, service: dict) -> dict:
    """The pod KServe builds from the two: the predictor's pod-level fields, the runtime's containers
    (the predictor's model block merged into kserve-container, as KServe merges it) and both volume lists."""
    predictor = service["spec"]["predictor"]
    model = {k: v for k, v in (predictor.get("model") or {}).items() if k in ("securityContext", "env", "volumeMounts")}
    pod_containers = [{**c, **model} if c["name"] == "kserve-container" else c for c in runtime["spec"]["containers"]]
    volumes = [*(runtime["spec"].get("volumes") or []), *(predictor.get("volumes") or [])]
    return {**predictor, "containers": pod_containers, "volumes": volumes}


def pod_specs(folder: str) -> list[dict]:
    """Every pod spec the rendering of `folder` makes."""
    docs = by_kind(render(DEPLOY / folder))
    if "ServingRuntime" in docs:
        return [kserve_pod(docs["ServingRuntime"], docs["InferenceService"])]
    return [doc["spec"]["template"]["spec"] for doc in docs.values() if "template" in doc.get("spec", {})]


@pytest.mark.parametrize("folder", ["kserve/base", "kserve/canary", "kubernetes"])
def test_every_pod_meets_pod_security_restricted(folder):
    from tests.support.pod_security import hardening_violations, restricted_violations

    pods = pod_specs(folder)
    assert pods
    for pod in pods:
        assert restricted_violations(pod) == []
        assert hardening_violations(pod, IMAGE_USER) == []


def test_the_pod_security_check_sees_every_rule_it_claims():
    """A pod breaking each rule is refused for each, by name; the compliant rendering with one setting
    undone is refused for that setting."""
    from tests.support.pod_security import hardening_violations, restricted_violations

    hostile = {
        "hostNetwork": True,
        "hostPID": True,
        "securityContext": {"runAsUser": 0, "sysctls": [{"name": "kernel.msgmax", "value": "1"}]},
        "volumes": [{"name": "root", "hostPath": {"path": "/"}}, {"name": "scratch", "emptyDir": {}}],
        "initContainers": [{"name": "init", "image": "x:1", "securityContext": {"privileged": True}}],
        "containers": [
            {
                "name": "app",
                "image": "x:1",
                "ports": [{"containerPort": 80, "hostPort": 80}],
                "securityContext": {
                    "runAsNonRoot": False,
                    "allowPrivilegeEscalation": True,
                    "capabilities": {"add": ["SYS_ADMIN"]},
                    "seccompProfile": {"type": "Unconfined"},
                    "procMount": "Unmasked",
                },
            }
        ],
    }
    said = "\n".join(restricted_violations(hostile))
    for rule in (
        "hostNetwork",
        "hostPID",
        "hostPath",
        "kernel.msgmax",
        "runAsUser is 0",
        "initContainers[0](init) is privileged",
        "hostPort 80",
        "containers[0](app).securityContext.allowPrivilegeEscalation",
        "containers[0](app): runAsNonRoot",
        "initContainers[0](init): runAsNonRoot",
        "seccompProfile.type is 'Unconfined'",
        "initContainers[0](init): seccompProfile.type is None",
        "capabilities.drop does not hold ALL",
        "SYS_ADMIN",
        "procMount",
    ):
        assert rule in said, f"{rule!r} not reported in:\n{said}"
    assert "scratch" not in said  # an emptyDir is allowed
    hardened = "\n".join(hardening_violations(hostile, IMAGE_USER))
    for rule in ("automountServiceAccountToken", "readOnlyRootFilesystem", "runAsUser is not", "TMPDIR is not set"):
        assert rule in hardened, f"{rule!r} not reported in:\n{hardened}"


UNDONE = [
    ("drop", lambda pod, c: c["securityContext"]["capabilities"].update(drop=[]), "capabilities.drop"),
    (
        "seccomp",
        lambda pod, c: (pod["securityContext"].pop("seccompProfile"), c["securityContext"].pop("seccompProfile")),
        "seccompProfile",
    ),
    ("escalation", lambda pod, c: c["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    ("root", lambda pod, c: c["securityContext"].update(runAsUser=0), "runAsUser is 0"),
    ("token", lambda pod, c: pod.pop("automountServiceAccountToken"), "automountServiceAccountToken"),
    ("rootfs", lambda pod, c: c["securityContext"].update(readOnlyRootFilesystem=False), "readOnlyRootFilesystem"),
    (
        "tmp",
        lambda pod, c: c.update(volumeMounts=[m for m in c["volumeMounts"] if m["mountPath"] != "/tmp"]),
        "TMPDIR=/tmp",
    ),
]


@pytest.mark.parametrize("folder", ["kserve/base", "kubernetes"])
@pytest.mark.parametrize("name, undo, says", UNDONE, ids=[u[0] for u in UNDONE])
def test_a_rendered_pod_with_one_setting_undone_is_refused_for_it(folder, name, undo, says):
    from tests.support.pod_security import hardening_violations, restricted_violations

    pod = pod_specs(folder)[0]
    undo(pod, pod["containers"][0])
    said = "\n".join(restricted_violations(pod) + hardening_violations(pod, IMAGE_USER))
    assert says in said, said


@pytest.mark.parametrize("folder", ["kserve/base", "kserve/canary", "kubernetes"])
def test_images_are_pinned_by_version_and_pulled_once(folder):
    """Every container's image names a version (the project's, as serve/Dockerfile.cpu is tagged) or a
    digest, never :latest or no tag; a node pulls it once (IfNotPresent), not on every start."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    from tests.support.pod_security import containers as pod_containers

    for pod in pod_specs(folder):
        for where, container in pod_containers(pod):
            image = container["image"]
            if "@sha256:" not in image:
                name, _, tag = image.rpartition(":")
                assert name and "/" not in tag and tag != "latest", f"{where}: {image} names no version"
                assert tag == version, f"{where}: {image} is not the project's version {version}"
            assert container.get("imagePullPolicy") == "IfNotPresent", f"{where}: {container.get('imagePullPolicy')}"
