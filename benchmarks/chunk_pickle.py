"""What one engine step's message costs to pickle and unpickle: EngineChunk by its fields against a dataclass's
default pickle.

    python benchmarks/chunk_pickle.py [--streams 64] [--repeats 5] [--loops 2000] [--out FILE]

The engine process sends a step's chunks as one message (``("out", [(request id, chunk), ...], stats, gc)``);
the child dumps it and the replica loads it once per engine step, on the loop every stream's tokens pass
through. A one-token chunk per stream, as in decode. ``default`` is the dataclass's own pickle (the object, then
a dict of its field names and values); ``fields`` is ``EngineChunk.__reduce__`` (the class and a tuple of
values). Best of ``--repeats`` runs of ``--loops`` each, microseconds per message. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import print_table, save_json  # noqa: E402


def step_message(streams: int) -> tuple:
    from serve_app.engines.base import EngineChunk

    chunks = [(f"req-{i}", EngineChunk(f"req-{i}", [1000 + i], " tok", [-0.5], None, None, 512, 40))
              for i in range(streams)]
    return ("out", chunks, None, None)


def best_us(fn, repeats: int, loops: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return 1e6 * best


def measure(msg: tuple, label: str, args) -> dict:
    data = pickle.dumps(msg)
    return {"pickle": label, "streams": args.streams, "bytes": len(data),
            "dumps_us": best_us(lambda: pickle.dumps(msg), args.repeats, args.loops),
            "loads_us": best_us(lambda: pickle.loads(data), args.repeats, args.loops)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loops", type=int, default=2000)
    p.add_argument("--out", default=str(ROOT / "results" / "chunk_pickle.json"))
    args = p.parse_args()
    from serve_app.engines.base import EngineChunk

    msg = step_message(args.streams)
    rows = [measure(msg, "fields", args)]
    reduce = EngineChunk.__reduce__
    # the dataclass's default: object.__reduce_ex__ (copyreg.__newobj__ and the instance's __dict__)
    del EngineChunk.__reduce__
    try:
        rows.insert(0, measure(msg, "default", args))
    finally:
        EngineChunk.__reduce__ = reduce
    save_json(args.out, {"command": " ".join(sys.argv), "rows": rows})
    print_table(rows, ["pickle", "streams", "bytes", "dumps_us", "loads_us"])


if __name__ == "__main__":
    main()
