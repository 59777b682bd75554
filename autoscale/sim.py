"""Trace-driven autoscaling simulator.

A deployment of LLM replicas, each with ``slots`` concurrent sequences
(continuous batching), a shared FIFO queue, Poisson arrivals at a rate that
follows a diurnal curve plus bursts, exponentially distributed generation
times, a prefill time added to time-to-first-token, and a replica start-up
delay. Every ``control_interval_s`` a policy sees the signals a real
deployment reports and returns a replica count.

GPU utilisation is modelled the way NVML reports it for LLM decoding: a
duty cycle that is high as soon as one sequence runs (dcgm-exporter#301)
and grows a little with batch occupancy, plus noise.

Policies compared (:func:`policies`): ours (:func:`autoscale.policy.decide`),
Ray Serve's default ``target_ongoing_requests`` rule with its default delays,
and a queue-only HPA-style rule. Everything is seeded: the same arguments give
the same numbers.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from autoscale.policy import PolicyConfig, PolicyContext, PolicyState, decide


@dataclass
class SimConfig:
    duration_s: float = 4 * 3600
    dt_s: float = 0.5
    seed: int = 7
    base_rps: float = 1.0
    peak_rps: float = 14.0
    diurnal_period_s: float = 4 * 3600
    burst_every_s: float = 1500.0
    burst_len_s: float = 120.0
    burst_factor: float = 1.8
    slots: int = 16
    mean_gen_s: float = 4.0
    prefill_s: float = 0.15
    startup_s: float = 60.0
    control_interval_s: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 16
    initial_replicas: int = 1
    ttft_slo_s: float = 0.8
    flap_window_s: float = 300.0


@dataclass
class _Replica:
    ready_at: float
    running: list = field(default_factory=list)  # finish times
    draining: bool = False


@dataclass
class Signals:
    now_s: float
    ready: int
    target: int
    queue_len: int
    running: int
    gpu_util_pct: tuple[float, ...]
    occupancy: tuple[float, ...]


@dataclass
class SimResult:
    policy: str
    requests: int
    slo_attainment: float
    ttft_p50_s: float
    ttft_p95_s: float
    replica_seconds: float
    scale_events: int
    direction_flips: int
    # a reversal within flap_window_s of the previous scale event: reacting to noise
    flaps: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def arrival_rate(cfg: SimConfig, t: float) -> float:
    phase = 2 * math.pi * t / cfg.diurnal_period_s
    rate = cfg.base_rps + (cfg.peak_rps - cfg.base_rps) * (0.5 - 0.5 * math.cos(phase))
    if cfg.burst_every_s > 0 and (t % cfg.burst_every_s) < cfg.burst_len_s and t > cfg.burst_len_s:
        rate *= cfg.burst_factor
    return rate


def simulate(cfg: SimConfig, name: str, policy: Callable[[Signals], int]) -> SimResult:
    rng = random.Random(cfg.seed)
    noise = random.Random(cfg.seed + 1)
    replicas = [_Replica(ready_at=0.0) for _ in range(cfg.initial_replicas)]
    queue: deque[float] = deque()
    ttfts: list[float] = []
    replica_seconds = 0.0
    events = flips = flaps = 0
    last_dir = 0
    last_event_t = -1e9
    next_control = 0.0
    t = 0.0
    while t < cfg.duration_s:
        for r in replicas:
            if r.running:
                r.running = [f for f in r.running if f > t]
        replicas = [r for r in replicas if not (r.draining and not r.running)]
        lam = arrival_rate(cfg, t) * cfg.dt_s
        # Poisson arrivals by inversion (rates here are small per tick)
        n, p, L = 0, rng.random(), math.exp(-lam)
        while p > L:
            n += 1
            p *= rng.random()
        for _ in range(n):
            queue.append(t + rng.random() * cfg.dt_s)
        ready = [r for r in replicas if r.ready_at <= t and not r.draining]
        while queue and ready:
            r = min(ready, key=lambda x: len(x.running))
            if len(r.running) >= cfg.slots:
                break
            arrived = queue.popleft()
            start = max(t, arrived)
            ttfts.append(start - arrived + cfg.prefill_s)
            r.running.append(start + cfg.prefill_s + rng.expovariate(1.0 / cfg.mean_gen_s))
        replica_seconds += len(replicas) * cfg.dt_s
        if t >= next_control:
            next_control = t + cfg.control_interval_s
            active = [r for r in replicas if not r.draining]
            utils = tuple(
                0.0 if not r.running else min(100.0, 80.0 + 20.0 * len(r.running) / cfg.slots + noise.gauss(0, 3))
                for r in ready
            )
            occ = tuple(len(r.running) / cfg.slots for r in ready)
            sig = Signals(t, len(ready), len(active), len(queue), sum(len(r.running) for r in ready), utils, occ)
            desired = max(cfg.min_replicas, min(cfg.max_replicas, int(policy(sig))))
            if desired != len(active):
                events += 1
                d = 1 if desired > len(active) else -1
                if last_dir and d != last_dir:
                    flips += 1
                    if t - last_event_t < cfg.flap_window_s:
                        flaps += 1
                last_dir = d
                last_event_t = t
            if desired > len(active):
                replicas += [_Replica(ready_at=t + cfg.startup_s) for _ in range(desired - len(active))]
            elif desired < len(active):
                # cancel replicas still starting first, then drain the least loaded
                victims = sorted(active, key=lambda r: (r.ready_at <= t, len(r.running)))
                for r in victims[: len(active) - desired]:
                    r.draining = True
        t += cfg.dt_s
    ttfts.sort()
    q = lambda p: ttfts[min(len(ttfts) - 1, int(p * (len(ttfts) - 1)))] if ttfts else float("nan")  # noqa: E731
    return SimResult(
        policy=name,
        requests=len(ttfts),
        slo_attainment=sum(1 for x in ttfts if x <= cfg.ttft_slo_s) / max(1, len(ttfts)),
        ttft_p50_s=q(0.5),
        ttft_p95_s=q(0.95),
        replica_seconds=replica_seconds,
        scale_events=events,
        direction_flips=flips,
        flaps=flaps,
    )


def ours(cfg: SimConfig, pcfg: PolicyConfig | None = None) -> Callable[[Signals], int]:
    pcfg = pcfg or PolicyConfig()
    state = PolicyState()

    def policy(s: Signals) -> int:
        nonlocal state
        per = s.queue_len / max(1, s.ready)
        ctx = PolicyContext(
            now_s=s.now_s,
            current_replicas=s.target,
            min_replicas=cfg.min_replicas,
            max_replicas=cfg.max_replicas,
            queue_depth=tuple(per for _ in range(max(1, s.ready))),
            gpu_util_pct=s.gpu_util_pct or None,
            occupancy=s.occupancy or None,
        )
        d = decide(pcfg, ctx, state)
        state = d.state
        return d.desired_replicas

    return policy


def ray_default(cfg: SimConfig, target_ongoing: float = 2.0, upscale_delay_s: float = 30.0,
                downscale_delay_s: float = 600.0) -> Callable[[Signals], int]:
    """Ray Serve's default rule: ceil(ongoing / target_ongoing_requests), applied once a
    decision in the same direction has held for the up/down delay."""
    streak = {"dir": 0, "since": 0.0}

    def policy(s: Signals) -> int:
        ongoing = s.running + s.queue_len
        desired = max(cfg.min_replicas, math.ceil(ongoing / target_ongoing))
        d = (desired > s.target) - (desired < s.target)
        if d != streak["dir"]:
            streak.update(dir=d, since=s.now_s)
        held = s.now_s - streak["since"]
        if d > 0 and held >= upscale_delay_s:
            return desired
        if d < 0 and held >= downscale_delay_s:
            return desired
        return s.target

    return policy


def hpa_queue_only(cfg: SimConfig, target_queue: float = 15.0, tolerance: float = 0.1,
                   down_window_s: float = 300.0, period_s: float = 15.0) -> Callable[[Signals], int]:
    """Kubernetes-HPA-style on queue depth alone: ratio rule with a tolerance, immediate
    scale-up, and the highest recommendation of the last ``down_window_s`` for scale-down."""
    recs: deque[tuple[float, int]] = deque()
    last = {"t": -1e9, "out": cfg.initial_replicas}

    def policy(s: Signals) -> int:
        if s.now_s - last["t"] < period_s:
            return s.target
        last["t"] = s.now_s
        per = s.queue_len / max(1, s.ready)
        ratio = per / target_queue
        cur = max(1, s.target)
        if abs(ratio - 1.0) <= tolerance or (per == 0 and cur == cfg.min_replicas):
            rec = cur
        else:
            rec = max(cfg.min_replicas, math.ceil(cur * ratio)) if per > 0 else cfg.min_replicas
        recs.append((s.now_s, rec))
        while recs and recs[0][0] < s.now_s - down_window_s:
            recs.popleft()
        out = rec if rec >= cur else max(r for _, r in recs)
        return min(out, cfg.max_replicas)

    return policy


# Thresholds for an 800 ms TTFT SLO: with continuous batching any sustained
# queue means the batch is full, so react to the first queued request.
SLO_TUNED = PolicyConfig(queue_high=1, queue_low=0.2, upscale_delay_s=2, cooldown_s=10,
                         downscale_max_occupancy=0.4)


def policies(cfg: SimConfig) -> dict[str, Callable[[Signals], int]]:
    return {
        "seekserve defaults (queue 15, GPU 75%)": ours(cfg),
        "seekserve SLO-tuned (queue 1)": ours(cfg, SLO_TUNED),
        "ray default (target_ongoing=2)": ray_default(cfg),
        "ray default, target_ongoing=12": ray_default(cfg, target_ongoing=12),
        "hpa-like (queue only, target 15)": hpa_queue_only(cfg),
    }
