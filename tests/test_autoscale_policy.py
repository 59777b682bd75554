"""The pure autoscaling policy: every row of the decision table, hysteresis,
stabilisation, cooldown, missing/stale signals and bounds. Time is injected."""

import pytest

from autoscale.policy import (
    ALERT_GPU_IDLE,
    ALERT_GPU_MISSING,
    PolicyConfig,
    PolicyContext,
    PolicyState,
    decide,
)

CFG = PolicyConfig(
    queue_high=15, queue_low=5, gpu_high_pct=75, gpu_low_pct=50,
    upscale_delay_s=30, downscale_delay_s=300, cooldown_s=60, max_step=2,
)


def ctx(now, replicas=2, queue=(0.0, 0.0), gpu=(0.0, 0.0), lo=1, hi=8, **kw):
    return PolicyContext(now_s=now, current_replicas=replicas, min_replicas=lo, max_replicas=hi,
                         queue_depth=queue, gpu_util_pct=gpu, **kw)


def run(steps, state=None, cfg=CFG):
    """Feed (now, context kwargs) in order; return every decision."""
    state = state or PolicyState()
    out = []
    for now, kw in steps:
        d = decide(cfg, ctx(now, **kw), state)
        state = d.state
        out.append(d)
    return out


def test_high_queue_high_gpu_scales_up_after_the_delay():
    ds = run([(t, dict(queue=(20, 20), gpu=(90, 90))) for t in (0, 10, 29, 30)])
    assert [d.desired_replicas for d in ds] == [2, 2, 2, 3]
    assert ds[-1].kind == "scale_up" and "scale up by 1" in ds[-1].reason


def test_queue_at_twice_the_threshold_adds_two():
    ds = run([(0, dict(queue=(31, 29), gpu=(90, 90))), (30, dict(queue=(31, 29), gpu=(90, 90)))])
    assert ds[-1].desired_replicas == 4


def test_max_step_caps_the_jump():
    cfg = CFG.model_copy(update={"max_step": 1})
    ds = run([(0, dict(queue=(40, 40), gpu=(90, 90))), (30, dict(queue=(40, 40), gpu=(90, 90)))], cfg=cfg)
    assert ds[-1].desired_replicas == 3


def test_high_queue_idle_gpu_does_not_scale_and_alerts():
    ds = run([(t, dict(queue=(40, 40), gpu=(20, 20))) for t in (0, 100, 1000)])
    assert all(d.desired_replicas == 2 for d in ds)
    assert all(ALERT_GPU_IDLE in d.alerts for d in ds)
    assert ds[-1].kind == "gpu_idle_alert"


def test_low_queue_busy_gpu_holds():
    ds = run([(t, dict(queue=(1, 1), gpu=(95, 95))) for t in (0, 400, 800)])
    assert all(d.desired_replicas == 2 and d.kind == "hold" for d in ds)


def test_both_low_scale_down_one_after_the_delay():
    ds = run([(t, dict(queue=(0, 1), gpu=(10, 10))) for t in (0, 299, 300)])
    assert [d.desired_replicas for d in ds] == [2, 2, 1]
    assert ds[-1].kind == "scale_down"


def test_hysteresis_band_resets_the_timers():
    # high for 20 s, one tick in the band, high again: the 30 s count restarts
    steps = [(0, dict(queue=(20, 20), gpu=(90, 90))), (20, dict(queue=(10, 10), gpu=(90, 90))),
             (25, dict(queue=(20, 20), gpu=(90, 90))), (50, dict(queue=(20, 20), gpu=(90, 90))),
             (55, dict(queue=(20, 20), gpu=(90, 90)))]
    ds = run(steps)
    assert [d.desired_replicas for d in ds] == [2, 2, 2, 2, 3]
    assert ds[1].kind == "hold" and ds[1].state.high_since_s is None


def test_noise_around_one_threshold_never_flips():
    # a queue that wobbles between the low and high thresholds causes no action at all
    ds = run([(t, dict(queue=(6 + (t % 3) * 3, 6), gpu=(60, 60))) for t in range(0, 1000, 10)])
    assert {d.desired_replicas for d in ds} == {2}


def test_cooldown_blocks_a_second_step():
    ds = run([(0, dict(queue=(20, 20), gpu=(90, 90))), (30, dict(queue=(20, 20), gpu=(90, 90))),
              (31, dict(replicas=3, queue=(20, 20, 20), gpu=(90, 90, 90))),
              (61, dict(replicas=3, queue=(20, 20, 20), gpu=(90, 90, 90))),
              (89, dict(replicas=3, queue=(20, 20, 20), gpu=(90, 90, 90))),
              (91, dict(replicas=3, queue=(20, 20, 20), gpu=(90, 90, 90)))])
    assert [d.desired_replicas for d in ds] == [2, 3, 3, 3, 3, 4]
    assert ds[3].kind in ("cooldown", "stabilizing_up")


def test_missing_gpu_decides_on_queue_alone_and_flags_it():
    ds = run([(0, dict(queue=(20, 20), gpu=None)), (30, dict(queue=(20, 20), gpu=None))])
    assert ds[-1].desired_replicas == 3
    assert all(ALERT_GPU_MISSING in d.alerts for d in ds)
    assert "GPU n/a" in ds[-1].reason


def test_stale_gpu_is_treated_as_missing():
    d = decide(CFG, ctx(0, queue=(20, 20), gpu=(10, 10), gpu_age_s=120), PolicyState())
    assert ALERT_GPU_MISSING in d.alerts
    assert ALERT_GPU_IDLE not in d.alerts  # the stale idle reading is ignored


def test_missing_or_stale_queue_holds():
    d = decide(CFG, ctx(0, queue=None, gpu=(90, 90)), PolicyState())
    assert d.desired_replicas == 2 and d.kind == "missing_queue"
    d = decide(CFG, ctx(0, queue=(50, 50), gpu=(90, 90), queue_age_s=999), PolicyState())
    assert d.desired_replicas == 2 and d.kind == "missing_queue"


def test_bounds_cap_up_and_down_and_clamp_outside():
    ds = run([(0, dict(replicas=8, hi=8, queue=(40,) * 8, gpu=(99,) * 8)),
              (30, dict(replicas=8, hi=8, queue=(40,) * 8, gpu=(99,) * 8))])
    assert ds[-1].desired_replicas == 8 and ds[-1].kind == "at_max"
    ds = run([(0, dict(replicas=7, hi=8, queue=(40,) * 7, gpu=(99,) * 7)),
              (30, dict(replicas=7, hi=8, queue=(40,) * 7, gpu=(99,) * 7))])
    assert ds[-1].desired_replicas == 8 and "bounded" in ds[-1].reason
    ds = run([(t, dict(replicas=1, queue=(0,), gpu=(0,))) for t in (0, 400)])
    assert ds[-1].desired_replicas == 1 and ds[-1].kind == "at_min"
    d = decide(CFG, ctx(0, replicas=12, hi=8, queue=(0,) * 12, gpu=(0,) * 12), PolicyState())
    assert d.desired_replicas == 8 and d.kind == "bounds"


def test_state_round_trips_through_a_dict():
    d = run([(0, dict(queue=(20, 20), gpu=(90, 90)))])[0]
    assert PolicyState.from_dict(d.state.to_dict()) == d.state
    assert PolicyState.from_dict({"unknown": 1}) == PolicyState()


def test_config_rejects_inverted_thresholds():
    with pytest.raises(ValueError, match="queue_low"):
        PolicyConfig(queue_high=5, queue_low=10)
    with pytest.raises(ValueError, match="gpu_low_pct"):
        PolicyConfig(gpu_high_pct=40, gpu_low_pct=60)


def test_pinned_gpu_still_scales_down_when_the_rest_can_absorb_the_load():
    # NVML reads ~100% under any load; occupancy shows 3 replicas at 20% full
    kw = dict(replicas=3, queue=(0, 0, 0), gpu=(98, 97, 99), occupancy=(0.2, 0.2, 0.2))
    ds = run([(t, kw) for t in (0, 300)])
    assert ds[-1].desired_replicas == 2 and ds[-1].kind == "scale_down"
    # but not when removing one would leave the others more than half full
    kw = dict(replicas=3, queue=(0, 0, 0), gpu=(98, 97, 99), occupancy=(0.4, 0.4, 0.4))
    ds = run([(t, kw) for t in (0, 300)])
    assert ds[-1].desired_replicas == 3 and ds[-1].kind == "hold"


def test_simulator_is_deterministic_and_bounded():
    from autoscale.sim import SimConfig, ours, simulate

    cfg = SimConfig(duration_s=1800, diurnal_period_s=1800, max_replicas=5)
    a = simulate(cfg, "a", ours(cfg))
    b = simulate(cfg, "b", ours(cfg))
    assert (a.requests, a.replica_seconds, a.scale_events) == (b.requests, b.replica_seconds, b.scale_events)
    assert a.requests > 1000
    assert 1 * 1800 <= a.replica_seconds <= 5 * 1800
