"""When the hf engine launches its next pass: at once, or just before the pass in flight ends.

Why: the engine thread keeps one pass queued behind the one the GPU runs,
and picks the next pass's prompts when it launches it, right after handing
out the previous step's tokens. A stream's next request answers those
tokens; when it has to cross a process (the engine's own, a GPU replica's
default), it arrives after that choice and waits a whole pass more. On an
H200 (7B, 64 x 10) only 2 % of such requests met the pass after their
arrival, against 36 % with the load in the engine's own process, and the
queue's median went from 5.6 to 15 ms (docs/gpu_notes.md runs 79-81).
Launching ``lead_s`` before the pass in flight is due to end leaves the
request that much more time, and the GPU no gap as long as the launch
comes before the end.

A pass's end is predicted from the same kind of pass measured before: the
engine's passes are captured CUDA graphs of a few shapes, whose GPU time
hardly varies. Only exact measurements count (the host waited for the pass
from the moment the GPU started it, so both ends are known), and the
prediction is the shortest recent one: an early launch costs only part of
the gain, a late one a gap on the GPU. A kind of pass never measured
launches at once, as without a lead. Pure, with the clock passed in, so it
is tested without an engine.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Hashable


class PassTimer:
    """The GPU time of recent passes, by kind (a captured graph's key)."""

    def __init__(self, keep: int = 8):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._keep = keep
        self._seen: dict[Hashable, collections.deque] = {}

    def observe(self, kind: Hashable, duration_s: float) -> None:
        if duration_s <= 0:  # a clock that did not move says nothing
            return
        self._seen.setdefault(kind, collections.deque(maxlen=self._keep)).append(duration_s)

    def predicted_s(self, kind: Hashable) -> float | None:
        """The shortest of the recent passes of ``kind``; None if none was measured."""
        seen = self._seen.get(kind)
        return min(seen) if seen else None


def launch_wait_s(now_s: float, started_s: float, predicted_s: float | None, lead_s: float | None) -> float:
    """How long to wait before launching the next pass, given the pass in flight started on the GPU at
    ``started_s`` and is predicted to take ``predicted_s``: until ``lead_s`` before its end, and 0 without a
    lead, without a prediction, or when that moment has passed."""
    if lead_s is None or predicted_s is None:
        return 0.0
    return max(0.0, started_s + predicted_s - lead_s - now_s)


class GapMeter:
    """The GPU's time between one pass's end and the next one's start, from events recorded around each pass
    (CUDA events on a GPU; ``elapsed_ms(a, b)`` is ``a.elapsed_time(b)``).

    Why: a launch lead that is too short, or a host that is late, shows only as a gap on the GPU, which the
    throughput of one run hides in the spread between runs (±2 %); measured, it says what a lead costs, and
    what the host costs where it waits for a pass (a several-prompt prefill, a host-sampled step) before it
    launches the next. Passes are read in launch order; only consecutive ones count (``index`` one more than the
    last read's), and :meth:`restart` after the engine waited for work: a GPU idle for want of requests is not
    the host's gap. The small kernels the host queues between two passes (freeing a slot) count as gap: they
    are the host's too."""

    def __init__(self, elapsed_ms: Callable[[Any, Any], float] = lambda a, b: a.elapsed_time(b),
                 late_ms: float = 0.1):
        self._elapsed_ms = elapsed_ms
        self.late_ms = late_ms
        self._prev: tuple[int, Any] | None = None  # (index, end event) of the last pass read
        self.measured = 0  # gaps measured
        self.total_ms = 0.0
        self.late = 0  # gaps over late_ms: the pass was launched after the GPU ran dry

    def on_read(self, index: int, start: Any, end: Any) -> None:
        """A pass is done (its ``end`` event has completed): the gap before it, if the last pass read came right
        before it."""
        prev, self._prev = self._prev, (index, end)
        if prev is None or prev[0] != index - 1 or start is None or prev[1] is None:
            return
        gap_ms = max(0.0, self._elapsed_ms(prev[1], start))
        self.measured += 1
        self.total_ms += gap_ms
        if gap_ms > self.late_ms:
            self.late += 1

    def restart(self) -> None:
        """The engine had nothing to run: the next pass's wait is not measured."""
        self._prev = None


def pass_label(kind: tuple, prompts: int = 0) -> str:
    """A pass's label in :class:`PassTimes`: ``decode_r{rows}`` for a decode step of that row bucket,
    ``mixed_{length}_r{rows}`` (``_resume`` for a later chunk) for a mixed pass, ``prefill_{n}p`` for a
    prefill pass of n prompts that the host waited for."""
    what, key = kind
    if what == "decode":
        return f"decode_r{key[0]}"
    if what == "mixed":
        length, rows, _span, resumes = key
        return f"mixed_{length}_r{rows}" + ("_resume" if resumes else "")
    if what == "prefill":
        return f"prefill_{prompts}p"
    raise ValueError(f"unknown pass kind {what!r}; valid: decode, mixed, prefill")


class PassTimes:
    """The GPU time of every pass, summed by label (:func:`pass_label`), from the events recorded around
    each pass: the same events the GapMeter reads.

    Why: what a pass costs under load is what a change to the passes (a kernel, a GEMM size, a graph) is
    judged by, and a run's throughput moves ±2 % between machines and runs. The replay probes that time
    passes alone need the engine in the benchmark's process, so with the engine in its own process (a GPU
    replica's layout) and through the stack they cannot run; these sums come back with the engine's stats
    from any process. A pipelined pass's span runs from its start event (which the GPU reaches when the
    pass before ends) to the event after its tokens' copy to the host, so it holds the pass and its
    sampling; a prefill pass the host waited for, to the event after its last kernel was queued, so it also
    holds any launch gaps of an uncaptured pass."""

    def __init__(self):
        # immutable pairs, each replaced by one store: the engine's thread adds while another thread (the
        # replica's loop, the engine process's relay) takes a snapshot, and a dict copied in one call under
        # the GIL neither sees a pass half added nor fails on a label added meanwhile
        self._sums: dict[str, tuple[int, float]] = {}

    def add(self, label: str, ms: float) -> None:
        n, total_ms = self._sums.get(label, (0, 0.0))
        self._sums[label] = (n + 1, total_ms + ms)

    def snapshot(self) -> dict[str, list[float]]:
        """label -> [passes, total ms], a copy."""
        return {label: list(v) for label, v in dict(self._sums).items()}


def pass_times_delta(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """What happened between two :meth:`PassTimes.snapshot` (a load's passes): label -> passes, total and
    mean GPU ms, for the labels with passes in between."""
    out = {}
    for label, (n, total_ms) in after.items():
        n0, t0 = before.get(label, (0, 0.0))
        if n > n0:
            out[label] = {"passes": int(n - n0), "total_ms": round(total_ms - t0, 3),
                          "mean_ms": round((total_ms - t0) / (n - n0), 4)}
    return out
