"""Pure rollout logic: router split and stickiness, plans, gates, CDI, the state
machine, and persistence in a real SQLite file."""

import math
import random
import sqlite3

import pytest
from pydantic import ValidationError

from rollout.analysis import GateResult, Sample, category, evaluate_gate, psi
from rollout.plan import Gate, RolloutPlan
from rollout.router import BUCKETS, Router, TrafficSplit, bucket_of
from rollout.state_machine import RolloutCommandError, RolloutState, command, start, tick, weights
from rollout.store import RolloutStore


# ---- router ---------------------------------------------------------------
def test_split_accuracy_within_one_percent_over_100k_keys():
    split = TrafficSplit("m", (("stable", 70), ("canary", 20), ("shadow", 10)))
    counts = {"stable": 0, "canary": 0, "shadow": 0}
    for i in range(100_000):
        counts[split.pick(f"user-{i}")] += 1
    for v, w in split.weights:
        assert abs(counts[v] / 100_000 - w / 100) < 0.01, counts


def test_sticky_per_user_and_stable_across_processes():
    split = TrafficSplit("m", (("stable", 50), ("canary", 50)))
    assert {split.pick("alice") for _ in range(50)} == {split.pick("alice")}
    # BLAKE2b, not Python's salted hash(): the same bucket in every process and after restarts
    import subprocess
    import sys

    code = "from rollout.router import bucket_of; print(bucket_of('alice'))"
    other = {int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env={"PYTHONHASHSEED": str(seed), "PYTHONPATH": "."}).stdout) for seed in (1, 2)}
    assert other == {bucket_of("alice")} and 0 <= bucket_of("x") < BUCKETS


def test_raising_canary_weight_moves_only_users_whose_bucket_changes_hands():
    users = [f"u{i}" for i in range(20_000)]
    r = Router({"m": TrafficSplit("m", (("stable", 90), ("canary", 10)))})
    before = {u: r.split("m").pick(u) for u in users}
    r.set_weights("m", {"stable": 50, "canary": 50})
    after = {u: r.split("m").pick(u) for u in users}
    assert all(after[u] == "canary" for u in users if before[u] == "canary")  # nobody is bounced back
    moved = sum(before[u] != after[u] for u in users) / len(users)
    assert abs(moved - 0.40) < 0.02


def test_bad_splits_are_rejected_and_the_old_one_kept():
    r = Router({"m": TrafficSplit("m", (("stable", 100), ("canary", 0)))})
    with pytest.raises(ValueError, match="sum to 100"):
        r.set_weights("m", {"stable": 60, "canary": 60})
    with pytest.raises(ValueError, match="unknown variants"):
        r.set_weights("m", {"nope": 100})
    assert r.split("m").as_dict() == {"stable": 100, "canary": 0}


# ---- plans ----------------------------------------------------------------
PLAN = {
    "name": "smol-canary", "model": "m", "stable": "stable", "canary": "canary",
    "steps": [
        {"set_weight": 10},
        {"pause": {"duration_s": 60}},
        {"analysis": {"gates": [{"metric": "error_rate", "threshold": 0.1, "window_s": 60, "min_samples": 5}],
                      "interval_s": 10, "failure_limit": 2}},
        {"set_weight": 50},
        {"analysis": {"gates": [{"metric": "error_rate", "threshold": 0.1, "window_s": 60, "min_samples": 5}],
                      "interval_s": 10}},
        {"set_weight": 100},
    ],
}


def test_plan_validation_errors():
    RolloutPlan.model_validate(PLAN)
    with pytest.raises(ValidationError, match="both 'stable'"):
        RolloutPlan.model_validate({**PLAN, "canary": "stable"})
    with pytest.raises(ValidationError):
        RolloutPlan.model_validate({**PLAN, "steps": [{"set_weight": 120}]})
    with pytest.raises(ValidationError, match="at least one set_weight"):
        RolloutPlan.model_validate({**PLAN, "steps": [{"pause": {}}]})
    with pytest.raises(ValidationError):
        RolloutPlan.model_validate({**PLAN, "steps": [{"set_weigth": 10}]})
    with pytest.raises(ValidationError):
        RolloutPlan.model_validate({**PLAN, "name": "Bad Name"})


def test_default_gates_match_the_documented_defaults():
    from rollout.plan import default_gates

    got = {(g.metric, g.threshold, g.window_s) for g in default_gates()}
    assert got == {("confidence", 0.75, 300), ("p95_latency_ms", 800, 120), ("drift_cdi", 0.15, 600),
                   ("error_rate", 0.10, 120)}


# ---- gates and CDI ---------------------------------------------------------
def samples(n, t0=1000.0, latency=100.0, error=False, conf=0.9, cat="stop/<16"):
    return [Sample(t0 + i * 0.1, latency, error, conf, cat) for i in range(n)]


NOW = 1010.0


@pytest.mark.parametrize(
    "gate,canary,status",
    [
        (Gate(metric="error_rate", threshold=0.1, window_s=60, min_samples=10), samples(20), "pass"),
        (Gate(metric="error_rate", threshold=0.1, window_s=60, min_samples=10),
         samples(15) + samples(5, error=True), "fail"),
        (Gate(metric="confidence", threshold=0.75, window_s=60, min_samples=10), samples(20, conf=0.8), "pass"),
        (Gate(metric="confidence", threshold=0.75, window_s=60, min_samples=10), samples(20, conf=0.4), "fail"),
        (Gate(metric="p95_latency_ms", threshold=800, window_s=60, min_samples=10), samples(20, latency=300), "pass"),
        (Gate(metric="p95_latency_ms", threshold=800, window_s=60, min_samples=10),
         samples(18, latency=300) + samples(2, latency=2000), "fail"),
        (Gate(metric="error_rate", threshold=0.1, window_s=60, min_samples=30), samples(20, error=True), "inconclusive"),
        # samples older than the window do not count
        (Gate(metric="error_rate", threshold=0.1, window_s=5, min_samples=10), samples(20, t0=900), "inconclusive"),
    ],
)
def test_gates(gate, canary, status):
    r = evaluate_gate(gate, canary, samples(50), NOW)
    assert r.status == status, r


def test_psi_math():
    assert psi(["a", "b"] * 50, ["a", "b"] * 50) == pytest.approx(0.0)
    # 60/40 vs 40/60: 2 * 0.2 * ln(1.5)
    assert psi(["a"] * 60 + ["b"] * 40, ["a"] * 40 + ["b"] * 60) == pytest.approx(0.4 * math.log(1.5))
    # a category on one side only gives a large, finite value
    assert 1.0 < psi(["a"] * 100, ["b"] * 100) < 50
    with pytest.raises(ValueError):
        psi([], ["a"])


def test_drift_gate_and_categories():
    assert category("stop", 3) == "stop/<16" and category("length", 300) == "length/>=256"
    g = Gate(metric="drift_cdi", threshold=0.15, window_s=60, min_samples=10)
    same = evaluate_gate(g, samples(30), samples(30), NOW)
    drifted = evaluate_gate(g, samples(30, cat="length/<64"), samples(30), NOW)
    assert same.status == "pass" and drifted.status == "fail"
    assert evaluate_gate(g, samples(30), [], NOW).status == "inconclusive"


def test_metric_error_is_inconclusive_not_a_crash():
    broken = [Sample(1005.0, float("nan"), False, "not-a-number", None)] * 20
    r = evaluate_gate(Gate(metric="confidence", threshold=0.75, window_s=60, min_samples=5), broken, [], NOW)
    assert r.status == "inconclusive" and "error" in r.reason


# ---- state machine ---------------------------------------------------------
def verdicts(*statuses):
    seq = list(statuses)

    def evaluate(gates):
        s = seq.pop(0) if seq else statuses[-1]
        return [GateResult(g.metric, s, 0.0, g.threshold, 10, f"{g.metric} {s}") for g in gates]
    return evaluate


def run(plan, evaluate, times, state=None):
    state = state or start(plan, 0.0)
    trail = []
    for t in times:
        state, events = tick(plan, state, t, evaluate)
        trail.append((state.phase, state.canary_weight, [e.decision for e in events]))
    return state, trail


def test_healthy_walk_to_promotion():
    plan = RolloutPlan.model_validate(PLAN)
    state, trail = run(plan, verdicts("pass"), [0, 30, 60, 70, 80, 90])
    assert trail[0][:2] == ("Paused", 10)
    assert state.phase == "Healthy" and state.canary_weight == 100
    # pause ends at 60; each analysis waits one 10 s interval at its weight
    assert [w for _, w, _ in trail] == [10, 10, 10, 50, 100, 100]


def test_failing_analysis_rolls_back_after_the_failure_limit():
    plan = RolloutPlan.model_validate(PLAN)
    state, trail = run(plan, verdicts("fail"), [0, 60, 70, 80])
    assert trail[1][2] == ["pause_done"]
    assert trail[2][2] == ["analysis_failed"]
    assert state.phase == "Degraded" and state.canary_weight == 0
    assert "error_rate" in state.message
    assert weights(plan, state, ["stable", "canary"]) == {"stable": 100, "canary": 0}


def test_silence_pauses_and_never_rolls_back():
    plan = RolloutPlan.model_validate(PLAN)
    state, trail = run(plan, verdicts("inconclusive"), [0, 60] + list(range(70, 2000, 10)))
    assert {p for p, _, _ in trail[2:]} == {"Paused"}
    assert state.phase == "Paused" and state.canary_weight == 10
    assert "inconclusive" in state.message
    # evidence arrives later: the rollout continues
    state, _ = run(plan, verdicts("pass"), [2000, 2010, 2020, 2030], state)
    assert state.phase == "Healthy"


def test_background_analysis_rolls_back_during_a_pause():
    plan = RolloutPlan.model_validate({**PLAN, "steps": [{"set_weight": 20}, {"pause": {}}],
                                       "background_analysis": {"interval_s": 5, "failure_limit": 2}})
    state, trail = run(plan, verdicts("pass", "fail", "fail"), [0, 5, 10, 15])
    assert [p for p, _, _ in trail] == ["Paused", "Paused", "Paused", "Degraded"]
    assert state.message.startswith("background analysis failed")


def test_commands():
    plan = RolloutPlan.model_validate(PLAN)
    state, _ = run(plan, verdicts("pass"), [0])
    promoted, ev = command(plan, state, "promote", 1.0)
    assert promoted.step_index == state.step_index + 1 and ev[0].decision == "promote"
    aborted, _ = command(plan, state, "abort", 1.0)
    assert (aborted.phase, aborted.canary_weight) == ("Aborted", 0)
    with pytest.raises(RolloutCommandError, match="only retry"):
        command(plan, aborted, "promote", 2.0)
    again, _ = command(plan, aborted, "retry", 3.0)
    assert (again.phase, again.step_index, again.canary_weight) == ("Progressing", 0, 0)
    full, _ = command(plan, state, "promote_full", 1.0)
    assert (full.phase, full.canary_weight) == ("Healthy", 100)
    manual, _ = command(plan, state, "set_weight", 1.0, canary_weight=33)
    assert manual.canary_weight == 33
    with pytest.raises(RolloutCommandError, match="valid: promote"):
        command(plan, state, "yolo", 1.0)


# ---- persistence -----------------------------------------------------------
def test_store_round_trip_and_append_only_audit(tmp_path):
    path = tmp_path / "rollouts.db"
    plan = RolloutPlan.model_validate(PLAN)
    store = RolloutStore(path)
    state, events = tick(plan, start(plan, 0.0), 0.0, verdicts("pass"))
    store.save(plan, state, events, who="tester", at=5.0)
    store.close()
    reopened = RolloutStore(path)
    got_plan, got_state = reopened.load("smol-canary")
    assert got_plan == plan and got_state == state
    hist = reopened.history("smol-canary")
    assert [h["decision"] for h in hist] == ["set_weight"] and hist[0]["who"] == "tester"
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("DELETE FROM audit")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("UPDATE audit SET reason = 'x'")


def test_state_dict_round_trip():
    s = RolloutState(name="x", gates=({"metric": "error_rate", "value": 0.1},), canary_weight=7)
    assert RolloutState.from_dict(s.to_dict()) == s


def test_random_keys_without_user_are_spread():
    random.seed(1)
    split = TrafficSplit("m", (("stable", 90), ("canary", 10)))
    picks = [split.pick(None) for _ in range(20_000)]
    assert abs(picks.count("canary") / 20_000 - 0.10) < 0.01
