"""Kubernetes Pod Security Standards, "restricted" profile (which includes "baseline"), checked offline
on a pod spec as the admission controller checks it: `restricted_violations(pod)` lists every rule
the pod breaks, in words. Written from the standard's table
(https://kubernetes.io/docs/concepts/security/pod-security-standards/), field by field.

`hardening_violations(pod)` adds what deploy/ asks beyond the standard: a read-only root filesystem,
no service-account token, the image's own user, and every folder the server writes on a volume."""

from __future__ import annotations

from typing import Iterator

# restricted: the only volume types a pod may use.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
VOLUME_META = {"name"}
# baseline: the sysctls a pod may set.
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SECCOMP_ALLOWED = {"RuntimeDefault", "Localhost"}
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def containers(pod: dict) -> Iterator[tuple[str, dict]]:
    """(a path naming it, the container) for every container of the pod, init and ephemeral ones too."""
    for field in CONTAINER_LISTS:
        for i, container in enumerate(pod.get(field) or ()):
            yield f"{field}[{i}]({container.get('name')})", container


def restricted_violations(pod: dict) -> list[str]:
    """Every rule of Pod Security "restricted" that this pod spec breaks (empty: it is admitted)."""
    problems = _host_namespaces(pod) + _volumes(pod) + _sysctls(pod)
    pod_context = pod.get("securityContext") or {}
    problems += _selinux("spec.securityContext", pod_context)
    if (pod_context.get("windowsOptions") or {}).get("hostProcess"):
        problems.append("spec.securityContext.windowsOptions.hostProcess is true")
    for where, container in containers(pod):
        problems += _container(where, container, pod_context)
    return problems


def _host_namespaces(pod: dict) -> list[str]:
    return [f"spec.{field} is true" for field in ("hostNetwork", "hostPID", "hostIPC") if pod.get(field)]


def _volumes(pod: dict) -> list[str]:
    problems = []
    for volume in pod.get("volumes") or ():
        kinds = set(volume) - VOLUME_META
        for kind in sorted(kinds - RESTRICTED_VOLUMES):
            problems.append(
                f"volume {volume.get('name')!r} is of type {kind} (restricted allows {sorted(RESTRICTED_VOLUMES)})"
            )
    return problems


def _sysctls(pod: dict) -> list[str]:
    sysctls = (pod.get("securityContext") or {}).get("sysctls") or ()
    return [f"sysctl {s.get('name')} is not one of the safe set" for s in sysctls if s.get("name") not in SAFE_SYSCTLS]


def _selinux(where: str, context: dict) -> list[str]:
    options = context.get("seLinuxOptions") or {}
    problems = []
    if options.get("type") not in SELINUX_TYPES:
        problems.append(f"{where}.seLinuxOptions.type {options.get('type')!r} is not a container type")
    problems += [f"{where}.seLinuxOptions.{field} is set" for field in ("user", "role") if options.get(field)]
    return problems


def _effective(field: str, container_context: dict, pod_context: dict):
    """A container's setting: its own where it sets one, else the pod's."""
    value = container_context.get(field)
    return pod_context.get(field) if value is None else value


def _container(where: str, container: dict, pod_context: dict) -> list[str]:
    context = container.get("securityContext") or {}
    problems = _selinux(f"{where}.securityContext", context)
    if context.get("privileged"):
        problems.append(f"{where} is privileged")
    if context.get("procMount") not in (None, "Default"):
        problems.append(f"{where}.securityContext.procMount is {context.get('procMount')!r}")
    if (context.get("windowsOptions") or {}).get("hostProcess"):
        problems.append(f"{where}.securityContext.windowsOptions.hostProcess is true")
    problems += [
        f"{where} publishes hostPort {port['hostPort']}"
        for port in container.get("ports") or ()
        if port.get("hostPort")
    ]
    if context.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}.securityContext.allowPrivilegeEscalation is not false")
    if _effective("runAsNonRoot", context, pod_context) is not True:
        problems.append(f"{where}: runAsNonRoot is not true (on the container or the pod)")
    for owner, ctx in ((f"{where}.securityContext", context), ("spec.securityContext", pod_context)):
        if ctx.get("runAsUser") == 0:
            problems.append(f"{owner}.runAsUser is 0 (root)")
    problems += _seccomp(where, context, pod_context)
    problems += _apparmor(where, context, pod_context)
    problems += _capabilities(where, context)
    return problems


def _seccomp(where: str, context: dict, pod_context: dict) -> list[str]:
    profile = _effective("seccompProfile", context, pod_context) or {}
    if profile.get("type") not in SECCOMP_ALLOWED:
        return [
            f"{where}: seccompProfile.type is {profile.get('type')!r} (RuntimeDefault or Localhost, container or pod)"
        ]
    return []


def _apparmor(where: str, context: dict, pod_context: dict) -> list[str]:
    profile = _effective("appArmorProfile", context, pod_context) or {}
    return [f"{where}: appArmorProfile is Unconfined"] if profile.get("type") == "Unconfined" else []


def _capabilities(where: str, context: dict) -> list[str]:
    capabilities = context.get("capabilities") or {}
    problems = []
    if "ALL" not in (capabilities.get("drop") or ()):
        problems.append(f"{where}.securityContext.capabilities.drop does not hold ALL")
    added = [c for c in capabilities.get("add") or () if c != "NET_BIND_SERVICE"]
    if added:
        problems.append(f"{where}.securityContext.capabilities.add holds {added} (only NET_BIND_SERVICE may be added)")
    return problems


def hardening_violations(pod: dict, user: int) -> list[str]:
    """What deploy/ asks beyond "restricted": a read-only root filesystem, the image's numeric user,
    no service-account token, and every folder the server writes (TMPDIR, OPTIMIZE_CACHE,
    XDG_CONFIG_HOME, XDG_CACHE_HOME, OPTIMIZE_CACHE_KEY's folder) on an emptyDir the container mounts
    writable."""
    problems = []
    if pod.get("automountServiceAccountToken") is not False:
        problems.append("spec.automountServiceAccountToken is not false")
    empty_dirs = {v["name"] for v in pod.get("volumes") or () if "emptyDir" in v}
    pod_context = pod.get("securityContext") or {}
    for where, container in containers(pod):
        context = container.get("securityContext") or {}
        if context.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}.securityContext.readOnlyRootFilesystem is not true")
        if _effective("runAsUser", context, pod_context) != user:
            problems.append(f"{where}: runAsUser is not the image's user {user}")
        problems += _writable_folders(where, container, empty_dirs)
    return problems


WRITTEN_FOLDERS = ("TMPDIR", "OPTIMIZE_CACHE", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")


def _writable_folders(where: str, container: dict, empty_dirs: set[str]) -> list[str]:
    env = {e["name"]: e.get("value") for e in container.get("env") or ()}
    writable = [
        m["mountPath"].rstrip("/")
        for m in container.get("volumeMounts") or ()
        if m.get("name") in empty_dirs and not m.get("readOnly")
    ]
    folders = {name: env.get(name) for name in WRITTEN_FOLDERS}
    if env.get("OPTIMIZE_CACHE_KEY"):
        folders["OPTIMIZE_CACHE_KEY"] = env["OPTIMIZE_CACHE_KEY"].rsplit("/", 1)[0]
    problems = []
    for name, folder in folders.items():
        if not folder:
            problems.append(f"{where}: {name} is not set (its default lies on the read-only root filesystem)")
        elif not any(folder == m or folder.startswith(m + "/") for m in writable):
            problems.append(f"{where}: {name}={folder} is not on a writable emptyDir")
    return problems
