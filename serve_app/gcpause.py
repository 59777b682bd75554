"""Python's garbage-collector pauses in a serving process, counted.

Why: a full (generation-2) collection walks every tracked object and holds the
GIL while it does, so the engine's thread launches no GPU step meanwhile. A
replica holds torch, transformers, Ray and, after a compile, Dynamo's and
Inductor's objects: on the H200 host one full collection of the 7B replica
took 1.0-1.2 s. Ray Serve 2.60 already collects and freezes (``gc.freeze``)
each replica's objects once its constructor has returned
(``RAY_SERVE_FREEZE_GC_ON_STARTUP``, on by default), so later collections walk
only what requests allocate; this recorder shows whether that holds under load
(the LLM server reports it under ``gc`` in /admin/engine-stats). Its counts
start in the replica's constructor, so they include Ray Serve's one startup
collection.
"""

from __future__ import annotations

import gc
import threading
import time


class GcPauses:
    """Counts collections per generation and their summed and longest pause (``gc.callbacks``).

    No lock: a callback runs with the GIL held, in whichever thread's allocation started the
    collection, and a lock taken there would deadlock against an allocation made under it.
    """

    def __init__(self) -> None:
        self._started: float | None = None
        self.count = [0, 0, 0]
        self.total_ms = [0.0, 0.0, 0.0]
        self.max_ms = [0.0, 0.0, 0.0]
        self._frozen = 0
        self._frozen_at = -1  # full collections counted when _frozen was

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        ms = 1000.0 * (time.perf_counter() - self._started)
        self._started = None
        gen = min(int(info.get("generation", 2)), 2)
        self.count[gen] += 1
        self.total_ms[gen] += ms
        self.max_ms[gen] = max(self.max_ms[gen], ms)

    def snapshot(self) -> dict:
        return {
            "collections": list(self.count),
            "pause_total_ms": [round(x, 2) for x in self.total_ms],
            "pause_max_ms": [round(x, 2) for x in self.max_ms],
            "frozen_objects": self._frozen_objects(),
        }

    def _frozen_objects(self) -> int:
        # gc.get_freeze_count() walks the whole frozen list with the GIL held: for the 7B engine's
        # ~0.8M objects ~75 ms, and the engine process sent a snapshot every 50 ms, which took its
        # decode step from 4.75 to 79 ms on the H200 (docs/gpu_notes.md run 41). So it is counted again
        # only after a full collection: a process freezes once, at start, right after one (Ray Serve's
        # collect after a replica's constructor; the engine process's own). A count taken before that
        # freeze (a direct-streaming replica reads its stats while it starts) is thus not kept.
        if self._frozen_at != self.count[2]:
            self._frozen = gc.get_freeze_count()
            self._frozen_at = self.count[2]
        return self._frozen


_PAUSES: GcPauses | None = None
_INSTALL_LOCK = threading.Lock()


def pauses() -> GcPauses:
    """This process's recorder, installed on first use."""
    global _PAUSES
    with _INSTALL_LOCK:
        if _PAUSES is None:
            _PAUSES = GcPauses()
            gc.callbacks.append(_PAUSES.callback)
        return _PAUSES
