"""CPU the engine process's relay spends per engine step, beside the engine.

    python benchmarks/relay_cpu.py [--streams 64] [--tokens 32] [--rounds 3] [--out FILE]

SmolLM2 (the embedded model) on the CPU in a child process (``engine.process:
separate``), ``--streams`` concurrent requests of ``--tokens`` tokens, ``--rounds``
times. The child's main thread runs only the relay (requests in, chunks out,
one message per engine step); the engine has a thread of its own. The relay's
CPU comes from /proc (Linux), per engine step and per 1,000 tokens: on a GPU
host that time is taken from the engine thread's share of the GIL in every
step, and from how soon a reply reaches the replica (docs/gpu_notes.md runs
79-81). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import save_json, stat_cpu_s  # noqa: E402


def thread_cpu_s(pid: int, tid: int) -> float:
    """User + system CPU seconds of one thread."""
    return stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")


async def load(engine, streams: int, tokens: int, tag: str) -> int:
    from serve_app.engines.base import GenerationRequest, SamplingParams

    async def one(i: int) -> int:
        n = 0
        req = GenerationRequest(f"{tag}-{i}", [1000 + i % 50] * 16,
                                SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        async for c in engine.generate(req):
            n += len(c.token_ids)
        return n

    return sum(await asyncio.gather(*[one(i) for i in range(streams)]))


async def run(args) -> dict:
    from serve_app.engines.registry import create_engine

    engine = create_engine("hf", {"model": "embedded:smollm2-135m-instruct", "device": "cpu",
                                  "max_num_seqs": args.streams, "max_model_len": 512}, process="separate")
    await engine.start()
    pid = engine.warm_up["engine_process_pid"]
    await load(engine, args.streams, 4, "warm")
    await asyncio.sleep(0.6)  # the child's stats arrive at most every 0.5 s when idle
    passes0, relay0, t0 = engine.stats().forward_passes, thread_cpu_s(pid, pid), time.perf_counter()
    tokens = 0
    for r in range(args.rounds):
        tokens += await load(engine, args.streams, args.tokens, f"r{r}")
    wall = time.perf_counter() - t0
    relay = thread_cpu_s(pid, pid) - relay0
    await asyncio.sleep(0.6)
    passes = engine.stats().forward_passes - passes0
    await engine.shutdown()
    return {"streams": args.streams, "tokens_per_request": args.tokens, "rounds": args.rounds, "tokens": tokens,
            "engine_passes": passes, "wall_s": round(wall, 2), "relay_cpu_s": round(relay, 3),
            "relay_cpu_ms_per_pass": round(1000 * relay / max(1, passes), 3),
            "relay_cpu_ms_per_1k_tokens": round(1e6 * relay / max(1, tokens), 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "results" / "relay_cpu.json"))
    args = p.parse_args()
    res = asyncio.run(run(args))
    save_json(args.out, res)
    print(json.dumps(res))
    print(f"{'streams':>8}{'tokens':>8}{'passes':>8}{'relay CPU s':>13}{'ms / pass':>11}{'ms / 1k tok':>13}")
    print(f"{res['streams']:>8}{res['tokens']:>8}{res['engine_passes']:>8}{res['relay_cpu_s']:>13.3f}"
          f"{res['relay_cpu_ms_per_pass']:>11.3f}{res['relay_cpu_ms_per_1k_tokens']:>13.1f}")


if __name__ == "__main__":
    main()
