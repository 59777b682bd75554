"""Gate evaluation over per-variant sample windows, and the drift index (CDI).

A gate's result is Pass, Fail or Inconclusive. Inconclusive covers too few
samples and any error computing the value: a metric problem is a result, never
an exception.

CDI (category drift index) is the population stability index between the
canary's and the stable variant's distributions of output categories:

    PSI = sum over categories c of (p_canary(c) - p_stable(c)) * ln(p_canary(c) / p_stable(c))

with each share floored at ``EPS`` so a category seen on one side only gives a
large finite value. A category is ``finish_reason`` x output-length bucket, or
a label from a configured classifier. Rules of thumb from credit scoring:
< 0.1 no shift, 0.1-0.25 moderate, > 0.25 major; the default gate is 0.15.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Literal, Protocol

from rollout.plan import DIRECTION, Gate

EPS = 1e-4
LENGTH_BUCKETS = (16, 64, 256)


@dataclass(frozen=True)
class Sample:
    t: float
    latency_ms: float
    error: bool
    confidence: float | None
    category: str | None


@dataclass(frozen=True)
class GateResult:
    metric: str
    status: Literal["pass", "fail", "inconclusive"]
    value: float | None
    threshold: float
    samples: int
    reason: str

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class MetricSource(Protocol):
    """Where gates read samples from (in-process windows, or a test's list)."""

    def samples(self, model: str, variant: str, since: float) -> list[Sample]:
        ...


def category(finish_reason: str | None, completion_tokens: int) -> str:
    bucket = next((f"<{b}" for b in LENGTH_BUCKETS if completion_tokens < b), f">={LENGTH_BUCKETS[-1]}")
    return f"{finish_reason or 'none'}/{bucket}"


def psi(canary: Iterable[str], stable: Iterable[str]) -> float:
    c, s = Counter(canary), Counter(stable)
    nc, ns = sum(c.values()), sum(s.values())
    if nc == 0 or ns == 0:
        raise ValueError("both distributions need samples")
    total = 0.0
    for cat in set(c) | set(s):
        pc = max(c[cat] / nc, EPS)
        ps = max(s[cat] / ns, EPS)
        total += (pc - ps) * math.log(pc / ps)
    return total


def p95(values: list[float]) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)]


def evaluate_gate(gate: Gate, canary: list[Sample], stable: list[Sample], now: float) -> GateResult:
    since = now - gate.window_s
    cw = [x for x in canary if x.t >= since]
    try:
        if len(cw) < gate.min_samples:
            return GateResult(gate.metric, "inconclusive", None, gate.threshold, len(cw),
                              f"{len(cw)} canary samples in {gate.window_s:g}s, need {gate.min_samples}")
        if gate.metric == "error_rate":
            value = sum(x.error for x in cw) / len(cw)
        elif gate.metric == "p95_latency_ms":
            ok = [x.latency_ms for x in cw if not x.error]
            if not ok:
                return GateResult(gate.metric, "inconclusive", None, gate.threshold, 0, "no successful requests")
            value = p95(ok)
        elif gate.metric == "confidence":
            conf = [x.confidence for x in cw if x.confidence is not None and not x.error]
            if len(conf) < gate.min_samples:
                return GateResult(gate.metric, "inconclusive", None, gate.threshold, len(conf),
                                  f"{len(conf)} samples carry confidence, need {gate.min_samples}")
            value = sum(conf) / len(conf)
        elif gate.metric == "drift_cdi":
            sw = [x for x in stable if x.t >= since and x.category is not None and not x.error]
            cc = [x.category for x in cw if x.category is not None and not x.error]
            if len(sw) < gate.min_samples or len(cc) < gate.min_samples:
                return GateResult(gate.metric, "inconclusive", None, gate.threshold, min(len(sw), len(cc)),
                                  f"{len(cc)} canary / {len(sw)} stable categorised samples, need {gate.min_samples}")
            value = psi(cc, [x.category for x in sw])
        else:
            return GateResult(gate.metric, "inconclusive", None, gate.threshold, len(cw), "unknown metric")
    except Exception as e:  # a metric error is a result, not a crash
        return GateResult(gate.metric, "inconclusive", None, gate.threshold, len(cw), f"metric error: {e}")
    ok = value >= gate.threshold if DIRECTION[gate.metric] == "min" else value <= gate.threshold
    op = ">=" if DIRECTION[gate.metric] == "min" else "<="
    return GateResult(gate.metric, "pass" if ok else "fail", value, gate.threshold, len(cw),
                      f"{gate.metric} {value:.4g} {'meets' if ok else 'violates'} {op} {gate.threshold:g}")


def evaluate(gates: list[Gate], source: MetricSource, model: str, stable: str, canary: str,
             now: float) -> list[GateResult]:
    longest = max(g.window_s for g in gates)
    try:
        c = source.samples(model, canary, now - longest)
        s = source.samples(model, stable, now - longest)
    except Exception as e:
        return [GateResult(g.metric, "inconclusive", None, g.threshold, 0, f"metric source error: {e}") for g in gates]
    return [evaluate_gate(g, c, s, now) for g in gates]
