"""Ray Serve glue: a custom autoscaling policy around :func:`autoscale.policy.decide`.

Plugged in with ``AutoscalingConfig(policy=AutoscalingPolicy(policy_function=
QueueGpuAutoscalingPolicy, policy_kwargs=PolicyConfig(...).model_dump()))``.
Serve instantiates the class once in its controller and calls it every
control-loop tick with an ``AutoscalingContext``. Replicas report
``queue_depth`` and ``gpu_util_pct`` from ``record_autoscaling_stats``.

Each decision is logged when it changes, counted in
``seekserve_autoscaler_decisions_total{deployment,kind}``, and the latest one
is written to Ray's internal KV for ``seekserve status``.
"""

from __future__ import annotations

import json
import logging
import time

from autoscale.policy import Decision, PolicyConfig, PolicyContext, PolicyState, decide

log = logging.getLogger("ray.serve")

QUEUE_METRIC = "queue_depth"
GPU_METRIC = "gpu_util_pct"
OCCUPANCY_METRIC = "batch_occupancy"
KV_NAMESPACE = "seekserve"


def kv_key(app: str, deployment: str) -> str:
    return f"autoscale/{app}/{deployment}"


def _newest_age(raw: dict | None, now: float) -> float | None:
    if not raw:
        return None
    newest = None
    for series in raw.values():
        for tv in series or []:
            newest = tv.timestamp if newest is None else max(newest, tv.timestamp)
    return None if newest is None else max(0.0, now - newest)


def context_from_ray(ctx, now: float) -> PolicyContext:
    agg = ctx.aggregated_metrics or {}
    raw = ctx.raw_metrics or {}
    queue = agg.get(QUEUE_METRIC)
    gpu = agg.get(GPU_METRIC)
    occupancy = agg.get(OCCUPANCY_METRIC)
    queue_values = None
    if queue:
        # requests still queued in callers' handles count too: the engine never saw them
        handle_queued = float(ctx.total_queued_requests or 0.0)
        per = handle_queued / max(1, len(queue))
        queue_values = tuple(float(v) + per for v in queue.values())
    return PolicyContext(
        now_s=now,
        current_replicas=int(ctx.target_num_replicas),
        min_replicas=int(ctx.capacity_adjusted_min_replicas),
        max_replicas=int(ctx.capacity_adjusted_max_replicas),
        queue_depth=queue_values,
        gpu_util_pct=tuple(float(v) for v in gpu.values()) if gpu else None,
        queue_age_s=_newest_age(raw.get(QUEUE_METRIC), now),
        gpu_age_s=_newest_age(raw.get(GPU_METRIC), now),
        occupancy=tuple(float(v) for v in occupancy.values()) if occupancy else None,
    )


class QueueGpuAutoscalingPolicy:
    def __init__(self, **policy_kwargs):
        self.config = PolicyConfig(**policy_kwargs)
        self._counter = None
        self._last_kind: dict[str, str] = {}

    def __call__(self, ctx) -> tuple[int, dict]:
        now = ctx.current_time or time.time()
        state = PolicyState.from_dict((ctx.policy_state or {}).get("seekserve"))
        decision = decide(self.config, context_from_ray(ctx, now), state)
        self._report(ctx, decision, now)
        return decision.desired_replicas, {"seekserve": decision.state.to_dict()}

    def _report(self, ctx, d: Decision, now: float) -> None:
        name = ctx.deployment_name
        if self._last_kind.get(name) != d.kind or d.desired_replicas != ctx.target_num_replicas:
            log.info("seekserve autoscaler %s: %s -> %d replicas: %s%s", name, d.kind, d.desired_replicas,
                     d.reason, f" ALERTS: {list(d.alerts)}" if d.alerts else "")
            self._last_kind[name] = d.kind
        try:
            if self._counter is None:
                from ray.util.metrics import Counter

                self._counter = Counter(
                    "seekserve_autoscaler_decisions",
                    description="Autoscaler decisions by deployment and kind.",
                    tag_keys=("deployment", "kind"),
                )
            self._counter.inc(1.0, tags={"deployment": name, "kind": d.kind})
            from ray.experimental import internal_kv

            record = {
                "time": now,
                "desired_replicas": d.desired_replicas,
                "current_replicas": ctx.current_num_replicas,
                "kind": d.kind,
                "reason": d.reason,
                "alerts": list(d.alerts),
            }
            internal_kv._internal_kv_put(
                kv_key(ctx.app_name or "", name), json.dumps(record).encode(), overwrite=True,
                namespace=KV_NAMESPACE,
            )
        except Exception as e:  # reporting must never break scaling
            log.debug("autoscaler report failed: %s", e)


def read_decision(app: str, deployment: str) -> dict | None:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(kv_key(app, deployment), namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None
