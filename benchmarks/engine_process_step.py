"""One stream through an engine, inline and in its own process: decode step and first token.

    python benchmarks/engine_process_step.py [--process inline separate] [--requests 3]
                                             [--prompt 100] [--tokens 64] [--out FILE]

No Ray: the engine as a replica creates it (``create_engine(..., process=...)``),
SmolLM2 on the CPU by default (``--model``, ``--device`` for another). Each
request generates exactly ``--tokens`` greedy tokens one after another; the
decode step is (end - first token) / (tokens - 1), the median over the
requests. The engine's own process should cost next to nothing here: one
stream sends one small message per step. A gap means the child spends time
beside its engine (as when every stats message walked the GC's frozen
objects, docs/benchmarks.md section 4). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import one  # noqa: E402
from benchmarks.loadgen import add_engine_process_arg, print_table, save_json  # noqa: E402


async def measure(args, process: str) -> dict:
    from serve_app.engines.registry import create_engine

    engine = create_engine("hf", {"model": args.model, "device": args.device}, process=process)
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0
    ttft, steps = [], []
    try:
        for i in range(args.requests):
            r = await one(engine, f"{process}-{i}", list(range(100, 100 + args.prompt)), args.tokens)
            ttft.append(1000 * r["ttft_s"])
            steps.append(1000 * (r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1))
    finally:
        await engine.shutdown()
    return {"process": process, "engine_start_s": start_s, "requests": args.requests,
            "ttft_ms": statistics.median(ttft), "decode_step_ms": statistics.median(steps),
            "decode_steps_ms": steps}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="embedded:smollm2-135m-instruct")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--prompt", type=int, default=100, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    add_engine_process_arg(p, "engine.process values, measured in this order")
    p.set_defaults(engine_process=["inline", "separate"])
    p.add_argument("--out", default=str(ROOT / "results" / "engine_process_step.json"))
    args = p.parse_args()
    rows = [asyncio.run(measure(args, process)) for process in args.engine_process]
    save_json(args.out, {"args": vars(args), "rows": rows})
    print_table(rows, ["process", "engine_start_s", "requests", "ttft_ms", "decode_step_ms"])


if __name__ == "__main__":
    main()
