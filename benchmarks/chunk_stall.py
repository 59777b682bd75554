"""How long a long prompt stalls the streams already decoding, with and without chunked prefill.

    python benchmarks/chunk_stall.py [--streams 4] [--prompt 480] [--chunks 0 64 128 256]
                                     [--repeats 3] [--out FILE]

No Ray: the hf engine with the static cache (SmolLM2 on the CPU by default).
``--streams`` greedy streams decode; once each has produced a few tokens, one
prompt of ``--prompt`` tokens arrives. Modes, on one engine one after another:

- ``separate``: mixed passes off, so the prompt gets a prefill pass of its own;
- ``chunk 0``: one mixed pass carries the whole prompt and the rows' step;
- ``chunk N``: the prompt goes in N tokens per mixed pass (``mixed_chunk_tokens``).

For each, the decoding streams' gaps between tokens: the median (one decode
step) and the longest (the stall the prompt causes), and the prompt's own
time to its first token. On the CPU nothing is captured: the mixed passes run
directly, as the CPU tests run them (``SlotDecoder.capture_mixed_graphs``), so
this measures the scheduling, on this box's speeds. Prints a table, writes JSON.
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

from benchmarks.loadgen import print_table, save_json  # noqa: E402


async def _stream(engine, rid: str, prompt: list[int], tokens: int, times: list[float]) -> None:
    from serve_app.engines.base import GenerationRequest, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    async for chunk in engine.generate(GenerationRequest(rid, prompt, sp)):
        now = time.perf_counter()
        times.extend([now] * len(chunk.token_ids))


async def one_round(engine, tag: str, args) -> dict:
    times: list[list[float]] = [[] for _ in range(args.streams)]
    tasks = [asyncio.create_task(_stream(engine, f"{tag}-s{i}", list(range(200 + i, 230 + i)), args.tokens, times[i]))
             for i in range(args.streams)]
    while min(len(t) for t in times) < 8:  # every stream past its own first passes
        await asyncio.sleep(0.001)
    long_times: list[float] = []
    t0 = time.perf_counter()
    await _stream(engine, f"{tag}-long", [300 + (7 * j) % 9000 for j in range(args.prompt)], 2, long_times)
    ttft_ms = 1000 * (long_times[0] - t0)
    window = (t0, long_times[0])
    await asyncio.gather(*tasks)
    gaps, stall = [], 0.0
    for ts in times:
        steps = [1000 * (b - a) for a, b in zip(ts, ts[1:]) if b > a]
        gaps.extend(steps)
        # the longest gap that overlaps the prompt's way to its first token
        stall = max([stall] + [1000 * (b - a) for a, b in zip(ts, ts[1:]) if b > window[0] and a < window[1]])
    return {"step_ms": statistics.median(gaps), "stall_ms": stall, "long_ttft_ms": ttft_ms}


async def measure(args) -> list[dict]:
    from serve_app.engines.registry import create_engine

    max_len = max(1024, args.prompt + 64)
    engine = create_engine("hf", {"model": args.model, "device": args.device, "kv_cache": "static",
                                  "max_num_seqs": args.streams + 1, "max_model_len": max_len})
    await engine.start()
    rows = []
    try:
        slots = engine._slots
        # the CPU captures nothing: the mixed passes' keys run the pass directly (as the CPU tests do)
        top = -(-args.prompt // 64) * 64
        modes = [("separate", None)] + [(f"chunk {c}", c) for c in args.chunks]
        slots.mixed_graph_tokens, slots.mixed_chunk_tokens = top, max(args.chunks)
        slots.capture_mixed_graphs()
        engine.options.mixed_graph_tokens = top
        for name, chunk in modes:
            slots.mixed_graphs = chunk is not None
            engine.options.mixed_chunk_tokens = chunk or 0
            before = engine.stats()
            runs = [await one_round(engine, f"{name}-{k}", args) for k in range(args.repeats)]
            after = engine.stats()
            rows.append({"mode": name,
                         "step_ms": statistics.median(r["step_ms"] for r in runs),
                         "stall_ms": statistics.median(r["stall_ms"] for r in runs),
                         "stall_max_ms": max(r["stall_ms"] for r in runs),
                         "long_ttft_ms": statistics.median(r["long_ttft_ms"] for r in runs),
                         "mixed_passes": after.mixed_passes - before.mixed_passes,
                         "runs": runs})
    finally:
        await engine.shutdown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="embedded:smollm2-135m-instruct")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--streams", type=int, default=4, help="streams decoding when the long prompt arrives")
    p.add_argument("--tokens", type=int, default=160, help="tokens each decoding stream generates")
    p.add_argument("--prompt", type=int, default=480, help="the long prompt's tokens")
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 64, 128, 256],
                   help="mixed_chunk_tokens values (0: one mixed pass for the whole prompt)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "results" / "chunk_stall.json"))
    args = p.parse_args()
    rows = asyncio.run(measure(args))
    save_json(args.out, {"args": vars(args), "rows": rows})
    print_table(rows, ["mode", "step_ms", "stall_ms", "stall_max_ms", "long_ttft_ms", "mixed_passes"])


if __name__ == "__main__":
    main()
