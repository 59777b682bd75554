"""Python's garbage collector in the serving processes: pauses measured, startup objects frozen.

Why: a full (generation-2) collection walks every tracked object in the process
and holds the GIL while it does. A replica holds torch, transformers, Ray and,
after a compile, Dynamo's and Inductor's objects: ~440k objects in the CPU
SmolLM2 replica, whose full collection took 147 ms on the CI box. Python starts
one whenever enough young objects have survived, so under load the engine's
thread stops launching GPU steps and every stream stalls for that long, at
random. ``gc.freeze()`` after start-up moves what exists by then (the model,
the libraries) into a permanent generation that collections skip, so they walk
only what requests allocate (vLLM's engine core does the same). Nothing frozen
is ever freed: only objects that live as long as the process should exist then.
"""

from __future__ import annotations

import gc
import threading
import time


class GcPauses:
    """Counts collections per generation and their summed and longest pause (``gc.callbacks``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: float | None = None
        self.count = [0, 0, 0]
        self.total_ms = [0.0, 0.0, 0.0]
        self.max_ms = [0.0, 0.0, 0.0]

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        ms = 1000.0 * (time.perf_counter() - self._started)
        self._started = None
        gen = min(int(info.get("generation", 2)), 2)
        with self._lock:
            self.count[gen] += 1
            self.total_ms[gen] += ms
            self.max_ms[gen] = max(self.max_ms[gen], ms)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "collections": list(self.count),
                "pause_total_ms": [round(x, 2) for x in self.total_ms],
                "pause_max_ms": [round(x, 2) for x in self.max_ms],
                "frozen_objects": gc.get_freeze_count(),
            }


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


def freeze_startup_objects() -> int:
    """Collects once, then freezes everything left; returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
