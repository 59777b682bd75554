"""NCCL environment: per-topology profiles and validation against NCCL's documented ranges.

Profiles are small on purpose: NCCL tunes algorithm, protocol and channel counts
itself from the topology it detects, and most "tuning" copied between clusters
(the widely shared ``NCCL_ALGO=ring NCCL_PROTO=ll128 NCCL_SHM_DISABLE=1
NCCL_IB_DISABLE=1 NCCL_SOCKET_NTHREADS=8 NCCL_NTHREADS=8`` set) are debugging
switches that take fast paths away. A profile sets only what NCCL cannot know:
which transport to avoid, which interfaces to use, and that NVLink multicast
(NVLS) stays off where the platform forbids it.

:func:`validate` returns every problem found: errors (values NCCL rejects or
that are outside its documented range) and warnings (valid values that are
known to hurt). :func:`check` raises :class:`NcclConfigError` listing all errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Topology = Literal["nvlink", "pcie", "multi_node_ib", "multi_node_tcp"]
TOPOLOGIES: tuple[str, ...] = ("nvlink", "pcie", "multi_node_ib", "multi_node_tcp")

_ALGOS = {"ring", "tree", "collnetchain", "collnetdirect", "nvls", "nvlstree", "pat"}
_PROTOS = {"ll", "ll128", "simple"}
_NTHREADS = {64, 128, 256, 512}
_BOOLEANS = (
    "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE", "NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE",
    "NCCL_CUMEM_ENABLE", "NCCL_NET_GDR_READ", "NCCL_COLLNET_ENABLE",
)
_DEBUG = {"version", "warn", "info", "trace"}
# knobs we recognise; anything else named NCCL_* is flagged as undocumented
_KNOWN = set(_BOOLEANS) | {
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_NTHREADS", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD",
    "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL", "NCCL_P2P_LEVEL",
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE",
    "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_CROSS_NIC", "NCCL_NVLS_ENABLE",
}
_PATH_LEVELS = {"loc", "nvl", "pix", "pxb", "phb", "sys"}


class NcclConfigError(ValueError):
    """An NCCL environment that NCCL would reject or that is outside its documented range."""


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning"]
    var: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.var}: {self.message}"


def _int(env, var, findings) -> int | None:
    raw = env.get(var)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        findings.append(Finding("error", var, f"{raw!r} is not an integer"))
        return None


def _list_knob(env, var, allowed, findings) -> set[str] | None:
    raw = env.get(var)
    if raw is None:
        return None
    negate = raw.startswith("^")
    items = [x.strip().lower() for x in raw.lstrip("^").split(",") if x.strip()]
    if not items:
        findings.append(Finding("error", var, "is empty"))
        return None
    bad = [x for x in items if x not in allowed]
    if bad:
        findings.append(Finding("error", var, f"unknown value(s) {bad}; allowed: {sorted(allowed)} "
                                               "(comma-separated, '^' to exclude)"))
        return None
    return (allowed - set(items)) if negate else set(items)


def validate(env: dict[str, str], topology: str | None = None, multicast_allowed: bool = False) -> list[Finding]:
    f: list[Finding] = []
    for var in env:
        if var.startswith("NCCL_") and var not in _KNOWN:
            f.append(Finding("warning", var, "not a knob seekserve knows; check NCCL's documentation"))

    n = _int(env, "NCCL_NTHREADS", f)
    if n is not None and n not in _NTHREADS:
        f.append(Finding("error", "NCCL_NTHREADS", f"{n} is not one of {sorted(_NTHREADS)} (threads per CUDA block)"))

    st = _int(env, "NCCL_SOCKET_NTHREADS", f)
    ns = _int(env, "NCCL_NSOCKS_PERTHREAD", f)
    if st is not None and not 1 <= st <= 16:
        f.append(Finding("error", "NCCL_SOCKET_NTHREADS", f"{st} is outside 1..16"))
    if ns is not None and ns < 1:
        f.append(Finding("error", "NCCL_NSOCKS_PERTHREAD", f"{ns} must be at least 1"))
    if st is not None and ns is not None and st * ns > 64:
        f.append(Finding("error", "NCCL_SOCKET_NTHREADS", f"{st} x NCCL_NSOCKS_PERTHREAD {ns} = {st * ns} exceeds 64 sockets"))

    algos = _list_knob(env, "NCCL_ALGO", _ALGOS, f)
    protos = _list_knob(env, "NCCL_PROTO", _PROTOS, f)

    for var in _BOOLEANS:
        if var in env and env[var] not in ("0", "1"):
            f.append(Finding("error", var, f"{env[var]!r} must be 0 or 1"))
    if "NCCL_DEBUG" in env and env["NCCL_DEBUG"].lower() not in _DEBUG:
        f.append(Finding("error", "NCCL_DEBUG", f"{env['NCCL_DEBUG']!r} is not one of {sorted(_DEBUG)}"))
    for var in ("NCCL_P2P_LEVEL", "NCCL_NET_GDR_LEVEL"):
        raw = env.get(var)
        if raw is not None and raw.lower() not in _PATH_LEVELS and not raw.isdigit():
            f.append(Finding("error", var, f"{raw!r} is not a path level {sorted(_PATH_LEVELS)}"))
    lo, hi = _int(env, "NCCL_MIN_NCHANNELS", f), _int(env, "NCCL_MAX_NCHANNELS", f)
    if lo is not None and hi is not None and lo > hi:
        f.append(Finding("error", "NCCL_MIN_NCHANNELS", f"{lo} exceeds NCCL_MAX_NCHANNELS {hi}"))

    if env.get("NCCL_NVLS_ENABLE") == "1" and not multicast_allowed:
        f.append(Finding("error", "NCCL_NVLS_ENABLE", "NVLink multicast (NVLS) must stay off on this platform"))

    # valid but harmful (debugging switches)
    if algos is not None and algos == {"ring"}:
        f.append(Finding("warning", "NCCL_ALGO", "forcing Ring drops NVLS and Tree: slower all-reduce on NVLink "
                                                 "boxes and at scale; a debugging switch, not tuning"))
    if protos is not None and protos == {"ll128"}:
        f.append(Finding("warning", "NCCL_PROTO", "LL128 alone drops Simple and LL: large messages slow down, "
                                                  "and LL128 can corrupt data on platforms that do not support it"))
    if env.get("NCCL_SHM_DISABLE") == "1":
        f.append(Finding("warning", "NCCL_SHM_DISABLE", "disables the shared-memory transport: no fallback when "
                                                        "P2P is unavailable between two GPUs"))
    if env.get("NCCL_P2P_DISABLE") == "1":
        f.append(Finding("warning", "NCCL_P2P_DISABLE", "disables NVLink/PCIe peer-to-peer: traffic goes through host memory"))
    if env.get("NCCL_IB_DISABLE") == "1" and topology in (None, "multi_node_ib"):
        f.append(Finding("warning", "NCCL_IB_DISABLE", "forces sockets between nodes: no InfiniBand/RoCE "
                                                       "(harmless on one node, slow across nodes)"))
    if st is not None and st > 4 and topology in (None, "nvlink", "pcie", "multi_node_ib"):
        f.append(Finding("warning", "NCCL_SOCKET_NTHREADS", "only the socket transport uses it; more threads cost "
                                                            "CPU for nothing unless traffic goes over TCP"))
    if env.get("NCCL_DEBUG", "").lower() in ("info", "trace"):
        f.append(Finding("warning", "NCCL_DEBUG", "verbose logging on every rank; for debugging only"))
    return f


def check(env: dict[str, str], topology: str | None = None, multicast_allowed: bool = False) -> list[Finding]:
    """Raise :class:`NcclConfigError` listing every error; return the warnings."""
    findings = validate(env, topology, multicast_allowed)
    errors = [x for x in findings if x.level == "error"]
    if errors:
        raise NcclConfigError("; ".join(f"{e.var}: {e.message}" for e in errors))
    return findings


def profile(topology: str, socket_ifname: str | None = None, ib_hca: str | None = None,
            multicast_allowed: bool = False) -> dict[str, str]:
    """The env vars seekserve sets for a topology (validated)."""
    if topology not in TOPOLOGIES:
        raise NcclConfigError(f"unknown topology {topology!r}; valid: {', '.join(TOPOLOGIES)}")
    env = {"NCCL_NVLS_ENABLE": "1" if multicast_allowed else "0"}
    if topology in ("nvlink", "pcie"):
        # one node: no network transport to probe or time out on
        env["NCCL_IB_DISABLE"] = "1"
    if topology == "pcie":
        # P2P over PCIe switches only; through the CPU root complex it is often slower than SHM
        env["NCCL_P2P_LEVEL"] = "PXB"
    if topology == "multi_node_ib":
        env["NCCL_IB_DISABLE"] = "0"
        env["NCCL_NET_GDR_LEVEL"] = "PHB"
        if ib_hca:
            env["NCCL_IB_HCA"] = ib_hca
    if topology == "multi_node_tcp":
        env["NCCL_IB_DISABLE"] = "1"
        # 4 x 4 = 16 sockets per peer: enough to fill 100 GbE, within NCCL's 64 cap
        env["NCCL_SOCKET_NTHREADS"] = "4"
        env["NCCL_NSOCKS_PERTHREAD"] = "4"
    if socket_ifname and topology.startswith("multi_node"):
        env["NCCL_SOCKET_IFNAME"] = socket_ifname
    check(env, topology, multicast_allowed)
    return env


@dataclass
class TopologyReport:
    topology: str | None
    gpus: int
    nvlink_pairs: int
    reason: str


def detect(num_nodes: int = 1, has_infiniband: bool | None = None) -> TopologyReport:
    """Read the local GPUs' NVLink peer-to-peer status from NVML."""
    if num_nodes > 1:
        if has_infiniband is None:
            import os

            has_infiniband = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
        topo = "multi_node_ib" if has_infiniband else "multi_node_tcp"
        return TopologyReport(topo, 0, 0, f"{num_nodes} nodes, InfiniBand {'found' if has_infiniband else 'absent'}")
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        pairs = 0
        for i in range(n):
            for j in range(i + 1, n):
                status = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                pairs += status == pynvml.NVML_P2P_STATUS_OK
    except Exception as e:
        return TopologyReport(None, 0, 0, f"NVML unavailable: {type(e).__name__}: {e}")
    if n <= 1:
        return TopologyReport("pcie", n, 0, f"{n} GPU: no peer traffic")
    topo = "nvlink" if pairs == n * (n - 1) // 2 else "pcie"
    return TopologyReport(topo, n, pairs, f"{pairs} of {n * (n - 1) // 2} GPU pairs have NVLink P2P")
