"""The autoscaling decision, as a pure function.

``decide(config, context, state) -> Decision(desired_replicas, state, reason, alerts)``.
No clock is read and nothing is imported from Ray: the caller passes ``now_s``
in the context, so tests drive time by hand and the Ray adapter
(:mod:`autoscale.ray_policy`) stays a few lines of translation.

Decision table (per-replica means; thresholds in :class:`PolicyConfig`):

=========  =========  ==========================================================
queue      GPU        action
=========  =========  ==========================================================
low        low        hold; scale down by one once both stay low ``downscale_delay_s``
high       high       scale up by 1 (by 2 when queue >= 2x threshold) once it has
                      held ``upscale_delay_s``; no new step during ``cooldown_s``
high       low        hold and alert: the queue grows while GPUs idle, so the
                      bottleneck is not GPU compute (more replicas will not help)
low        high       hold
=========  =========  ==========================================================

NVML's utilisation is a duty cycle: it reads near 100% as soon as one sequence
decodes (dcgm-exporter#301), so "GPU low" would almost never hold while any
traffic flows and replicas added for a peak would never be released. The GPU
therefore also counts as low when the batch occupancy (running sequences over
the engine's batch size, reported by each replica) is so low that the remaining
replicas would hold today's load at most ``downscale_max_occupancy`` full.

"High" and "low" use separate thresholds (hysteresis): between the low and
high threshold of a signal nothing changes and the timers reset. A missing or
stale GPU signal is a result, not a crash: the policy decides on the queue
alone and says so in the reason and an alert. A missing queue signal holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from pydantic import Field, model_validator

from serve_app._model import StrictModel

ALERT_GPU_IDLE = "queue growing while GPU idle: latency bottleneck is not GPU compute"
ALERT_GPU_MISSING = "GPU utilisation unavailable: deciding on queue depth alone"


class PolicyConfig(StrictModel):
    queue_high: float = Field(15.0, gt=0, description="Waiting requests per replica that count as high.")
    queue_low: float = Field(5.0, ge=0, description="Waiting requests per replica that count as low.")
    gpu_high_pct: float = Field(75.0, gt=0, le=100, description="GPU utilisation (%) that counts as high.")
    gpu_low_pct: float = Field(50.0, ge=0, le=100, description="GPU utilisation (%) that counts as low.")
    upscale_delay_s: float = Field(30.0, ge=0, description="High must hold this long before scaling up.")
    downscale_delay_s: float = Field(300.0, ge=0, description="Low must hold this long before scaling down.")
    cooldown_s: float = Field(60.0, ge=0, description="No new scale step this long after the last one.")
    max_step: int = Field(2, ge=1, le=100, description="Most replicas added in one step.")
    downscale_max_occupancy: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Scale down (queue low) also when, without one replica, the rest would be at most "
        "this full; NVML utilisation alone stays high under any load.",
    )
    metric_max_age_s: float = Field(
        60.0, gt=0, description="A signal older than this is stale and treated as missing."
    )

    @model_validator(mode="after")
    def _hysteresis(self) -> "PolicyConfig":
        if self.queue_low >= self.queue_high:
            raise ValueError(f"queue_low ({self.queue_low}) must be below queue_high ({self.queue_high})")
        if self.gpu_low_pct >= self.gpu_high_pct:
            raise ValueError(
                f"gpu_low_pct ({self.gpu_low_pct}) must be below gpu_high_pct ({self.gpu_high_pct})"
            )
        return self


@dataclass(frozen=True)
class PolicyContext:
    now_s: float
    current_replicas: int
    min_replicas: int
    max_replicas: int
    # per replica; None = the signal is missing for the whole deployment
    queue_depth: tuple[float, ...] | None
    gpu_util_pct: tuple[float, ...] | None
    # age of the newest sample of each signal (None = unknown, taken as fresh)
    queue_age_s: float | None = None
    gpu_age_s: float | None = None
    # per replica running sequences / batch size, 0..1 (None = not reported)
    occupancy: tuple[float, ...] | None = None


@dataclass(frozen=True)
class PolicyState:
    high_since_s: float | None = None
    low_since_s: float | None = None
    last_scale_s: float | None = None
    last_reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "PolicyState":
        if not d:
            return cls()
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


@dataclass(frozen=True)
class Decision:
    desired_replicas: int
    state: PolicyState
    reason: str
    alerts: tuple[str, ...] = field(default=())
    # a short machine label of the reason, for metrics
    kind: str = "hold"


def _mean(xs: tuple[float, ...] | None) -> float | None:
    if not xs:
        return None
    return sum(xs) / len(xs)


def decide(cfg: PolicyConfig, ctx: PolicyContext, state: PolicyState) -> Decision:
    now = ctx.now_s
    cur = ctx.current_replicas
    lo, hi = ctx.min_replicas, max(ctx.min_replicas, ctx.max_replicas)
    alerts: list[str] = []

    def out(desired: int, reason: str, kind: str, **changes) -> Decision:
        bounded = min(max(desired, lo), hi)
        if bounded != desired:
            reason += f" (bounded to [{lo}, {hi}])"
        new_state = replace(state, last_reason=reason, **changes)
        if bounded != cur:
            new_state = replace(new_state, last_scale_s=now, high_since_s=None, low_since_s=None)
        return Decision(bounded, new_state, reason, tuple(alerts), kind)

    if cur < lo or cur > hi:
        return out(cur, f"replicas {cur} outside bounds [{lo}, {hi}]", "bounds")

    queue_fresh = ctx.queue_age_s is None or ctx.queue_age_s <= cfg.metric_max_age_s
    q = _mean(ctx.queue_depth) if queue_fresh else None
    if q is None:
        return out(cur, "queue depth missing or stale: holding", "missing_queue",
                   high_since_s=None, low_since_s=None)

    gpu_fresh = ctx.gpu_age_s is None or ctx.gpu_age_s <= cfg.metric_max_age_s
    g = _mean(ctx.gpu_util_pct) if gpu_fresh else None
    if g is None:
        alerts.append(ALERT_GPU_MISSING)

    queue_high, queue_low = q >= cfg.queue_high, q <= cfg.queue_low
    gpu_high = g is None or g >= cfg.gpu_high_pct
    occ = _mean(ctx.occupancy)
    consolidates = occ is not None and cur > 1 and occ * cur / (cur - 1) <= cfg.downscale_max_occupancy
    gpu_low = g is None or g <= cfg.gpu_low_pct or consolidates
    sig = f"queue {q:.1f}/replica, GPU " + ("n/a" if g is None else f"{g:.0f}%")
    if occ is not None:
        sig += f", batch {100 * occ:.0f}% full"
    in_cooldown = state.last_scale_s is not None and now - state.last_scale_s < cfg.cooldown_s

    if queue_high and not gpu_high and g is not None:
        alerts.append(ALERT_GPU_IDLE)
        return out(cur, f"{sig}: queue high but GPU not busy; not scaling up", "gpu_idle_alert",
                   high_since_s=None, low_since_s=None)

    if queue_high and gpu_high:
        since = state.high_since_s if state.high_since_s is not None else now
        held = now - since
        step = 2 if q >= 2 * cfg.queue_high else 1
        step = min(step, cfg.max_step)
        if cur >= hi:
            return out(cur, f"{sig}: high load but already at max_replicas {hi}", "at_max",
                       high_since_s=since, low_since_s=None)
        if held < cfg.upscale_delay_s:
            return out(cur, f"{sig}: high for {held:.0f}s of {cfg.upscale_delay_s:g}s before scaling up",
                       "stabilizing_up", high_since_s=since, low_since_s=None)
        if in_cooldown:
            return out(cur, f"{sig}: high, but in cooldown after the last scale step", "cooldown",
                       high_since_s=since, low_since_s=None)
        return out(cur + step, f"{sig}: high on both for {held:.0f}s: scale up by {step}", "scale_up",
                   high_since_s=since, low_since_s=None)

    if queue_low and gpu_low:
        since = state.low_since_s if state.low_since_s is not None else now
        held = now - since
        if cur <= lo:
            return out(cur, f"{sig}: low, already at min_replicas {lo}", "at_min",
                       high_since_s=None, low_since_s=since)
        if held < cfg.downscale_delay_s:
            return out(cur, f"{sig}: low for {held:.0f}s of {cfg.downscale_delay_s:g}s before scaling down",
                       "stabilizing_down", high_since_s=None, low_since_s=since)
        if in_cooldown:
            return out(cur, f"{sig}: low, but in cooldown after the last scale step", "cooldown",
                       high_since_s=None, low_since_s=since)
        return out(cur - 1, f"{sig}: low on both for {held:.0f}s: scale down by 1", "scale_down",
                   high_since_s=None, low_since_s=since)

    if not queue_high and g is not None and g >= cfg.gpu_high_pct:
        return out(cur, f"{sig}: GPU busy but queue not high: hold", "hold",
                   high_since_s=None, low_since_s=None)
    return out(cur, f"{sig}: within the hysteresis band: hold", "hold", high_since_s=None, low_since_s=None)
