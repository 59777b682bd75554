"""The overlap probe's arithmetic and queue order (benchmarks/gpu_overlap_probe.py; its timings need a GPU)."""

import pytest

from benchmarks.gpu_overlap_probe import hidden_share, interleaved


def test_hidden_share_spans_adding_to_full_overlap():
    assert hidden_share(80.0, 90.0, 170.0) == 0.0  # the times added
    assert hidden_share(80.0, 90.0, 90.0) == 1.0  # only the longer kind's time
    assert hidden_share(80.0, 90.0, 130.0) == pytest.approx(0.5)
    assert hidden_share(80.0, 90.0, 186.0) == pytest.approx(-0.2)  # slower than one after the other


def test_hidden_share_rejects_a_kind_that_took_no_time():
    with pytest.raises(ValueError, match="positive"):
        hidden_share(0.0, 90.0, 90.0)


def test_interleaved_alternates_then_queues_the_longer_kinds_rest():
    order = [name for name, _ in interleaved(2, 5, "p", "d")]
    assert order == ["decode", "prefill", "decode", "prefill", "decode", "decode", "decode"]
    assert [fn for _, fn in interleaved(1, 1, "p", "d")] == ["d", "p"]
