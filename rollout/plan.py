"""Rollout plans (pydantic), after Argo Rollouts' canary strategy.

Steps run in order: ``set_weight`` (canary's share of traffic, percent),
``pause`` (a duration, or until promoted) and ``analysis`` (gates evaluated
every ``interval_s`` until all pass, or until ``failure_limit`` failed
evaluations roll the canary back). ``background_analysis`` runs the same way
behind every step once the canary has traffic. Inconclusive gates (too few
samples) never count as failures: silence is not a reason to roll back
(argo-rollouts#1905, flagger#1035).
"""

from __future__ import annotations

import re
from typing import Literal, Union

from pydantic import Field, field_validator, model_validator

from serve_app._model import StrictModel

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")

Metric = Literal["confidence", "p95_latency_ms", "drift_cdi", "error_rate"]
# direction of each metric: the value must be >= (min) or <= (max) the threshold
DIRECTION: dict[str, str] = {"confidence": "min", "p95_latency_ms": "max", "drift_cdi": "max", "error_rate": "max"}


class Gate(StrictModel):
    metric: Metric = Field(description="confidence, p95_latency_ms, drift_cdi or error_rate, of the canary.")
    threshold: float = Field(description="Bound: confidence >= it; the others <= it.")
    window_s: float = Field(gt=0, description="Sliding window the value is computed over.")
    min_samples: int = Field(20, ge=1, description="Fewer canary samples in the window: Inconclusive.")


def default_gates() -> list[Gate]:
    return [
        Gate(metric="confidence", threshold=0.75, window_s=300),
        Gate(metric="p95_latency_ms", threshold=800, window_s=120),
        Gate(metric="drift_cdi", threshold=0.15, window_s=600),
        Gate(metric="error_rate", threshold=0.10, window_s=120),
    ]


class AnalysisSpec(StrictModel):
    gates: list[Gate] = Field(default_factory=default_gates, min_length=1, description="Gates to evaluate.")
    interval_s: float = Field(30.0, gt=0, description="Time between evaluations.")
    failure_limit: int = Field(
        1, ge=1, description="Failed evaluations (any gate failing) before the canary is rolled back."
    )
    successes_required: int = Field(
        1, ge=1, description="Consecutive all-pass evaluations that complete an analysis step."
    )


class SetWeightStep(StrictModel):
    set_weight: int = Field(ge=0, le=100, description="Canary traffic, percent.")


class PauseSpec(StrictModel):
    duration_s: float | None = Field(None, gt=0, description="Wait this long; unset: until promoted.")


class PauseStep(StrictModel):
    pause: PauseSpec = Field(description="Hold the current weights.")


class AnalysisStep(StrictModel):
    analysis: AnalysisSpec = Field(description="Evaluate gates until they pass or fail.")


Step = Union[SetWeightStep, PauseStep, AnalysisStep]


class RolloutPlan(StrictModel):
    name: str = Field(description="Rollout name (lowercase letters, digits, '.', '_', '-').")
    model: str = Field(description="Served model whose traffic is split.")
    stable: str = Field(description="Variant that keeps the rest of the traffic.")
    canary: str = Field(description="Variant being rolled out.")
    steps: list[Step] = Field(min_length=1, description="Steps, run in order.")
    background_analysis: AnalysisSpec | None = Field(
        None, description="Gates evaluated behind every step once the canary has traffic."
    )
    scale_down_delay_s: float = Field(
        30.0, ge=0, description="After a rollback, how long the canary keeps its replicas (for in-flight requests)."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("must be 1-63 of lowercase letters, digits, '.', '_' or '-'")
        return v

    @model_validator(mode="after")
    def _check(self) -> "RolloutPlan":
        if self.stable == self.canary:
            raise ValueError(f"stable and canary are both {self.stable!r}")
        if not any(isinstance(s, SetWeightStep) for s in self.steps):
            raise ValueError("a plan needs at least one set_weight step")
        return self

    def all_gates(self) -> list[Gate]:
        gates = [g for s in self.steps if isinstance(s, AnalysisStep) for g in s.analysis.gates]
        if self.background_analysis:
            gates += self.background_analysis.gates
        return gates
