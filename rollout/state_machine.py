"""The rollout state machine, pure: ``tick`` and ``command`` take the plan, the
state, ``now`` and (for tick) a gate evaluator, and return the new state and
the events to audit. Nothing here reads a clock, a database or Ray.

Phases: Progressing -> (Paused) -> Healthy when every step is done (canary at
100%); Degraded when analysis fails (canary at 0% at once); Aborted by command.
``retry`` restarts a Degraded or Aborted rollout from its first step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from rollout.analysis import GateResult
from rollout.plan import AnalysisSpec, AnalysisStep, Gate, PauseStep, RolloutPlan, SetWeightStep

TERMINAL = ("Healthy", "Degraded", "Aborted")

Evaluator = Callable[[list[Gate]], list[GateResult]]


class RolloutCommandError(ValueError):
    """A command that does not apply to the rollout's current phase."""


@dataclass(frozen=True)
class RolloutState:
    name: str
    phase: str = "Progressing"
    step_index: int = 0
    canary_weight: int = 0
    step_started_s: float = 0.0
    last_analysis_s: float | None = None
    analysis_failures: int = 0
    analysis_successes: int = 0
    background_last_s: float | None = None
    background_failures: int = 0
    message: str = ""
    gates: tuple = field(default=())
    scale_down_at_s: float | None = None
    version: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gates"] = [dict(g) for g in self.gates]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RolloutState":
        d = dict(d)
        d["gates"] = tuple(dict(g) for g in d.get("gates", ()))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Event:
    decision: str
    reason: str
    gates: tuple = ()


def weights(plan: RolloutPlan, state: RolloutState, variants: list[str]) -> dict[str, int]:
    w = {v: 0 for v in variants}
    w[plan.canary] = state.canary_weight
    w[plan.stable] = 100 - state.canary_weight
    return w


def start(plan: RolloutPlan, now: float) -> RolloutState:
    return RolloutState(name=plan.name, step_started_s=now, message="started")


def _rollback(plan, state, now, reason, gates) -> tuple[RolloutState, list[Event]]:
    s = replace(state, phase="Degraded", canary_weight=0, message=reason, gates=gates,
                scale_down_at_s=now + plan.scale_down_delay_s, version=state.version + 1)
    return s, [Event("rollback", reason, gates)]


def _run_analysis(spec: AnalysisSpec, evaluate: Evaluator) -> tuple[str, tuple, str]:
    results = evaluate(spec.gates)
    gates = tuple(r.as_dict() for r in results)
    failed = [r for r in results if r.status == "fail"]
    if failed:
        return "fail", gates, "; ".join(r.reason for r in failed)
    unsure = [r for r in results if r.status == "inconclusive"]
    if unsure:
        return "inconclusive", gates, "; ".join(f"{r.metric}: {r.reason}" for r in unsure)
    return "pass", gates, "all gates pass: " + "; ".join(r.reason for r in results)


def tick(plan: RolloutPlan, state: RolloutState, now: float, evaluate: Evaluator) -> tuple[RolloutState, list[Event]]:
    events: list[Event] = []
    if state.phase in TERMINAL:
        if state.scale_down_at_s is not None and now >= state.scale_down_at_s:
            events.append(Event("scale_down_canary", f"{plan.canary} kept no traffic for {plan.scale_down_delay_s:g}s"))
            state = replace(state, scale_down_at_s=None, version=state.version + 1)
        return state, events

    bg = plan.background_analysis
    if bg and state.canary_weight > 0 and (state.background_last_s is None or now - state.background_last_s >= bg.interval_s):
        verdict, gates, reason = _run_analysis(bg, evaluate)
        state = replace(state, background_last_s=now, gates=gates)
        if verdict == "fail":
            state = replace(state, background_failures=state.background_failures + 1)
            if state.background_failures >= bg.failure_limit:
                return _rollback(plan, state, now, f"background analysis failed: {reason}", gates)
            events.append(Event("analysis_failed", f"background ({state.background_failures}/{bg.failure_limit}): {reason}", gates))

    for _ in range(len(plan.steps) + 1):
        if state.step_index >= len(plan.steps):
            state = replace(state, phase="Healthy", canary_weight=100, message="promoted: all steps complete",
                            version=state.version + 1)
            events.append(Event("promoted", "all steps complete; canary at 100%"))
            return state, events
        step = plan.steps[state.step_index]
        if isinstance(step, SetWeightStep):
            state = replace(state, canary_weight=step.set_weight, step_index=state.step_index + 1,
                            step_started_s=now, phase="Progressing", message=f"canary at {step.set_weight}%",
                            version=state.version + 1)
            events.append(Event("set_weight", f"step {state.step_index}: canary {step.set_weight}%"))
            continue
        if isinstance(step, PauseStep):
            d = step.pause.duration_s
            if d is not None and now - state.step_started_s >= d:
                state = replace(state, step_index=state.step_index + 1, step_started_s=now, phase="Progressing")
                events.append(Event("pause_done", f"step {state.step_index}: paused {d:g}s"))
                continue
            msg = f"paused {'until promoted' if d is None else f'for {d:g}s'}"
            if state.phase != "Paused" or state.message != msg:
                state = replace(state, phase="Paused", message=msg, version=state.version + 1)
            return state, events
        # the remaining kind of step: analysis
        spec = step.analysis
        # the first evaluation waits one interval too, so the window holds traffic at the new weight
        since = state.last_analysis_s if state.last_analysis_s is not None else state.step_started_s
        if now - since < spec.interval_s:
            if state.phase == "Paused" and state.last_analysis_s is None:
                state = replace(state, phase="Progressing", message=f"analysis in {spec.interval_s:g}s")
            return state, events
        verdict, gates, reason = _run_analysis(spec, evaluate)
        state = replace(state, last_analysis_s=now, gates=gates)
        if verdict == "fail":
            state = replace(state, analysis_failures=state.analysis_failures + 1, analysis_successes=0)
            if state.analysis_failures >= spec.failure_limit:
                return _rollback(plan, state, now, f"analysis failed: {reason}", gates)
            events.append(Event("analysis_failed", f"{state.analysis_failures}/{spec.failure_limit}: {reason}", gates))
            return state, events
        if verdict == "inconclusive":
            # silence is never a reason to roll back: hold and look again next interval
            state = replace(state, phase="Paused", message=f"analysis inconclusive: {reason}",
                            analysis_successes=0, version=state.version + 1)
            events.append(Event("inconclusive", reason, gates))
            return state, events
        successes = state.analysis_successes + 1
        if successes < spec.successes_required:
            state = replace(state, analysis_successes=successes, phase="Progressing", message=reason)
            events.append(Event("analysis_passed", f"{successes}/{spec.successes_required}: {reason}", gates))
            return state, events
        state = replace(state, step_index=state.step_index + 1, step_started_s=now, last_analysis_s=None,
                        analysis_failures=0, analysis_successes=0, phase="Progressing", message=reason,
                        version=state.version + 1)
        events.append(Event("analysis_passed", reason, gates))
    return state, events


def command(plan: RolloutPlan, state: RolloutState, cmd: str, now: float,
            canary_weight: int | None = None) -> tuple[RolloutState, list[Event]]:
    v = state.version + 1
    if cmd == "retry":
        if state.phase not in ("Degraded", "Aborted"):
            raise RolloutCommandError(f"retry applies to Degraded or Aborted rollouts; {plan.name} is {state.phase}")
        return replace(start(plan, now), version=v), [Event("retry", "restarted from the first step")]
    if state.phase in TERMINAL:
        raise RolloutCommandError(f"{plan.name} is {state.phase}; only retry applies")
    if cmd == "promote":
        step = plan.steps[state.step_index] if state.step_index < len(plan.steps) else None
        if not isinstance(step, (PauseStep, AnalysisStep)):
            raise RolloutCommandError(f"step {state.step_index + 1} is not a pause or analysis")
        return replace(state, step_index=state.step_index + 1, step_started_s=now, phase="Progressing",
                       last_analysis_s=None, analysis_failures=0, analysis_successes=0,
                       message="promoted past the current step", version=v), [
            Event("promote", f"skipped step {state.step_index + 1}")]
    if cmd == "promote_full":
        return replace(state, step_index=len(plan.steps), canary_weight=100, phase="Healthy",
                       message="promoted to 100% by command", version=v), [Event("promote_full", "canary at 100%")]
    if cmd == "abort":
        return replace(state, canary_weight=0, phase="Aborted", message="aborted by command",
                       scale_down_at_s=now + plan.scale_down_delay_s, version=v), [Event("abort", "canary at 0%")]
    if cmd == "set_weight":
        if canary_weight is None or not 0 <= canary_weight <= 100:
            raise RolloutCommandError("set_weight needs a canary weight between 0 and 100")
        return replace(state, canary_weight=canary_weight, message=f"canary set to {canary_weight}% by command",
                       version=v), [Event("set_weight", f"canary {canary_weight}% by command")]
    raise RolloutCommandError(f"unknown command {cmd!r}; valid: promote, promote_full, abort, retry, set_weight")
