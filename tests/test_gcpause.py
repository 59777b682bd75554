"""Garbage-collector pauses (serve_app/gcpause.py) are counted per generation."""

import gc

from serve_app.gcpause import GcPauses, pauses


def test_collections_are_counted_per_generation_with_their_pauses():
    rec = GcPauses()
    gc.callbacks.append(rec.callback)
    try:
        hoard = [{"i": i} for i in range(200_000)]  # a full collection has something to walk
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        del hoard
    finally:
        gc.callbacks.remove(rec.callback)
    snap = rec.snapshot()
    assert snap["collections"][0] >= 1 and snap["collections"][2] >= 2
    assert snap["pause_total_ms"][2] >= snap["pause_max_ms"][2] > 0.0
    assert snap["pause_total_ms"][2] > snap["pause_total_ms"][0] / snap["collections"][0]


def test_the_process_recorder_is_installed_once():
    assert pauses() is pauses()
    assert gc.callbacks.count(pauses().callback) == 1


def test_a_collection_started_inside_a_snapshot_does_not_hang_it():
    import threading

    rec = GcPauses()
    gc.callbacks.append(rec.callback)
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # every new container starts a collection, also the lists a snapshot builds
    done = threading.Event()

    def read_often():
        for _ in range(2000):
            rec.snapshot()
        done.set()

    try:
        threading.Thread(target=read_often, daemon=True).start()
        assert done.wait(30), "snapshot hung in a collection it started"
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(rec.callback)
    assert rec.snapshot()["collections"][0] > 100


def test_a_snapshot_counts_the_frozen_objects_once(monkeypatch):
    # counting them walks the whole frozen list with the GIL held (~75 ms for a 7B engine's process);
    # the engine process takes a snapshot every 50 ms, so it must not count each time
    rec = GcPauses()
    walks = []
    real = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: walks.append(1) or real())
    hoard = [{"i": i} for i in range(10_000)]
    gc.freeze()
    try:
        counts = [rec.snapshot()["frozen_objects"] for _ in range(100)]
    finally:
        gc.unfreeze()
        del hoard
    assert counts[0] >= 10_000 and set(counts) == {counts[0]}
    assert len(walks) == 1
