"""A replica's py-spy profile by section of the serving path: who holds the GIL, for what.

    py-spy record -p <replica pid> -d 15 -r 250 --gil -f raw -o replica.raw   # during a load
    python benchmarks/profile_sections.py replica.raw[.gz] [--out FILE]

Each sample's stack is charged to the innermost frame that names a section (the socket write of an SSE message
before the middleware it passes through, the engine relay before the stream it feeds, ...); samples that name
none are "other". With ``--gil`` every sample is a moment some thread held the GIL, so the shares are of the
replica's Python time. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import print_table, save_json  # noqa: E402

# (section, a substring of a py-spy frame "function (file:line)"), innermost match wins, in this order
SECTIONS = [
    ("socket write (uvicorn send)", "RequestResponseCycle.send"),
    ("sse format", "_sse "),
    ("llm_server per-token", "LLMServer.generate"),
    ("core stream (_rest)", "InferenceCore._rest"),
    ("coalesce pump", "coalesced"),
    ("engine relay (process.py)", "process.py"),
    ("our endpoint", "run_request"),
    ("our endpoint", "Ingress.completions"),
    ("fastapi dependencies / validation", "solve_dependencies"),
    ("fastapi body", "Request.body"),
    ("starlette streaming task group", "StreamingResponse"),
    ("fastapi/starlette routing + middleware", "FastAPI.__call__"),
    ("serve direct ingress", "Replica._direct_ingress_asgi"),
    ("serve receive proxy", "ASGIDIReceiveProxy"),
    ("uvicorn parse", "HttpToolsProtocol"),
    ("uvicorn run_asgi", "RequestResponseCycle.run_asgi"),
    ("serve handle calls (stats etc.)", "ReplicaActor"),
    ("metrics", "metrics.py"),
]


def sections(lines) -> tuple[int, collections.Counter]:
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in lines:
        stack, n = line.rstrip().rsplit(" ", 1)
        total += int(n)
        for frame in reversed(stack.split(";")):
            hit = next((name for name, marker in SECTIONS if marker in frame), None)
            if hit:
                counts[hit] += int(n)
                break
        else:
            counts["other"] += int(n)
    return total, counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy record -f raw output (gzip allowed)")
    p.add_argument("--out", default=str(ROOT / "results" / "profile_sections.json"))
    args = p.parse_args()
    opener = gzip.open if args.raw.endswith(".gz") else open
    with opener(args.raw, "rt") as f:
        total, counts = sections(f)
    rows = [{"section": k, "samples": n, "share_pct": 100 * n / total} for k, n in counts.most_common()]
    save_json(args.out, {"command": " ".join(sys.argv), "total_samples": total, "rows": rows})
    print(f"{total} samples")
    print_table(rows, ["section", "samples", "share_pct"])


if __name__ == "__main__":
    main()
