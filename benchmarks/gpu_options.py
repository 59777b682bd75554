"""Measure the maintained building blocks before building on them (issue #8):
transformers' continuous batching (paged KV) with and without its CUDA-graph
and async-batching options, and a CUDA-graph replay of one decode step on a
static KV cache (the floor a Python-driven engine can reach with HF modules).

    python benchmarks/gpu_options.py [--out DIR] [--only NAME,...]

Model: DeepSeek-R1-Distill-Qwen-7B's shape with random bf16 weights, built in
GPU memory (no files). Workload: N prompts of 512 random ids, 128 output
tokens, EOS disabled. Prints a table last and writes gpu_options.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import prompt_draw, random_qwen7b, time_replay_ms  # noqa: E402


def build_model():
    model = random_qwen7b(attn_implementation="sdpa")
    model.generation_config.eos_token_id = -1
    return model


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    draw, _ = prompt_draw(length, seed)
    return [draw() for _ in range(n)]


def cb_run(model, name: str, n: int, cb_kwargs: dict, prompt_len: int, out_len: int) -> dict:
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(**cb_kwargs)
    model.set_attn_implementation("sdpa")
    t0 = time.perf_counter()
    # warm-up pass (graph capture / compile happen here), not timed as throughput
    model.generate_batch(inputs=prompts(min(n, 4), prompt_len, 99), generation_config=gen,
                         continuous_batching_config=cbc, max_new_tokens=8)
    warm_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts(n, prompt_len), generation_config=gen,
                               continuous_batching_config=cbc, record_timestamps=True)
    wall = time.perf_counter() - t0
    toks = sum(len(o.generated_tokens) for o in out.values())
    ttft = sorted(o.timestamps[0] - o.created_time for o in out.values() if o.timestamps)
    steps = [(o.timestamps[-1] - o.timestamps[0]) / max(1, len(o.timestamps) - 1) for o in out.values()
             if o.timestamps and len(o.timestamps) > 1]
    return {"name": name, "requests": n, "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
            "warmup_s": warm_s, "ttft_p50_ms": 1000 * ttft[len(ttft) // 2] if ttft else None,
            "ttft_max_ms": 1000 * ttft[-1] if ttft else None,
            "step_ms_median": 1000 * statistics.median(steps) if steps else None}


def static_graph_step(model, batch: int, ctx: int) -> dict:
    """One decode step for `batch` rows at context `ctx` on transformers' StaticCache,
    captured in a CUDA graph and replayed: no Python in the loop."""
    import torch
    from transformers import StaticCache

    model.set_attn_implementation("sdpa")
    cache = StaticCache(config=model.config, max_cache_len=ctx + 64)
    ids = torch.randint(1000, 40000, (batch, ctx), device="cuda")
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(ctx, device="cuda"))
        tok = torch.randint(1000, 40000, (batch, 1), device="cuda")
        pos = torch.tensor([ctx], device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
            nxt = out.logits[:, -1].argmax(-1)
        graph_ms = time_replay_ms(graph, reps=50, warmup=5)
        # the same step eager, for the Python/launch overhead
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
        b.record()
        torch.cuda.synchronize()
        eager_ms = a.elapsed_time(b) / 10
    del cache, graph, nxt
    torch.cuda.empty_cache()
    return {"name": f"static+graph bs{batch}", "batch": batch, "graph_step_ms": graph_ms, "eager_step_ms": eager_ms,
            "tok_s": batch * 1000 / graph_ms}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    p.add_argument("--only", default="", help="comma-separated subset of run names")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--option-timeout-s", type=float, default=150)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    t0 = time.perf_counter()
    model = build_model() if args.child else None
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "build_s": time.perf_counter() - t0,
           "runs": []}
    import transformers

    res["transformers"] = transformers.__version__
    plan = [
        ("cb_default_64", lambda: cb_run(model, "cb defaults", 64, {}, args.prompt, args.output)),
        ("cb_graph_64", lambda: cb_run(model, "cb cuda_graph", 64, {"use_cuda_graph": True}, args.prompt,
                                       args.output)),
        ("cb_graph_async_64", lambda: cb_run(model, "cb cuda_graph+async", 64,
                                             {"use_cuda_graph": True, "use_async_batching": True}, args.prompt,
                                             args.output)),
        ("cb_graph_async_1", lambda: cb_run(model, "cb cuda_graph+async bs1", 1,
                                            {"use_cuda_graph": True, "use_async_batching": True}, args.prompt,
                                            args.output)),
        ("cb_graph_async_256", lambda: cb_run(model, "cb cuda_graph+async 256", 256,
                                              {"use_cuda_graph": True, "use_async_batching": True}, args.prompt,
                                              args.output)),
        ("static_bs1", lambda: static_graph_step(model, 1, args.prompt)),
        ("static_bs64", lambda: static_graph_step(model, 64, args.prompt)),
    ]
    only = [s for s in args.only.split(",") if s] or [k for k, _ in plan]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        fn = dict(plan)[only[0]]
        r = fn()
        print("RESULT " + json.dumps(r), flush=True)
        return
    import subprocess

    for key in only:
        # one process per option: a CUDA fault in one (device asserts are sticky) must not poison the rest
        t1 = time.perf_counter()
        log = out / "gpu_options.log"
        with log.open("a") as f:
            f.write(f"\n===== {key}\n")
            f.flush()
            try:
                proc = subprocess.run([sys.executable, __file__, "--child", "--only", key, "--prompt",
                                       str(args.prompt), "--output", str(args.output), "--out", str(out)],
                                      stdout=subprocess.PIPE, stderr=f, text=True, timeout=args.option_timeout_s)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                r = json.loads(lines[-1][7:]) if lines else {"name": key, "error": f"exit {proc.returncode}"}
            except subprocess.TimeoutExpired:
                r = {"name": key, "error": f"over {args.option_timeout_s} s"}
        r["key"], r["elapsed_s"] = key, time.perf_counter() - t1
        print(json.dumps(r), flush=True)
        res["runs"].append(r)
        (out / "gpu_options.json").write_text(json.dumps(res, indent=2))
    print(f"\nGPU {res['gpu']}, torch {res['torch']}, transformers {res['transformers']}; floor 3.6 ms/step")
    print(f"{'option':<28}{'tok/s':>9}{'step ms':>9}{'TTFT p50':>10}{'warm-up s':>10}")
    for r in res["runs"]:
        if "error" in r:
            print(f"{r['name']:<28} error: {r['error'][:60]}")
            continue
        step = r.get("graph_step_ms") or r.get("step_ms_median") or 0
        print(f"{r['name']:<28}{r['tok_s']:>9.0f}{step:>9.2f}{(r.get('ttft_p50_ms') or 0):>10.0f}"
              f"{r.get('warmup_s', 0):>10.1f}")


if __name__ == "__main__":
    main()
