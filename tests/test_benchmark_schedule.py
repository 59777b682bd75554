"""The benchmarks' arrival schedule: the engine-alone and full-stack runs must meet the same one."""

import random

from benchmarks.gpu_engine import FIRST_WAVE_SPAN_S, first_wave_arrivals


def test_first_wave_is_the_same_whatever_was_drawn_before():
    a = first_wave_arrivals(64)
    random.seed(1)
    random.random()  # other draws (prompts, the module RNG) must not move it
    assert first_wave_arrivals(64) == a
    assert first_wave_arrivals(32) != a[:32]


def test_first_wave_spans_its_window_in_order():
    for conc in (1, 2, 32, 64):
        xs = first_wave_arrivals(conc)
        assert len(xs) == conc and xs[0] == 0.0
        assert all(b >= a for a, b in zip(xs, xs[1:]))
        if conc > 1:
            assert abs(xs[-1] - FIRST_WAVE_SPAN_S) < 1e-9
    gaps = [b - a for a, b in zip(first_wave_arrivals(64), first_wave_arrivals(64)[1:])]
    assert max(gaps) > 3 * min(gaps)  # Poisson-like gaps, not an even spread
