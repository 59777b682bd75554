"""The hf engine alone on a GPU: 7B-class model (DeepSeek-R1-Distill-Qwen-7B's
shape: Qwen2, hidden 3584, 28 layers, 28 heads, 4 KV heads, ffn 18944, vocab
152064) with random bf16 weights and fixed lengths (512 prompt / 128 output
tokens, EOS ignored).

    python benchmarks/gpu_engine.py --tokenizer DIR [--engine-process inline|separate] [--out DIR]
    python benchmarks/gpu_engine.py --queue-report ENGINE_JSON...   # the engine's queue (and its first-use
                                                                    # prefill passes) of earlier raw files

Runs on the device machine (see docs/benchmarks.md for the exact call).
Measures: single-stream decode step, throughput at 64 concurrent requests
arriving over time, TTFT p50/p95 at 32 concurrent, warm-up time. Prints a
table last and writes gpu_engine.json.

``--engine-process separate`` drives the engine in a child process of its
own, as a GPU replica runs it (``engine.process``), with the same load from
this process: of what the stack adds to the first token, the share of the
hop between the two processes (gpu_engine_separate.json). With
--model/--device cpu it runs the same path on the CPU (a check of the script).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
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

from benchmarks.loadgen import percentile  # noqa: E402
from serve_app import gcpause  # noqa: E402
from serve_app.engines.launch_timing import pass_times_delta  # noqa: E402

QWEN7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
              intermediate_size=18944, vocab_size=152064, max_position_embeddings=4096, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False)


def engine_options(model_dir: Path, kv_cache: str = "auto") -> dict:
    """The engine configuration both GPU benchmarks use (engine alone and through Ray Serve)."""
    return {"model": str(model_dir), "device": "cuda", "dtype": "bfloat16", "max_num_seqs": 64,
            "max_waiting_requests": 1024, "max_kv_tokens": 131072, "max_prefill_tokens": 2048,
            "max_model_len": 2048, "kv_cache": kv_cache}


def random_qwen7b(**config):
    """The 7B-class model on the GPU with random bf16 weights (seed 0); ``config`` adds Qwen2Config fields."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**QWEN7B, **config}, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # random, not zeros: zeros run faster than real data
            p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def build_model_dir(path: Path, tokenizer_dir: Path, **config) -> float:
    """The random model (``config``: Qwen2Config fields over the 7B's) saved under ``path`` with the tokenizer;
    seconds it took, 0 if it was there already."""
    import torch

    t0 = time.perf_counter()
    if (path / "config.json").exists() and list(path.glob("*.safetensors")):
        return 0.0  # built earlier in this call
    model = random_qwen7b(**config)
    with torch.no_grad():
        # the stand-in tokenizer (SmolLM2's) knows fewer ids than Qwen's 152k: zero logits past it keep
        # greedy picks inside its vocabulary, so every token has text and streams (and TTFT) are real
        from tokenizers import Tokenizer

        known = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
        model.lm_head.weight[known:].zero_()
    save_with_tokenizer(model, path, tokenizer_dir)
    del model
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


def save_with_tokenizer(model, path: Path, tokenizer_dir: Path) -> None:
    """A model directory the engine loads: the weights, and the stand-in tokenizer's files beside them."""
    model.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, path / f.name)


def bench_options(work: Path, tokenizer: str | None, model: str | None = None, device: str = "cuda",
                  kv_cache: str = "auto", max_positions: int | None = None) -> tuple[dict, float | None]:
    """(engine options, seconds the model took to build) as both GPU benchmarks run: the random 7B, built
    under ``work`` on first use (None for a given ``model``, e.g. embedded:smollm2-135m-instruct with device
    cpu: the scripts' check on the CPU box). ``max_positions``: the model's max_position_embeddings instead of
    4,096 (DeepSeek-R1-Distill-Qwen-7B's is 131,072), for a max_model_len past 4,096."""
    if model is None:
        extra = {"max_position_embeddings": max_positions} if max_positions else {}
        model_dir = Path(work) / ("qwen2-7b-random" + (f"-pos{max_positions}" if max_positions else ""))
        return engine_options(model_dir, kv_cache), build_model_dir(model_dir, Path(tokenizer), **extra)
    opts = {**engine_options(Path("unused"), kv_cache), "model": model, "device": device, "dtype": "auto",
            "max_model_len": 1024}
    if device == "cpu":
        opts.pop("kv_cache")
    return opts, None


async def one(engine, rid, prompt, out_tokens, arrive_s=0.0, temperature=0.0):
    from serve_app.engines.base import GenerationRequest, SamplingParams

    await asyncio.sleep(arrive_s)
    t0 = time.perf_counter()
    first = first_text = queue = None
    n = 0
    async for c in engine.generate(GenerationRequest(rid, prompt, SamplingParams(max_tokens=out_tokens,
                                                                                 temperature=temperature,
                                                                                 ignore_eos=True))):
        if first is None:
            first = time.perf_counter() - t0
            queue = c.queue_time_s
        if first_text is None and c.text:
            first_text = time.perf_counter() - t0
        n += len(c.token_ids)
    # first_text is what an HTTP client sees first (a token that completes no character sends no chunk);
    # the stack benchmark compares against it
    return {"ttft_s": first, "ttft_text_s": first_text, "e2e_s": time.perf_counter() - t0, "tokens": n,
            "queue_s": queue}


async def run(args) -> dict:
    import torch

    from serve_app.engines.registry import create_engine

    options, build_s = bench_options(args.work, args.tokenizer, args.model, args.device, args.kv_cache,
                                     args.max_positions)
    options.update(dict(args.set))
    t0 = time.perf_counter()
    # the child (separate) compiles and captures before it reports ready, as in a replica
    engine = create_engine("hf", options, process=args.engine_process)
    await engine.start()
    ready_s = time.perf_counter() - t0
    # as Ray Serve does for every replica once its constructor returns (RAY_SERVE_FREEZE_GC_ON_STARTUP):
    # later full collections walk only what the load allocates, not the ~1.4M startup objects (~1 s)
    gc.collect()
    gc.freeze()
    gc_pauses = gcpause.pauses()
    prompt, rng = prompt_draw(args.prompt)
    results = {"build_model_s": build_s, "engine_ready_s": ready_s,
               "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
               "engine_process": args.engine_process, "kv_cache": args.kv_cache, "options": options,
               # the default moved with the load (docs/gpu_notes.md runs 43-44, 52): the raw file says what ran
               "prefill_wait_steps": engine.options.max_prefill_wait_steps}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():  # after every phase: a run cut short by a time limit still leaves what it measured
        # a variant (another kv_cache, --set) gets its own file: gpu_stack.py compares with gpu_engine.json
        tag = "".join(f"_{x}" for x in ([args.kv_cache] if args.kv_cache != "auto" else []) + [k for k, _ in args.set]
                      + ([args.engine_process] if args.engine_process != "inline" else []))
        (out_dir / f"gpu_engine{tag}.json").write_text(
            json.dumps(results, indent=2))

    slots = getattr(engine, "_slots", None)  # None in a child process: its graphs are measured inline only
    warm = engine.warm_up or {}
    # what the weights take on the GPU, and the load's peak before the KV cache
    results.update(**{k: warm.get(k) for k in ("weights_gb", "load_peak_gb", "kv_cache_gb") if k in warm})
    if slots is None and warm:
        results.update(**{k: warm.get(k) for k in ("prefill_graphs", "mixed_graphs", "mixed_compile_s",
                                                   "compile_cache")})
    if slots is not None:
        # the one-prompt prefill graphs as the replica reports them (its warm_up)
        w = engine.warm_up
        results.update(graphs=len(slots.graphs), graph_capture_s=slots.capture_s, compile_s=slots.compile_s,
                       prefill_compile_s=slots.prefill_compile_s, prefill_compile_error=slots.prefill_compile_error,
                       kv_cache_gb=slots.cache.bytes / 1e9,
                       **{k: w[k] for k in ("prefill_graphs", "prefill_graph_capture_s", "prefill_graph_gb",
                                            "prefill_graph_error", "mixed_graphs", "mixed_compile_s",
                                            "mixed_compile_error", "mixed_graph_capture_s", "mixed_graph_gb",
                                            "mixed_graph_error", "compile_cache")})
    save()

    # single stream: decode step = (e2e - ttft) / (tokens - 1)
    singles = [await one(engine, f"s{i}", prompt(), args.output) for i in range(3)]
    steps = [(r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in singles]
    results["single"] = {"decode_step_ms": 1000 * statistics.median(steps),
                         "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in singles),
                         "ttft_text_ms": 1000 * statistics.median(r["ttft_text_s"] or float("nan") for r in singles),
                         "tok_s": 1000 / (1000 * statistics.median(steps))}
    # sampled (temperature 1, OpenAI's default): the Gumbel draw runs after the graph, still on the GPU
    sampled = [await one(engine, f"t{i}", prompt(), args.output, temperature=1.0) for i in range(3)]
    results["single"]["sampled_decode_step_ms"] = 1000 * statistics.median(
        (r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in sampled)
    save()

    async def load(key, conc, rid, rounds=3, draw=prompt, draw_rng=rng):
        before = engine.stats()
        results[key] = await concurrent_load(lambda i, p: one(engine, f"{rid}-{i}", p, args.output), conc, draw,
                                             draw_rng, rounds, think_ms=args.think_ms)
        if args.engine_process == "separate":
            await asyncio.sleep(0.2)  # the child's counters come with its outputs, at most 50 ms apart
        after = engine.stats()
        # prefill_graph_passes: one-prompt passes replayed; prefill_eager_passes: shapes not compiled;
        # mixed_passes: one prompt and a decode step in one captured pass
        # gpu_gap*: the GPU between consecutive passes (what a launch lead too short, or a host wait, costs)
        for counter in ENGINE_COUNTERS:
            results[key][counter] = getattr(after, counter) - getattr(before, counter)
        # the GPU time of the load's passes by kind, from the engine's own events (any engine process)
        results[key]["gpu_pass"] = pass_times_delta(before.gpu_pass_ms, after.gpu_pass_ms)
        results[key]["gc"] = gc_pauses.snapshot()  # the process's collections so far
        save()

    if args.warm_rounds:
        draw, draw_rng = prompt_draw(args.prompt, WARM_PROMPT_SEED)
        await load("warm_load", 64, "w", args.warm_rounds, draw=draw, draw_rng=draw_rng)
    for conc in (32, 64):
        await load(f"concurrency_{conc}", conc, f"c{conc}")
    if args.steady_rounds:
        await load("concurrency_64_steady", 64, "st", args.steady_rounds)
    if slots is not None and not args.skip_probes:
        results["prefill_pass_ms"] = prefill_pass_ms(slots, args.prompt)
        save()
    # the same loads under other options, changed on the live engine (no second compile): an engine
    # option, or with "slots." one of the decoder's switches (e.g. slots.prefill_compiled=false)
    def apply(change: dict, targets: dict) -> None:
        # engine options validated and set by the engine (in a separate process, the child's copy too); the
        # decoder's switches, inline only (main refuses slots. keys with a separate process), set directly
        options = {key: value for key, value in change.items() if not key.startswith("slots.")}
        if options:
            engine.update_options(options)
        for key, value in change.items():
            if key.startswith("slots."):
                setattr(*targets[key], value)

    for k, change in enumerate(args.compare):
        targets = {key: (slots, key[6:]) if key.startswith("slots.") else (engine.options, key) for key in change}
        base = {key: getattr(obj, name) for key, (obj, name) in targets.items()}
        t_switch = time.perf_counter()
        apply(change, targets)
        # e.g. slots.span_step captures the graphs its buckets lack: what that costs on a live engine
        results.setdefault("compare_switch_s", {})[compare_tag(change)] = round(time.perf_counter() - t_switch, 2)
        for conc in (32, 64):
            await load(f"concurrency_{conc}_{compare_tag(change)}", conc, f"p{k}-{conc}")
        if args.steady_rounds:
            await load(f"concurrency_64_steady_{compare_tag(change)}", 64, f"ps{k}", args.steady_rounds)
        apply(base, targets)
    if slots is not None and slots.use_graphs and not args.skip_probes:
        results["graph_replay_ms"] = graph_replay_ms(slots)
        results["graph_replay_ms_by_span"] = graph_replay_ms_by_span(slots)
        results["graphs_at_end"] = len(slots.graphs)
        results["mixed_replay_ms"] = mixed_replay_ms(slots, args.prompt)
        save()
    await engine.shutdown()
    return results


def prefill_pass_ms(slots, prompt_len: int, reps: int = 5) -> dict:
    """Wall time of one prefill pass of 1, 4 and 16 prompts (the engine idle), compiled and eager, with
    the TFLOP/s of its GEMM work (lm_head for the last positions only); one prompt also as the captured
    graph the engine replays for it."""
    import torch

    model = slots.model
    params = (sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
              - slots.lm_head.weight.numel())
    was = slots.prefill_compiled, slots.prefill_graphs
    rows = {}
    with torch.inference_mode():
        for mode in ((["graph"] if slots.prefill_graph_lengths else []) + (["compiled"] if slots.has_compiled_prefill
                                                                           else []) + ["eager"]):
            slots.prefill_graphs = mode == "graph"
            slots.prefill_compiled = mode == "compiled"
            for n in (1,) if mode == "graph" else (1, 4, 16):
                prompts = [[1000 + i] * prompt_len for i in range(n)]
                slots.prefill(prompts, list(range(n)), 0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(reps):
                    slots.prefill(prompts, list(range(n)), 0)
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) / reps * 1000
                rows[f"{mode}_{n}"] = {"ms": round(ms, 2), "gemm_tflop_s": round(2 * params * prompt_len * n / ms / 1e9)}
    slots.prefill_compiled, slots.prefill_graphs = was
    return rows


def graph_replay_ms(slots, reps: int = 30) -> dict:
    """GPU time of one captured decode step alone (no host loop), per batch size, at span 768
    (512 prompt + 128 output rounded up), to split a step's time between GPU and host."""
    span = next(s for s in slots.spans if s >= 640)
    from serve_app.engines.slot_kv import bucket

    # a compiled step has no batch-1 graph (one compile serves batches >= 2): batch 1 replays batch 2's
    return {str(rows): time_replay_ms(slots.graphs[(bucket(rows, slots.batch_sizes), span)][0], reps, warmup=1)
            for rows in (1, 8, 32, 64)}


def graph_replay_ms_by_span(slots, reps: int = 30) -> dict:
    """The same at batch 1 and 64 for every captured span from 512 to 1024 (a compare of span steps
    leaves more of them captured): how a step's time follows the keys and values it reads."""
    from serve_app.engines.slot_kv import bucket

    out = {}
    for rows in (1, 64):
        batch = bucket(rows, slots.batch_sizes)
        out[str(rows)] = {str(span): round(time_replay_ms(graph, reps, warmup=1), 3)
                          for (b, span), (graph, _) in sorted(slots.graphs.items())
                          if b == batch and 512 <= span <= 1024}
    return out


def mixed_replay_ms(slots, prompt_len: int, reps: int = 20) -> dict:
    """GPU time of one captured mixed pass (a prompt of ``prompt_len`` tokens and a decode step of 16, 32 or 64
    rows, span 768), beside what it replaces: the prompt's one-prompt prefill graph plus a decode step's. The
    engine is idle: every row is free, so the rows' work is the same and nothing is written that a
    sequence owns."""
    from serve_app.engines.slot_kv import bucket, prefill_graph_padding

    span = next(s for s in slots.spans if s >= 640)
    length = prefill_graph_padding(prompt_len)
    out = {}

    def stage(chunk: int) -> None:
        # the staged inputs are the last served pass's: a whole prompt's last position (511) read by a
        # 64-token graph is a device assert (run 70). Staged as at capture instead: slot 0 (free, the engine
        # idle), from position 0, this graph's length. In inference mode, as the engine stages: the staging
        # buffers were made in it, and an in-place write to them outside it raises (run 73)
        import torch

        with torch.inference_mode():
            slots._stage_prompt([0] * chunk, 0, 0, chunk)

    for rows in (16, 32, 64):
        graph = slots._mixed_runs.get((length, bucket(rows, slots.mixed_rows), span, False))
        if graph is not None:
            stage(length)
            out[f"mixed_{rows}"] = round(time_replay_ms(graph, reps, warmup=2), 3)
    # each captured length with 64 rows, from a prompt's first position (chunk_) and as a later chunk (resume_;
    # mixed_chunk_tokens): what a pass costs against its M rows. Until 2026-12-04's run 69 chunk_ was the later
    # chunks' form (every mixed pass attended over its slot then)
    rows64 = bucket(64, slots.mixed_rows)
    for chunk, resumes in sorted({(k[0], k[3]) for k in slots._mixed_runs}):
        graph = slots._mixed_runs.get((chunk, rows64, span, resumes))
        if graph is not None and (resumes or chunk != length):
            stage(chunk)
            out[f"{'resume' if resumes else 'chunk'}_{chunk}_64"] = round(time_replay_ms(graph, reps, warmup=2), 3)
    if os.environ.get("SEEKSERVE_PROFILE_MIXED"):
        profile_replays({f"{'resume' if r else 'chunk'}_{c}_64": slots._mixed_runs.get((c, rows64, span, r))
                         for c in (256, 448, 512) for r in (False, True)}
                        | {"decode_64": slots.graphs[(bucket(64, slots.batch_sizes), span)][0]},
                        prepare=lambda name: stage(int(name.split("_")[1])) if name != "decode_64" else None)
    prefill = slots._prefill_runs.get(length)
    if prefill is not None and prefill[0] is not None:
        out["prefill_one_prompt"] = round(time_replay_ms(prefill[0], reps, warmup=2), 3)
    for rows in (16, 32, 64):
        out[f"decode_{rows}"] = round(time_replay_ms(slots.graphs[(bucket(rows, slots.batch_sizes), span)][0], reps,
                                                     warmup=1), 3)
    return out


def profile_replays(graphs: dict, reps: int = 5, prepare=None) -> None:
    """Prints each graph's kernels by GPU time (torch.profiler over ``reps`` replays): where a pass's time
    goes beyond its GEMMs. ``prepare(name)`` stages a graph's inputs before its replays."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for name, graph in graphs.items():
        if graph is None:
            continue
        if prepare is not None:
            prepare(name)
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                graph.replay()
            torch.cuda.synchronize()
        print(f"--- {name}: kernels by GPU time over {reps} replays")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=90))


def time_replay_ms(graph, reps: int, warmup: int) -> float:
    """Mean GPU time of one replay of a captured CUDA graph (CUDA events, after warm-up replays)."""
    import torch

    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


#: the first wave's span: its last request arrives this long after the first
FIRST_WAVE_SPAN_S = 2.0


def first_wave_arrivals(conc: int, span_s: float = FIRST_WAVE_SPAN_S, seed: int = 0) -> list[float]:
    """Arrival times (s) of the first `conc` requests: Poisson gaps, scaled so that the last arrives at
    `span_s`. Drawn from an RNG of their own: until 2026-12-03 they came from the prompts' RNG, so
    gpu_stack.py (one prompt fewer drawn before its loads) met another schedule than gpu_engine.py,
    its first wave ending 1.1 s (32) and 0.7 s (64) later, which alone cost it ~18 % / ~8 % of the
    engine's tok/s in the model of the loop (docs/gpu_notes.md run 40)."""
    rng = random.Random(f"first-wave-{conc}-{seed}")
    gaps = [rng.expovariate(1.0) for _ in range(conc - 1)]
    total = sum(gaps) or 1.0
    out, t = [0.0], 0.0
    for g in gaps:
        t += g * span_s / total
        out.append(t)
    return out


# the discarded warm-up load's prompts (--warm-rounds), drawn from an RNG of their own so that the measured
# loads (seed 0) draw the ids they drew before it existed. Why the load: in runs 68, 70 and 71 the arm measured
# first after the start was the slower by 1-3 %, as much as the options compared differ
WARM_PROMPT_SEED = 1


def prompt_draw(prompt_len: int, seed: int = 0):
    """(draw, rng): ``draw()`` returns a prompt of ``prompt_len`` random ids from ``rng`` = Random(seed). Both
    GPU benchmarks, gpu_options.py and the loop model's old waves draw their prompts so."""
    rng = random.Random(seed)
    return (lambda: [rng.randrange(1000, 40000) for _ in range(prompt_len)]), rng


def think_line(res: dict) -> str:
    """A line saying the loads paused between requests (--think-ms), or '' for the closed loop."""
    think = {v.get("think_ms") for v in res.values() if isinstance(v, dict) and v.get("think_ms")}
    if not think:
        return ""
    return (f"streams pause {', '.join(f'{t:g}' for t in sorted(think))} ms on average before each request "
            "after their first (--think-ms): not the targets' closed loop")


def think_times(conc: int, rounds: int, mean_ms: float) -> list[list[float]]:
    """Per stream, the pause (s) before each of its requests after the first: exponential with mean
    ``mean_ms`` (none at 0), from an RNG of each stream's own, so both benchmarks pause alike.

    Why: in a closed loop with no pause a stream's next request leaves the moment its last token
    arrives, so in the engine's own process it reaches the engine in step with the passes (a third
    admitted within 2 ms at 64 x 10, run 79) and the engine alone is measured at its luckiest; through
    a process or HTTP it misses that boundary and waits a pass. Clients that pause, as people and
    most programs do, arrive at no particular point of a pass in either case; the stack's added first
    token is then its path alone (the loop model: 20 ms pauses add ~6 ms to the engine's own TTFT p50 at
    64 x 10 and leave ~3 ms of the stack's way back to the loop, docs/gpu_notes.md run 94)."""
    if mean_ms <= 0:
        return [[0.0] * max(0, rounds - 1) for _ in range(conc)]
    out = []
    for i in range(conc):
        r = random.Random(f"think-{conc}-{i}")
        out.append([r.expovariate(1000.0 / mean_ms) for _ in range(rounds - 1)])
    return out


async def concurrent_load(send, conc: int, prompt, rng, rounds: int = 3, think_ms: float = 0.0) -> dict:
    """`conc` streams, each a closed loop of `rounds` requests: stream i's first request arrives at
    :func:`first_wave_arrivals`'s i-th time (Poisson gaps over 2 s, the same schedule in every
    benchmark), each next one as soon as its previous one has ended. `send(k, prompt_ids)` returns
    {ttft_s, e2e_s, tokens}; `prompt()` draws from `rng`.

    Until 2026-12-03 (after run 43) the requests after the first wave waited at a semaphore until the
    wave's last arrival, so every stream whose first request ended before 2 s sent its next one at
    2.00 s: 20 streams' next prompts at once at 32 streams, 33 at 64 (in the model), which alone put its TTFT p95 at
    183 / 282 ms (docs/gpu_notes.md, "The TTFT tail at 32").

    With 3 rounds the run is short (~6 s at 64) and the 2 s of arrivals plus the last stream's
    three requests in a row bound it; more rounds measure closer to the steady state."""
    first = first_wave_arrivals(conc)
    pauses = think_times(conc, rounds, think_ms)
    n = conc * rounds
    # request k = round * conc + stream: the prompts come in the order the old schedule drew them
    prompts = [prompt() for _ in range(n)]

    async def stream(i: int) -> list[dict]:
        await asyncio.sleep(first[i])
        out = []
        for r in range(rounds):
            if r and pauses[i][r - 1]:
                await asyncio.sleep(pauses[i][r - 1])
            k = r * conc + i
            start = time.perf_counter() - t0
            out.append({**await send(k, prompts[k]), "start_s": start, "stream": i, "round": r})
        return out

    t0 = time.perf_counter()
    rs = [r for rs_ in await asyncio.gather(*[stream(i) for i in range(conc)]) for r in rs_]
    wall = time.perf_counter() - t0
    ok = [r for r in rs if r.get("ttft_s") is not None]
    texts = [r["ttft_text_s"] for r in ok if r.get("ttft_text_s") is not None]
    return {
        "requests": n, "failed": n - len(ok), "output_tok_s": sum(r["tokens"] for r in ok) / wall,
        "wall_s": round(wall, 3),
        # every request asks for the same fixed length: another count is a token lost or doubled
        "token_counts": {str(k): v for k, v in sorted(collections.Counter(r["tokens"] for r in ok).items())},
        "first_wave_last_arrival_s": round(first[-1], 3),
        "think_ms": think_ms,
        "full_window": full_window(ok, conc) if len(ok) == n else None,
        "ttft_p50_ms": 1000 * percentile([r["ttft_s"] for r in ok], 50),
        "ttft_p95_ms": 1000 * percentile([r["ttft_s"] for r in ok], 95),
        # to the first token with text (the engine alone), as a streaming HTTP client sees it
        "ttft_text_p50_ms": 1000 * percentile(texts, 50),
        "ttft_text_p95_ms": 1000 * percentile(texts, 95),
        # [start s, TTFT ms, of it in the engine's queue ms, the HTTP client's request written ms, its response
        # headers after that ms (each None where the sender does not know it)], in start order: the TTFT
        # tail's requests, when they came and whether they waited (and where) or computed
        "per_request": [[round(r["start_s"], 4), round(1000 * r["ttft_s"], 2)]
                        + [None if r.get(f) is None else round(1000 * r[f], 2) for f in ("queue_s", "sent_s", "headers_s")]
                        for r in sorted(ok, key=lambda r: r["start_s"])],
        "engine_queue": queue_summary([r["queue_s"] for r in ok if r.get("queue_s") is not None]),
        "client_legs": client_legs_summary(ok),
    }


def client_legs_summary(records: list[dict]) -> dict | None:
    """An HTTP client's two legs before a response's first byte (gpu_stack.client_legs), p50 / p99 / max ms,
    and the connections it opened: a first token that waited in the client (a pooled connection, a connect)
    shows in ``sent``, one that waited in the proxy or the server before the handler's first send in
    ``headers``. None for a sender that has no such legs (the engine alone)."""
    timed = [r for r in records if r.get("sent_s") is not None and r.get("headers_s") is not None]
    if not timed:
        return None
    out = {"new_connections": sum(1 for r in records if r.get("new_connection"))}
    for leg in ("sent", "headers"):
        ms = [1000 * r[f"{leg}_s"] for r in timed]
        out.update({f"{leg}_p50_ms": round(percentile(ms, 50), 3), f"{leg}_p99_ms": round(percentile(ms, 99), 3),
                    f"{leg}_max_ms": round(max(ms), 3)})
    return out


def queue_summary(queue_s: list[float]) -> dict | None:
    """The engine's queue time (arrival in the engine to the pass that admits it): p50 / p95, and the share
    admitted within 2 ms, i.e. that reached the engine before the pass boundary it met. A next request sent
    from the engine's own process reaches it in step with the passes (a third of them within 2 ms at
    64 x 10); one that crosses a process or HTTP first misses the boundary and waits a pass
    (docs/gpu_notes.md run 79)."""
    if not queue_s:
        return None
    ms = [1000 * q for q in queue_s]
    return {"p50_ms": round(percentile(ms, 50), 2), "p95_ms": round(percentile(ms, 95), 2),
            "under_2ms_share": round(sum(1 for q in ms if q < 2.0) / len(ms), 3)}


def print_queue_report(files: list[str]) -> None:
    """Each raw file's loads (those under --compare changes too): TTFT p50, the engine's queue
    (:func:`queue_summary`) and the median of the rest of the first token after admission, from the
    per-request records (also of files written before the run recorded its queue summary); then the
    warm-up load's multi-prompt prefill passes against the same kinds later (:func:`first_use_line`)."""
    print(f"{'file / load':<50}{'TTFT p50':>9}{'queue p50':>10}{'p95':>7}{'<2 ms':>7}{'after p50':>10}  (ms)")
    for f in files:
        res = json.loads(Path(f).read_text())
        print(f"{Path(f).name} (engine {res.get('engine_process', 'inline')})")
        # the default loads, then those under each --compare change (their keys end in its tag)
        for key in [k for k in res if k.startswith("concurrency_") and isinstance(res[k], dict)]:
            rows = [r for r in res[key].get("per_request", []) if r[2] is not None]
            if not rows:
                continue
            q = queue_summary([r[2] / 1000 for r in rows])
            print(f"{'  ' + key:<50}{percentile([r[1] for r in rows], 50):>9.1f}{q['p50_ms']:>10.1f}{q['p95_ms']:>7.1f}"
                  f"{100 * q['under_2ms_share']:>6.0f}%{percentile([r[1] - r[2] for r in rows], 50):>10.1f}")
        first_use = first_use_line(res)
        if first_use:
            print(f"  multi-prompt prefill, warm-up load / later, ms: {first_use}")


def full_window(rs: list[dict], conc: int) -> dict | None:
    """Output tok/s while all `conc` streams were in flight: from the first token of the last stream's
    first request to the end of the first stream that had nothing more to send. The run's own tok/s
    also counts the 2 s of arrivals and the tail where streams run out; this is the figure closer to
    a long run's. Tokens of a request are spread evenly between its first token and its end (an
    estimate: the requests report no per-token times). Results without "stream" (the model's) take
    the first `conc` starts as the first wave and the conc-th last end as the first stream's end."""
    if rs and "stream" in rs[0]:
        t_a = max(r["start_s"] + r["ttft_s"] for r in rs if r["round"] == 0)
        last = {}
        for r in rs:
            end = r["start_s"] + r["e2e_s"]
            last[r["stream"]] = max(last.get(r["stream"], 0.0), end)
        t_b = min(last.values())
    else:
        first_wave = sorted(rs, key=lambda r: r["start_s"])[:conc]
        t_a = max(r["start_s"] + r["ttft_s"] for r in first_wave)
        ends = sorted(r["start_s"] + r["e2e_s"] for r in rs)
        t_b = ends[len(rs) - conc]
    if t_b <= t_a:
        return None
    tokens = 0.0
    for r in rs:
        first, end = r["start_s"] + r["ttft_s"], r["start_s"] + r["e2e_s"]
        if end <= first:
            tokens += r["tokens"] if t_a <= end <= t_b else 0
            continue
        overlap = max(0.0, min(end, t_b) - max(first, t_a))
        tokens += r["tokens"] * overlap / (end - first)
    return {"start_s": round(t_a, 3), "end_s": round(t_b, 3), "output_tok_s": tokens / (t_b - t_a)}


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{key}: {value!r} is not JSON") from e


#: the engine's counters each load records as their change over it (gpu_engine.py and gpu_stack.py)
ENGINE_COUNTERS = ("forward_passes", "prefill_passes", "prefill_eager_passes", "prefill_graph_passes", "mixed_passes",
                   "gpu_gaps_measured", "gpu_gap_total_ms", "gpu_gaps_late")


def gap_line(r: dict) -> str | None:
    """One load's GPU time between passes, for the tables; None where the run did not measure it
    (files before 2026-12-04's nineteenth session, the CPU)."""
    if not r.get("gpu_gaps_measured"):
        return None
    return (f"{r['gpu_gap_total_ms']:.1f} ms over {r['gpu_gaps_measured']} gaps "
            f"({r['gpu_gap_total_ms'] / r['gpu_gaps_measured'] * 1000:.0f} us each), {r['gpu_gaps_late']} over 0.1 ms")


def pass_line(r: dict, top: int = 4) -> str | None:
    """One load's passes that took the most GPU time, by kind (the engine's ``gpu_pass_ms``): mean ms and
    count; None where the run did not time them (files before 2026-12-05's twenty-seventh session, the
    CPU)."""
    passes = r.get("gpu_pass")
    if not passes:
        return None
    heavy = sorted(passes.items(), key=lambda kv: -kv[1]["total_ms"])[:top]
    return ", ".join(f"{label} {v['mean_ms']:.2f} ms x {v['passes']}" for label, v in heavy)


def first_use_line(res: dict) -> str | None:
    """A run's multi-prompt prefill passes in its warm-up load against the same kinds in its sustained load (its
    64-concurrent one where it has none): mean ms there and later, the count, and what the warm-up's passes
    cost over the later mean in all. These passes are the compiled pass with dynamic shapes, not a captured
    graph, and every run since the per-pass sums paid +31 to +78 ms per prompt count in its warm-up load
    (docs/gpu_notes.md, run 140), which a replica's first real burst pays if its warm-up did not; the
    one-prompt and mixed passes are graphs and pay nothing.
    None where either load has no per-pass times or they share no such kind."""
    later = res.get("concurrency_64_steady") or res.get("concurrency_64") or {}
    a, b = (res.get("warm_load") or {}).get("gpu_pass") or {}, later.get("gpu_pass") or {}
    kinds = sorted((k for k in a if k in b and k.startswith("prefill_") and k != "prefill_1p"),
                   key=lambda k: int(k[len("prefill_"):-1]))
    if not kinds:
        return None
    return ", ".join(f"{k[len('prefill_'):]} {a[k]['mean_ms']:.1f} / {b[k]['mean_ms']:.1f} x {a[k]['passes']} "
                     f"({a[k]['passes'] * (a[k]['mean_ms'] - b[k]['mean_ms']):+.0f})" for k in kinds)


def gpu_budget_line(r: dict) -> str | None:
    """Where one load's GPU time went: the passes' time by family (decode steps, mixed passes, prefill passes
    the host waited for), the time between consecutive passes, and the rest of the load's wall time (the GPU
    with no pass to run: the first arrivals, the last streams' tail, host waits the gaps do not count). None
    where the run did not time its passes."""
    passes = r.get("gpu_pass")
    if not passes or not r.get("wall_s"):
        return None
    families: dict[str, list[float]] = {}
    for label, v in passes.items():
        fam = families.setdefault(label.split("_")[0], [0, 0.0])
        fam[0] += v["passes"]
        fam[1] += v["total_ms"] / 1000
    gaps_s = r.get("gpu_gap_total_ms", 0.0) / 1000
    rest_s = r["wall_s"] - sum(f[1] for f in families.values()) - gaps_s
    parts = [f"{name} {t:.2f} s / {int(n)}" for name, (n, t) in sorted(families.items(), key=lambda kv: -kv[1][1])]
    # the passes are the engine's counters between two reads and the wall time is the client's clock, so a load
    # that keeps the GPU busy end to end can sum a few ms over its wall time (-0.03 s of 5.13 through the stack,
    # machine AN): said as such rather than as a negative idle time
    rest = (f"the rest {rest_s:.2f} s" if rest_s >= 0 else
            f"no rest: the passes and gaps sum {-rest_s:.2f} s over the client's wall time")
    return f"{', '.join(parts)}; between passes {gaps_s:.2f} s; {rest} of {r['wall_s']:.2f} s"


def compare_tag(change: dict) -> str:
    return ",".join(f"{k}={json.dumps(v)}" for k, v in change.items())


def _options(text: str) -> dict:
    return dict(_option(part) for part in text.split(","))


def live_compare(backend: str = "hf"):
    """The parser of --compare's change (gpu_engine.py, gpu_stack.py, burst_path.py): made on the running
    engine, so only options ``backend`` reads while running (or the inline decoder's slots. switches); one
    read at start would leave both arms the same engine under two names, as a compare of prompt_attention did
    (docs/gpu_notes.md run 148)."""
    from serve_app.engines.options import live_options
    from serve_app.engines.registry import options_model_for

    live = live_options(options_model_for(backend))

    def parse(text: str) -> dict:
        change = _options(text)
        fixed = sorted(k for k in change if not k.startswith("slots.") and k not in live)
        if fixed:
            raise argparse.ArgumentTypeError(
                f"{fixed} are read when the engine starts, so a running one cannot change them: compare them in "
                f"two runs (--set); options it reads while running: {', '.join(sorted(live))}")
        return change

    return parse


# 2026-12-02 on the H200: prefill passes of 2048 and 8192 tokens gave the same throughput and 2048 the
# lower TTFT tail, so 2048 is the main setting. Holding prompts 8 passes against not holding (the default):
# alone, where prompts arrive in step, holding gains 4-9 %; through the stack it has not paid at sustained
# load (docs/gpu_notes.md runs 43-52), so the comparison stays in every run
DEFAULT_COMPARE = [{"max_prefill_wait_steps": 8}]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", help="a tokenizer directory (ids are drawn at random anyway; required to run)")
    p.add_argument("--work", default="/tmp/seekserve-bench")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--kv-cache", default="auto", choices=["auto", "static", "dynamic"])
    p.add_argument("--engine-process", default="inline", choices=["inline", "separate"],
                   help="'separate': the engine in a child process, as a GPU replica runs it (--compare of "
                        "engine options only: the decoder's slots. switches live in the child)")
    p.add_argument("--model", default=None, help="a model instead of the random 7B (the script's check on the CPU)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--max-positions", type=int, default=None,
                   help="the random 7B's max_position_embeddings (default 4,096), e.g. 131072 with --set "
                        "max_model_len=8192 for configs/gpu-7b.yaml's spans")
    p.add_argument("--compare", action="append", type=live_compare(), metavar="KEY=JSON[,KEY=JSON]",
                   help="scheduling options for another pair of concurrent runs on the same engine "
                        f"(repeatable); default: {', '.join(compare_tag(c) for c in DEFAULT_COMPARE)} inline, "
                        "none in a separate process")
    p.add_argument("--set", action="append", default=[], type=_option, metavar="KEY=JSON",
                   help="an engine option over the benchmark's own, e.g. --set cuda_graph_span_step=128")
    p.add_argument("--steady-rounds", type=int, default=10,
                   help="requests per stream of a longer 64-concurrent load (0: none), closer to the steady state")
    p.add_argument("--warm-rounds", type=int, default=1,
                   help="requests per stream of a 64-concurrent load run and discarded before the measured ones "
                        "(0: none, as every run before 2026-12-04's fourteenth session)")
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="each stream pauses this long on average (exponential) before each request after its "
                        "first: arrivals out of step with the engine's passes (0: the closed loop of every run "
                        "before the twentieth session, the targets' load)")
    p.add_argument("--skip-probes", action="store_true",
                   help="no pass and graph-replay probes after the loads (inline: they take ~30 s)")
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    p.add_argument("--queue-report", nargs="+", metavar="ENGINE_JSON",
                   help="run nothing: print the engine's queue per load from these raw files' per-request records, "
                        "and the warm-up load's multi-prompt prefill passes against the later ones")
    args = p.parse_args()
    if args.queue_report:
        print_queue_report(args.queue_report)
        return
    # gpu_stack.py's cache (same --work): its deploy right after this run, on the same machine, then
    # loads the compiled passes instead of compiling them again (~100 s of its warm-up)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.work) / "inductor"))
    if args.engine_process == "separate" and any(k.startswith("slots.") for c in args.compare or [] for k in c):
        p.error("--compare with slots.: the decoder's switches live in the separate process, out of reach")
    if args.model is None and args.device == "cpu":
        p.error("--device cpu needs --model (the random 7B is built on the GPU)")
    if args.tokenizer is None and args.model is None:
        p.error("--tokenizer is required to build the random 7B")
    if args.compare is None:
        args.compare = DEFAULT_COMPARE if args.engine_process == "inline" else []
    res = asyncio.run(run(args))
    floor_ms = 3.6
    s = res["single"]
    def n(key: str):  # a warm-up figure, 0 where this run has none (a child process, the CPU, no mixed passes)
        return res.get(key) or 0

    print(f"\nGPU: {res['gpu']}; engine {args.engine_process}; kv_cache {args.kv_cache}; prefill hold "
          f"{res['prefill_wait_steps']} passes; model build {n('build_model_s'):.0f} s; "
          f"engine load + warm-up {res['engine_ready_s']:.1f} s (graphs: {n('graphs')} in "
          f"{n('graph_capture_s'):.1f} s, of which compile {n('compile_s'):.1f} s "
          f"+ prefill {n('prefill_compile_s'):.1f} s; {n('prefill_graphs')} one-prompt prefill "
          f"graphs in {n('prefill_graph_capture_s'):.1f} s, {n('prefill_graph_gb'):.2f} GB; "
          f"mixed: compile {n('mixed_compile_s'):.1f} s, {n('mixed_graphs')} graphs in "
          f"{n('mixed_graph_capture_s'):.1f} s, {n('mixed_graph_gb'):.2f} GB; "
          f"KV {n('kv_cache_gb'):.1f} GB; weights {n('weights_gb'):.2f} GB, load peak {n('load_peak_gb'):.2f} GB)")
    think = think_line(res)
    if think:
        print(think)
    for key in ("mixed_compile_error", "mixed_graph_error"):
        if res.get(key):
            print(f"{key}: {res[key]}")
    if res.get("compile_cache"):  # whether the start's compiles found torch.compile's disk caches warm
        print(f"compile caches at ready: {res['compile_cache']}")
    print(f"{'measure':<34}{'value':>12}  target")
    print(f"{'single-stream decode step (ms)':<34}{s['decode_step_ms']:>12.2f}  <= {1.3 * floor_ms:.2f} (1.3 x 3.6 ms floor)")
    print(f"{'single-stream tok/s':<34}{s['tok_s']:>12.1f}")
    print(f"{'  step with temperature 1 (ms)':<34}{s['sampled_decode_step_ms']:>12.2f}")
    c64, c32 = res["concurrency_64"], res["concurrency_32"]
    print(f"{'output tok/s at 64 concurrent':<34}{c64['output_tok_s']:>12.0f}  >= 6000")

    def print_queue(label: str, r: dict) -> None:
        q = r.get("engine_queue")
        if q:
            print(f"{label:<34}{q['p50_ms']:>12.1f}{q['p95_ms']:>8.1f}"
                  f"  ({100 * q['under_2ms_share']:.0f} % admitted within 2 ms)")

    def print_gaps(label: str, r: dict) -> None:
        if gap_line(r):
            print(f"{label:<34}  {gap_line(r)}")
        if pass_line(r):
            print(f"{'  GPU per pass, the heaviest kinds':<34}  {pass_line(r)}")
            print(f"{'  GPU time by pass family':<34}  {gpu_budget_line(r)}")

    def print_steady(label: str, r: dict) -> None:
        print(f"{label:<34}{r['output_tok_s']:>12.0f}  ({r['forward_passes']} passes, {r['prefill_passes']} prefill, "
              f"{r.get('prefill_graph_passes', 0)} of them replayed, {r.get('mixed_passes', 0)} mixed)")
        if r.get("full_window"):
            w = r["full_window"]
            print(f"{'    while all 64 were in flight':<34}{w['output_tok_s']:>12.0f}  ({w['start_s']:.1f}-{w['end_s']:.1f} s)")
        print(f"{'    TTFT p95 / p50 (ms)':<34}{r['ttft_p95_ms']:>12.1f}{r['ttft_p50_ms']:>8.1f}")
        print_gaps("    GPU between passes", r)

    if "concurrency_64_steady" in res:
        print_steady(f"  {args.steady_rounds} requests per stream", res["concurrency_64_steady"])
    print(f"{'  forward passes at 64 / 32':<34}{c64['forward_passes']:>12d}{c32['forward_passes']:>8d}")
    print(f"{'    of which prefill':<34}{c64['prefill_passes']:>12d}{c32['prefill_passes']:>8d}")
    print(f"{'      one prompt, replayed':<34}{c64.get('prefill_graph_passes', 0):>12d}"
          f"{c32.get('prefill_graph_passes', 0):>8d}")
    print(f"{'      mixed with a decode step':<34}{c64.get('mixed_passes', 0):>12d}{c32.get('mixed_passes', 0):>8d}")
    print(f"{'TTFT p95 at 32 concurrent (ms)':<34}{c32['ttft_p95_ms']:>12.0f}  <= 200")
    print(f"{'TTFT p50 at 32 concurrent (ms)':<34}{c32['ttft_p50_ms']:>12.0f}")
    print(f"{'  to the first text, p95 / p50':<34}{c32['ttft_text_p95_ms']:>12.0f}{c32['ttft_text_p50_ms']:>8.0f}")
    slow = sorted(c32.get("per_request", []), key=lambda r: -r[1])[:5]
    if slow:
        print(f"{'  slowest 5: start s / TTFT / queued ms':<34}  "
              + ", ".join(f"{r[0]:.2f}/{r[1]:.0f}/{'?' if r[2] is None else f'{r[2]:.0f}'}" for r in slow))
    print(f"{'single-stream TTFT / first text':<34}{s['ttft_ms']:>12.1f}{s['ttft_text_ms']:>8.1f}")
    for key, label in (("concurrency_32", "32"), ("concurrency_64", "64"), ("concurrency_64_steady", "64 steady")):
        print_queue(f"engine queue at {label}: p50 / p95 ms", res.get(key, {}))
    for key, label in (("concurrency_32", "32"), ("concurrency_64", "64")):
        print_gaps(f"GPU between passes at {label}", res.get(key, {}))
    for change in args.compare:
        print(f"with {compare_tag(change)}:")
        for conc in (32, 64):
            r = res[f"concurrency_{conc}_{compare_tag(change)}"]
            print(f"{f'  {conc} concurrent: tok/s':<34}{r['output_tok_s']:>12.0f}")
            print(f"{f'  TTFT p95 / p50 (ms)':<34}{r['ttft_p95_ms']:>12.0f}{r['ttft_p50_ms']:>8.0f}")
            print(f"{f'  forward / prefill / replayed / mixed':<34}{r['forward_passes']:>12d}{r['prefill_passes']:>8d}"
                  f"{r.get('prefill_graph_passes', 0):>8d}{r.get('mixed_passes', 0):>8d}")
            print_queue("  engine queue: p50 / p95 ms", r)
            print_gaps("  GPU between passes", r)
        if f"concurrency_64_steady_{compare_tag(change)}" in res:
            r = res[f"concurrency_64_steady_{compare_tag(change)}"]
            print_steady(f"  64, {args.steady_rounds} per stream: tok/s", r)
            print_queue("    engine queue: p50 / p95 ms", r)
    for key in [k for k in res if k.startswith(("concurrency_", "warm_load"))]:
        counts = res[key].get("token_counts")
        if counts and set(counts) != {str(args.output)}:
            print(f"{key}: requests by tokens received {counts}, all asked for {args.output}")
    for key, r in res.get("prefill_pass_ms", {}).items():
        print(f"{f'prefill pass {key} x {args.prompt} (ms)':<34}{r['ms']:>12.2f}{r['gemm_tflop_s']:>8d} TFLOP/s")
    if res.get("prefill_graph_error"):
        print(f"one-prompt prefill graphs failed to capture: {res['prefill_graph_error']}")
    for key in [k for k in res if k.startswith("concurrency_")]:
        if res[key].get("prefill_eager_passes"):
            print(f"{key}: {res[key]['prefill_eager_passes']} prefill passes ran eagerly (shape not compiled)")
    first_use = first_use_line(res)
    if first_use:
        print(f"{'multi-prompt prefill, warm-up load / later, ms':<34}  {first_use}")
    gc_last = c64["gc"]
    print(f"{'GC full collections / longest (ms)':<34}{gc_last['collections'][2]:>12d}{gc_last['pause_max_ms'][2]:>8.1f}"
          f"  (after the engine started, through the 64-concurrent load)")
    for rows, ms in res.get("graph_replay_ms", {}).items():
        print(f"{f'graph replay alone, batch {rows} (ms)':<34}{ms:>12.2f}")
    for rows, by_span in res.get("graph_replay_ms_by_span", {}).items():
        print(f"{f'  batch {rows} by span':<34}  " + ", ".join(f"{s}: {ms:.2f}" for s, ms in by_span.items()))
    for key, ms in res.get("mixed_replay_ms", {}).items():
        what = (f"a {key.split('_')[1]}-token {'later ' if key.startswith('resume_') else ''}chunk, 64 rows"
                if key.startswith(("chunk_", "resume_")) else f"{args.prompt}-token prompt")
        print(f"{f'replay alone, {key} (ms)':<34}{ms:>12.2f}  ({what}, span 768)")
    for tag, s_ in res.get("compare_switch_s", {}).items():
        print(f"{f'switch to {tag} (s)':<34}{s_:>12.2f}")


if __name__ == "__main__":
    main()
