"""What counting the dynamic KV cache's padding costs: the hf engine on the CPU (the embedded SmolLM2, the
dynamic cache, the default there) under a load of long answers among short ones, admitted two ways.

    python benchmarks/kv_admission.py [--long 4] [--short 24] [--long-tokens 384] [--short-tokens 24]
                                      [--short-after 0] [--max-num-seqs 16] [--max-kv-tokens 4096] [--out DIR]

The dynamic cache's rows are left-padded to the longest, so it holds rows x the longest row. Three rules
for admitting a request against max_kv_tokens:
  "sum"     the rows' reservations (prompt + max_tokens) summed: the engine's rule before 02569a8;
  "longest" (rows + 1) x the longest reservation: 02569a8's;
  "peak"    the most the padded cache can reach from now on if every row runs to its end
            (serve_app.engines.memory.padded_peak_tokens): the engine's rule now.
"sum" and "longest" are put back for the run by replacing the engine's ``_room_for`` on the instance (a
benchmark's stand-in, nothing the engine runs). Each rule serves the same requests: the long ones first, then,
once the first long one has made ``--short-after`` tokens, the short ones one every ``--gap-ms``. Reported per
rule: output tok/s, the short requests' TTFT and end-to-end p50 / p95, and the most tokens the cache held at
any step (rows x columns, read after every decode step) against max_kv_tokens, with the bytes at SmolLM2's
45 KiB a token in float32. Prints a table last, writes kv_admission.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


async def run_rule(rule: str, args) -> dict:
    from serve_app.engines.base import GenerationRequest, SamplingParams
    from serve_app.engines.memory import KVLayout
    from serve_app.engines.registry import create_engine

    eng = create_engine("hf", {"device": "cpu", "kv_cache": "dynamic", "max_num_seqs": args.max_num_seqs,
                               "max_kv_tokens": args.max_kv_tokens, "max_model_len": args.max_model_len,
                               "max_waiting_requests": args.long + args.short})
    await eng.start()
    try:
        opts = eng.options
        if rule == "sum":
            def room_for_sum(seq, running, rows=None):
                reserved = sum(c + r for c, r in rows)
                return running < opts.max_num_seqs and reserved + seq.reserved_tokens <= opts.max_kv_tokens

            eng._room_for = room_for_sum
        elif rule == "longest":
            def room_for_longest(seq, running, rows=None):
                widest = max([seq.reserved_tokens] + [c + r for c, r in rows])
                return running < opts.max_num_seqs and (running + 1) * widest <= opts.max_kv_tokens

            eng._room_for = room_for_longest
        held: list[int] = []
        decode = eng._runner.decode

        def recording(tokens):
            out = decode(tokens)
            held.append(eng._runner.batch.mask.numel())
            return out

        eng._runner.decode = recording
        ids = eng.encode_chat([{"role": "user", "content": "Tell me about the history of banking."}])

        made: dict[str, int] = {}

        async def one(rid: str, max_tokens: int) -> dict:
            t0 = time.perf_counter()
            first, made[rid] = None, 0
            async for c in eng.generate(GenerationRequest(rid, ids, SamplingParams(
                    max_tokens=max_tokens, temperature=0, ignore_eos=True))):
                if first is None and c.token_ids:
                    first = time.perf_counter()
                made[rid] += len(c.token_ids)
            end = time.perf_counter()
            return {"tokens": made[rid], "ttft_s": first - t0, "e2e_s": end - t0}

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(f"long{i}", args.long_tokens)) for i in range(args.long)]
        while made.get("long0", 0) < args.short_after:
            await asyncio.sleep(0.01)
        shorts = []
        for i in range(args.short):
            await asyncio.sleep(args.gap_ms / 1000)
            shorts.append(asyncio.create_task(one(f"short{i}", args.short_tokens)))
        longs = await asyncio.gather(*tasks)
        short_res = await asyncio.gather(*shorts)
        wall = time.perf_counter() - t0
        per_token = KVLayout.of(eng.model.config, eng.dtype.itemsize).bytes_per_token
        tokens = sum(r["tokens"] for r in longs + short_res)
        return {
            "rule": rule, "wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "short_ttft_p50_ms": 1000 * statistics.median(r["ttft_s"] for r in short_res),
            "short_ttft_p95_ms": 1000 * percentile([r["ttft_s"] for r in short_res], 95),
            "short_e2e_p50_ms": 1000 * statistics.median(r["e2e_s"] for r in short_res),
            "short_e2e_p95_ms": 1000 * percentile([r["e2e_s"] for r in short_res], 95),
            "long_e2e_max_s": max(r["e2e_s"] for r in longs),
            "peak_cache_tokens": max(held), "peak_cache_mb": max(held) * per_token / 1e6,
            "budget_mb": args.max_kv_tokens * per_token / 1e6, "decode_steps": len(held),
        }
    finally:
        await eng.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--long", type=int, default=4)
    p.add_argument("--short", type=int, default=24)
    p.add_argument("--long-tokens", type=int, default=384)
    p.add_argument("--short-tokens", type=int, default=24)
    p.add_argument("--gap-ms", type=float, default=250.0)
    p.add_argument("--short-after", type=int, default=0, help="long tokens made before the first short arrives")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-kv-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--rules", nargs="+", default=["sum", "longest", "peak"], choices=["sum", "longest", "peak"])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {"args": vars(args), "cpus": os.cpu_count(), "rules": []}
    for rule in args.rules:
        results["rules"].append(asyncio.run(run_rule(rule, args)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_admission.json").write_text(json.dumps(results, indent=2))
    print(f"\n{args.long} long ({args.long_tokens} tokens) then, from the first long one's token "
          f"{args.short_after}, {args.short} short ({args.short_tokens}) every {args.gap_ms:g} ms; max_num_seqs {args.max_num_seqs}, max_kv_tokens {args.max_kv_tokens} "
          f"({results['rules'][0]['budget_mb']:.0f} MB); {results['cpus']} CPUs")
    head = ("rule", "tok/s", "short TTFT p50/p95 ms", "short e2e p50/p95 ms", "peak cache tokens", "peak MB")
    print(f"{head[0]:<8}{head[1]:>8}{head[2]:>24}{head[3]:>24}{head[4]:>19}{head[5]:>9}")
    for r in results["rules"]:
        print(f"{r['rule']:<8}{r['output_tok_s']:>8.1f}"
              f"{r['short_ttft_p50_ms']:>14.0f} / {r['short_ttft_p95_ms']:<7.0f}"
              f"{r['short_e2e_p50_ms']:>14.0f} / {r['short_e2e_p95_ms']:<7.0f}"
              f"{r['peak_cache_tokens']:>19d}{r['peak_cache_mb']:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
