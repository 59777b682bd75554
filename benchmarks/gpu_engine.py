"""The hf engine alone on a GPU: 7B-class model (DeepSeek-R1-Distill-Qwen-7B's
shape: Qwen2, hidden 3584, 28 layers, 28 heads, 4 KV heads, ffn 18944, vocab
152064) with random bf16 weights and fixed lengths (512 prompt / 128 output
tokens, EOS ignored).

    python benchmarks/gpu_engine.py --tokenizer DIR [--out DIR]

Runs on the device machine (see docs/benchmarks.md for the exact call).
Measures: single-stream decode step, throughput at 64 concurrent requests
arriving over time, TTFT p50/p95 at 32 concurrent, warm-up time. Prints a
table last and writes gpu_engine.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
              intermediate_size=18944, vocab_size=152064, max_position_embeddings=4096, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False)


def build_model_dir(path: Path, tokenizer_dir: Path) -> float:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t0 = time.perf_counter()
    cfg = Qwen2Config(**QWEN7B, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # random, not zeros: zeros run faster than real data
            p.normal_(0.0, 0.02, generator=g)
    model.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, path / f.name)
    del model
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


async def one(engine, rid, prompt, out_tokens, arrive_s=0.0):
    from serve_app.engines.base import GenerationRequest, SamplingParams

    await asyncio.sleep(arrive_s)
    t0 = time.perf_counter()
    first = None
    n = 0
    async for c in engine.generate(GenerationRequest(rid, prompt, SamplingParams(max_tokens=out_tokens, temperature=0,
                                                                                 ignore_eos=True))):
        if first is None:
            first = time.perf_counter() - t0
        n += len(c.token_ids)
    return {"ttft_s": first, "e2e_s": time.perf_counter() - t0, "tokens": n}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def run(args) -> dict:
    import torch

    from serve_app.engines.registry import create_engine

    model_dir = Path(args.work) / "qwen2-7b-random"
    build_s = build_model_dir(model_dir, Path(args.tokenizer))
    t0 = time.perf_counter()
    engine = create_engine("hf", {"model": str(model_dir), "device": "cuda", "dtype": "bfloat16",
                                  "max_num_seqs": 64, "max_waiting_requests": 1024, "max_kv_tokens": 131072,
                                  "max_prefill_tokens": 8192, "max_model_len": 4096})
    await engine.start()
    ready_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(1000, 40000) for _ in range(args.prompt)]  # noqa: E731
    results = {"build_model_s": build_s, "engine_ready_s": ready_s, "gpu": torch.cuda.get_device_name(0)}

    # single stream: decode step = (e2e - ttft) / (tokens - 1)
    singles = [await one(engine, f"s{i}", prompt(), args.output) for i in range(3)]
    steps = [(r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in singles]
    results["single"] = {"decode_step_ms": 1000 * statistics.median(steps), "ttft_ms": 1000 * singles[-1]["ttft_s"],
                         "tok_s": 1000 / (1000 * statistics.median(steps))}

    # 64 concurrent, arriving over 2 s (Poisson), 3 x 64 requests
    for conc in (32, 64):
        n = conc * 3
        arrivals, t = [], 0.0
        for _ in range(n):
            arrivals.append(t)
            t += rng.expovariate(conc / 2.0) if len(arrivals) < conc else 0.0
        sem = asyncio.Semaphore(conc)

        async def limited(i):
            async with sem:
                return await one(engine, f"c{conc}-{i}", prompt(), args.output)

        t0 = time.perf_counter()
        rs = await asyncio.gather(*[_delayed(limited, i, arrivals[i]) for i in range(n)])
        wall = time.perf_counter() - t0
        tok = sum(r["tokens"] for r in rs)
        results[f"concurrency_{conc}"] = {
            "requests": n, "output_tok_s": tok / wall,
            "ttft_p50_ms": 1000 * pct([r["ttft_s"] for r in rs], 50),
            "ttft_p95_ms": 1000 * pct([r["ttft_s"] for r in rs], 95),
            "forward_passes": engine.stats().forward_passes,
        }
    await engine.shutdown()
    return results


async def _delayed(fn, i, delay):
    await asyncio.sleep(delay)
    return await fn(i)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory (ids are drawn at random anyway)")
    p.add_argument("--work", default="/tmp/seekserve-bench")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    args = p.parse_args()
    res = asyncio.run(run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_engine.json").write_text(json.dumps(res, indent=2))
    floor_ms = 3.6
    s = res["single"]
    print(f"\nGPU: {res['gpu']}; model build {res['build_model_s']:.0f} s; engine load + warm-up {res['engine_ready_s']:.1f} s")
    print(f"{'measure':<34}{'value':>12}  target")
    print(f"{'single-stream decode step (ms)':<34}{s['decode_step_ms']:>12.2f}  <= {1.3 * floor_ms:.2f} (1.3 x 3.6 ms floor)")
    print(f"{'single-stream tok/s':<34}{s['tok_s']:>12.1f}")
    c64, c32 = res["concurrency_64"], res["concurrency_32"]
    print(f"{'output tok/s at 64 concurrent':<34}{c64['output_tok_s']:>12.0f}  >= 6000")
    print(f"{'TTFT p95 at 32 concurrent (ms)':<34}{c32['ttft_p95_ms']:>12.0f}  <= 200")
    print(f"{'TTFT p50 at 32 concurrent (ms)':<34}{c32['ttft_p50_ms']:>12.0f}")


if __name__ == "__main__":
    main()
