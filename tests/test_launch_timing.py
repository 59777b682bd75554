"""The engine's launch timing (launch_lead_ms): a pure rule with the clock passed in."""

from __future__ import annotations

import pytest

from serve_app.engines.launch_timing import GapMeter, PassTimer, PassTimes, launch_wait_s, pass_label, pass_times_delta


def test_a_kind_never_measured_has_no_prediction_and_launches_at_once():
    timer = PassTimer()
    assert timer.predicted_s(("decode", 64, 768)) is None
    assert launch_wait_s(now_s=10.0, started_s=10.0, predicted_s=timer.predicted_s(("decode", 64, 768)),
                         lead_s=0.002) == 0.0


def test_the_prediction_is_the_shortest_recent_pass_of_its_kind_alone():
    timer = PassTimer(keep=3)
    for d in (0.0060, 0.0058, 0.0065):
        timer.observe(("decode", 64, 768), d)
    timer.observe(("mixed", (512, 64, 768, False)), 0.0165)
    assert timer.predicted_s(("decode", 64, 768)) == 0.0058
    assert timer.predicted_s(("mixed", (512, 64, 768, False))) == 0.0165
    # the shortest falls out of the window once `keep` newer ones came
    for d in (0.0061, 0.0062, 0.0063):
        timer.observe(("decode", 64, 768), d)
    assert timer.predicted_s(("decode", 64, 768)) == 0.0061
    timer.observe(("decode", 64, 768), 0.0)  # a clock that did not move is no measurement
    assert timer.predicted_s(("decode", 64, 768)) == 0.0061
    with pytest.raises(ValueError, match="keep"):
        PassTimer(keep=0)


def test_the_launch_waits_until_the_lead_before_the_predicted_end():
    # a 16.5 ms pass that started at t=100 s: with a 2 ms lead, launch at 100.0145
    assert launch_wait_s(now_s=100.001, started_s=100.0, predicted_s=0.0165, lead_s=0.002) == pytest.approx(0.0135)
    assert launch_wait_s(now_s=100.0145, started_s=100.0, predicted_s=0.0165, lead_s=0.002) == pytest.approx(0.0)
    # past that moment (or a lead longer than the pass): at once, never a negative wait
    assert launch_wait_s(now_s=100.016, started_s=100.0, predicted_s=0.0165, lead_s=0.002) == 0.0
    assert launch_wait_s(now_s=100.0, started_s=100.0, predicted_s=0.005, lead_s=0.010) == 0.0
    # no lead: the engine launches as soon as the step before is handed out
    assert launch_wait_s(now_s=100.001, started_s=100.0, predicted_s=0.0165, lead_s=None) == 0.0


def test_the_engine_waits_for_the_lead_before_the_pass_in_flight_ends():
    # the engine's glue (HFEngine._launch_wait_s): its option in ms, the pass in flight's start and kind, and
    # the timer's prediction; no model is loaded (the wait only arises on a GPU, where passes stay in flight)
    import time

    from serve_app.engines.hf import HFEngine, _InFlight
    from serve_app.engines.options import HFEngineOptions

    eng = HFEngine(HFEngineOptions(model="/unused"))
    assert eng.options.launch_lead_ms == 1.0  # the default since the H200 runs (docs/gpu_notes.md 82-93)
    assert eng._launch_wait_s() == 0.0  # nothing in flight
    kind = ("mixed", (512, 64, 768, False))
    # a pass that starts 1 s from now, so the checks do not hang on how fast this box runs them
    start = time.monotonic() + 1.0
    eng._inflight = _InFlight([], None, None, None, 0, kind, launched_s=start, started_s=start)
    assert eng._launch_wait_s() == 0.0  # a kind never measured launches at once
    eng._pass_timer.observe(kind, 0.0165)
    assert 1.0 < eng._launch_wait_s() <= 1.0155  # 16.5 ms less the 1 ms lead
    eng.options.launch_lead_ms = 10.0
    assert 1.0 < eng._launch_wait_s() <= 1.0065
    eng.options.launch_lead_ms = None
    assert eng._launch_wait_s() == 0.0
    eng.options.launch_lead_ms = 2.0
    eng._inflight.started_s = None  # a mixed pass whose first token was read at once: nothing to wait for
    assert eng._launch_wait_s() == 0.0


def test_the_gap_meter_counts_the_gpu_between_consecutive_passes_only():
    # events as GPU timestamps in ms: elapsed_ms(a, b) is b - a, as a.elapsed_time(b) on CUDA events
    meter = GapMeter(elapsed_ms=lambda a, b: b - a, late_ms=0.1)
    meter.on_read(7, start=0.0, end=5.8)  # the first pass read: no pass before it to measure from
    assert meter.measured == 0
    meter.on_read(8, start=5.83, end=11.6)  # launched 30 us before the GPU could start it: a small gap
    meter.on_read(9, start=12.1, end=28.6)  # launched 0.5 ms after the GPU ran dry
    assert (meter.measured, meter.late) == (2, 1)
    assert meter.total_ms == pytest.approx(0.03 + 0.5)
    # pass 10 was never read (a lost event): the time from 9's end to 11's start is not known to be a gap
    meter.on_read(11, start=45.0, end=50.8)
    assert meter.measured == 2
    meter.on_read(12, start=50.8, end=56.6)  # back to back: a gap of 0, measured
    meter.on_read(13, start=None, end=62.4)  # a pass without a start event (no CUDA) says nothing
    meter.on_read(14, start=62.3, end=68.2)  # a clock a hair apart is no negative gap
    assert (meter.measured, meter.late) == (4, 1)
    assert meter.total_ms == pytest.approx(0.53)
    # the engine waited for requests: the GPU's wait for them is no gap of the host's
    meter.restart()
    meter.on_read(15, start=5000.0, end=5010.0)
    assert meter.measured == 4
    meter.on_read(16, start=5010.2, end=5016.0)
    assert (meter.measured, meter.late) == (5, 2)


class FakeCudaEvent:
    """Stands in for torch.cuda.Event, which needs a GPU: a pass's end (or start) at a fixed time in ms that has
    already completed."""

    def __init__(self, at_ms: float):
        self.at_ms = at_ms

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "FakeCudaEvent") -> float:
        return other.at_ms - self.at_ms


def test_the_engine_measures_the_gap_between_the_passes_it_reads():
    # the engine's glue (HFEngine._read_inflight): each pass read gives its launch index and start and end events
    # to the meter, and the stats carry the totals
    import torch

    from serve_app.engines.hf import HFEngine, _InFlight
    from serve_app.engines.options import HFEngineOptions

    eng = HFEngine(HFEngineOptions(model="/unused"))
    for index, (start, end) in enumerate([(0.0, 5.8), (6.3, 12.1), (12.1, 17.9)], start=1):
        eng._inflight = _InFlight([], torch.zeros(1, dtype=torch.long), torch.zeros(1), FakeCudaEvent(end), 0,
                                  ("decode", (64, 768)), launched_s=0.0, index=index,
                                  start_event=FakeCudaEvent(start))
        eng._read_inflight()
    s = eng.stats()
    assert (s.gpu_gaps_measured, s.gpu_gaps_late) == (2, 1)
    assert s.gpu_gap_total_ms == pytest.approx(0.5)
    # and each pass's own GPU time, by kind: three decode steps of 5.8 ms
    assert list(s.gpu_pass_ms) == ["decode_r64"]
    assert s.gpu_pass_ms["decode_r64"][0] == 3
    assert s.gpu_pass_ms["decode_r64"][1] == pytest.approx(3 * 5.8)
    before = s.gpu_pass_ms
    eng._inflight = _InFlight([], torch.zeros(1, dtype=torch.long), torch.zeros(1), FakeCudaEvent(35.0), 0,
                              ("mixed", (512, 64, 768, False)), launched_s=0.0, index=4,
                              start_event=FakeCudaEvent(18.3))
    eng._read_inflight()
    assert pass_times_delta(before, eng.stats().gpu_pass_ms) == {
        "mixed_512_r64": {"passes": 1, "total_ms": 16.7, "mean_ms": 16.7}}
    assert before["decode_r64"][0] == 3  # a snapshot, not the live sums


def test_passes_are_summed_by_kind_and_a_load_is_the_difference_of_two_snapshots():
    assert pass_label(("decode", (24, 768))) == "decode_r24"
    assert pass_label(("mixed", (512, 64, 768, False))) == "mixed_512_r64"
    assert pass_label(("mixed", (64, 32, 1024, True))) == "mixed_64_r32_resume"
    assert pass_label(("prefill", None), prompts=3) == "prefill_3p"
    with pytest.raises(ValueError, match="valid: decode, mixed, prefill"):
        pass_label(("verify", None))
    times = PassTimes()
    times.add("decode_r64", 5.8)
    times.add("mixed_512_r64", 16.5)
    first = times.snapshot()
    times.add("decode_r64", 6.0)
    times.add("decode_r64", 5.9)
    times.add("prefill_3p", 33.0)
    second = times.snapshot()
    assert first == {"decode_r64": [1, 5.8], "mixed_512_r64": [1, 16.5]}  # unchanged by later passes
    delta = pass_times_delta(first, second)
    # the mixed kind had no pass in between: left out
    assert set(delta) == {"decode_r64", "prefill_3p"}
    assert delta["decode_r64"]["passes"] == 2
    assert delta["decode_r64"]["mean_ms"] == pytest.approx(5.95)
    assert delta["prefill_3p"] == {"passes": 1, "total_ms": 33.0, "mean_ms": 33.0}
    assert pass_times_delta({}, {}) == {}


def test_a_snapshot_taken_while_the_engine_adds_passes_is_whole():
    # the engine's thread adds; the relay (engine process) or the replica's loop takes snapshots meanwhile
    import sys
    import threading

    times = PassTimes()
    done = threading.Event()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads change hands often, as they may on a busy replica

    def engine():
        for i in range(600_000):
            times.add(f"k{i % 20000}", 1.0)  # new labels for a while, then repeats
        done.set()

    t = threading.Thread(target=engine)
    t.start()
    snapshots = 0
    try:
        while not done.is_set() or snapshots == 0:
            for n, total_ms in times.snapshot().values():
                assert total_ms == n * 1.0  # no pass counted without its time
            snapshots += 1
    finally:
        sys.setswitchinterval(switch)
        t.join()
    assert sum(n for n, _ in times.snapshot().values()) == 600_000
