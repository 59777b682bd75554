"""Garbage-collector pauses (serve_app/gcpause.py): recorded, and startup objects frozen out of them."""

import gc

from serve_app.gcpause import GcPauses, freeze_startup_objects, pauses


class _Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def test_collections_are_counted_per_generation_with_their_pauses():
    rec = GcPauses()
    gc.callbacks.append(rec.callback)
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        gc.callbacks.remove(rec.callback)
    snap = rec.snapshot()
    assert snap["collections"][0] >= 1 and snap["collections"][2] >= 2
    assert snap["pause_total_ms"][2] >= snap["pause_max_ms"][2] > 0.0


def test_frozen_objects_are_skipped_by_full_collections_and_cycles_still_freed():
    import time
    import weakref

    hoard = [{"i": i, "xs": [i, str(i)]} for i in range(300_000)]  # a model's worth of long-lived objects

    def full_collection_ms():
        t0 = time.perf_counter()
        gc.collect(2)
        return 1000 * (time.perf_counter() - t0)

    unfrozen = min(full_collection_ms() for _ in range(3))
    try:
        assert freeze_startup_objects() >= len(hoard)
        frozen = min(full_collection_ms() for _ in range(3))
        assert frozen < unfrozen / 3, (frozen, unfrozen)
        # what requests allocate after the freeze is still collected
        node = _Node()
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
    del hoard


def test_the_process_recorder_is_installed_once():
    assert pauses() is pauses()
    assert gc.callbacks.count(pauses().callback) == 1
