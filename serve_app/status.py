"""What `seekserve status` shows: per variant replicas (running / pending with
the reason), queue, GPU utilisation and the autoscaler's last decision."""

from __future__ import annotations

from dataclasses import dataclass, field

from autoscale.ray_policy import read_decision


@dataclass
class VariantStatus:
    app: str
    deployment: str
    status: str
    message: str
    replicas: dict[str, int]
    autoscaler: dict | None
    engine: dict = field(default_factory=dict)


def collect(app_name: str | None = None, engine_stats: dict | None = None) -> list[VariantStatus]:
    from ray import serve

    out = []
    st = serve.status()
    for app, a in st.applications.items():
        if app_name and app != app_name:
            continue
        for name, d in a.deployments.items():
            if not name.startswith("LLMServer-"):
                continue
            out.append(
                VariantStatus(
                    app=app,
                    deployment=name,
                    status=str(d.status.value if hasattr(d.status, "value") else d.status),
                    message=d.message or "",
                    replicas={str(k.value if hasattr(k, "value") else k): v for k, v in d.replica_states.items()},
                    autoscaler=read_decision(app, name),
                    engine=(engine_stats or {}).get(name, {}),
                )
            )
    return out


def render(rows: list[VariantStatus]) -> str:
    if not rows:
        return "no seekserve deployments are running"
    lines = []
    for r in rows:
        reps = ", ".join(f"{k.lower()} {v}" for k, v in sorted(r.replicas.items())) or "none"
        lines.append(f"{r.app}/{r.deployment}: {r.status} (replicas: {reps})")
        if r.message:
            lines.append(f"    {r.message}")
        e = r.engine
        if e:
            gpu = e.get("gpu_util_pct")
            w = e.get("warm_up") or {}
            kv_gb = f" of {w['kv_cache_gb']:.2f} GB" if w.get("kv_cache_gb") else ""
            weights = f", weights {w['weights_gb']:.2f} GB" if w.get("weights_gb") else ""
            lines.append(
                f"    queue {e.get('num_waiting', '?')} waiting / {e.get('num_running', '?')} running, "
                f"KV {100 * float(e.get('kv_cache_usage', 0)):.0f}%{kv_gb}{weights}, GPU "
                + ("n/a" if gpu is None else f"{gpu:.0f}%")
            )
        a = r.autoscaler
        if a:
            lines.append(f"    autoscaler: {a['kind']} -> {a['desired_replicas']} replicas: {a['reason']}")
            for alert in a.get("alerts", []):
                lines.append(f"    ALERT: {alert}")
    return "\n".join(lines)
