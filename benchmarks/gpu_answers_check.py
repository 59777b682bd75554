"""The engine's fast paths on a real GPU answer as its plain path does.

    python3 benchmarks/gpu_answers_check.py --tokenizer .bench_assets [--out $OUT]

Why: every GPU benchmark runs random weights with fixed output lengths and
reads only times, so a pass that wrote the wrong slot, replayed a graph over
stale inputs, or read a pinned host buffer before its non-blocking copy landed
would still report its tok/s. On the CPU box the engine has none of those
paths (no CUDA graphs, no streams, no pinned buffers: hf.py runs them only on
"cuda"), so the CPU tests cannot see such a fault either.

Each case starts two engines on one random model of the 7B's layer shape
(4 layers; transformers' own initialisation, so the model's next token
depends on its context) and sends both the same concurrent greedy load: a
burst of prompts at once (multi-prompt prefill passes), then one prompt
every 5 ms while the others decode (one-prompt graph replays and mixed
passes, rows joining and leaving the buckets, slots reused once all 32 have
been taken), prompts of 3 to 1,500 tokens.

- the reference: eager, unfused, uncaptured (``cuda_graphs`` and both
  compiles off), asking for the top-5 log-probabilities of every token;
- the engine as the benchmarks run it: fused projections, compiled decode
  and prefill, CUDA graphs, one-prompt prefill graphs, mixed passes of up to
  512 tokens.

A float32 request passes if its tokens are the reference's, or if they first
part where the engine's pick was among the reference's top five and within
``tie_nats`` of the reference's pick (a rounding difference, not a fault: the
rule of vLLM's ``check_logprobs_close``, with a bound on the gap); and over
the tokens they share, each token's log-probability is within
``logprob_nats`` of the reference's, 1e-3 nats: any fault of slots,
positions or buffers shows (a 1 % one does on the CPU, tests). A last case
runs float32 again with chunked prefill (``mixed_chunk_tokens``, opt-in),
whose later chunks take a masked pass of their own.

bf16 and FP8 cannot be held to their eager twin: torch.compile keeps a fused
kernel's intermediates in float32 where eager rounds them, and e4m3's grid
(3 mantissa bits) turns any such difference into its own noise within a few
layers. On the CPU, this 4-layer model in float32 with FP8 layers moves
log-probabilities by 1.21 nats (top-1 agreement 86 % over 64 positions) when
its embeddings are scaled by 1 + 2^-20, against 3.9e-5 without FP8; compiled
against eager FP8 differ by 1.13 (86 %), while each layer alone agrees
exactly (fp8_compile_probe.py; run 128 saw the same on an H100). So those
cases compare both engines with the float32 eager answers instead (the
"truth"), request by request: the fast engine passes unless it keeps
significantly fewer of the truth's tokens before parting, or parts to a token
outside the truth's top five significantly more often, than eager does in the
same dtype (a paired mean over the 56 requests, more than 3 standard errors
and more than ``TRUTH_MARGIN_TOKENS`` / ``TRUTH_MARGIN_SHARE``). Their rows
also report how the fast engine parts from its eager twin. They catch gross
faults only: on the CPU's tiny model a fault of 50 % on one layer's MLP
output, in the fast engine's path only, fails bf16 (tests).

Prints a table last and writes gpu_answers_check.json; exit 1 if any case
fails. ``--device cpu --model-config tiny`` runs the same script on the CPU box
(both engines then take the plain path: a check of the script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import QWEN7B, save_with_tokenizer  # noqa: E402
from benchmarks.gpu_memory_check import collect  # noqa: E402

LAYERS = 4
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False)
OUTPUT_TOKENS = 48
LOGIT_STD = 3.0
# the reference's top-k per token: where the engine parts from it, its pick must be among these (vLLM's tests use 5)
TOP_K = 5
# case -> (dtype, quantization, tie_nats, logprob_nats, chunked); in the order a call cut short should keep them
CASES = {
    "float32": ("float32", "none", 1e-3, 1e-3, False),
    # against the float32 truth, the fast engine against eager in the same dtype (module docstring)
    "bf16": ("bfloat16", "none", None, None, False),
    "fp8": ("bfloat16", "fp8", None, None, False),
    # chunked prefill (opt-in): a prompt's later chunks attend over its slot through their own masked pass
    "float32-chunks": ("float32", "none", 1e-3, 1e-3, True),
}
# the truth cases' margins: worse by more than this (and by more than 3 standard errors) fails
TRUTH_MARGIN_TOKENS = 1.0
TRUTH_MARGIN_SHARE = 0.1


@dataclass
class Answer:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None  # per token, the reference's TOP_K likeliest (id, logprob)


def compare(ref: Answer, got: Answer, tie_nats: float, logprob_nats: float) -> dict:
    """One request's verdict: where ``got`` first parts from ``ref``, whether its pick there was among the
    reference's top-k and within ``tie_nats`` of the reference's pick, and the largest log-probability
    difference over the tokens they share."""
    shared = 0
    for a, b in zip(ref.tokens, got.tokens):
        if a != b:
            break
        shared += 1
    max_dlp = max((abs(a - b) for a, b in zip(ref.logprobs[:shared], got.logprobs[:shared])), default=0.0)
    out = {"shared": shared, "length": len(ref.tokens), "max_dlogprob": max_dlp, "parted_at_gap": None,
           "parted_at_rank": None}
    if len(got.tokens) != len(ref.tokens):
        return {**out, "ok": False, "why": f"{len(got.tokens)} tokens against the reference's {len(ref.tokens)}"}
    if max_dlp > logprob_nats:
        return {**out, "ok": False, "why": f"a shared token's logprob differs by {max_dlp:.3g} nats"}
    if shared == len(ref.tokens):
        return {**out, "ok": True, "why": "identical"}
    took, picked = ref.tokens[shared], got.tokens[shared]
    ranked = ref.top[shared]
    top = dict(ranked)
    if picked not in top:
        return {**out, "ok": False, "why": f"parted at token {shared}: took {picked}, not among the reference's "
                                          f"top {len(ranked)} (it took {took})"}
    # the reference's pick by its own logprob: with an exact tie the listing's order is arbitrary, the pick not
    gap = top.get(took, ref.logprobs[shared]) - top[picked]
    out["parted_at_gap"] = gap
    out["parted_at_rank"] = 1 + sum(lp > top[picked] or (lp == top[picked] and t == took) for t, lp in ranked)
    if gap <= tie_nats:
        return {**out, "ok": True, "why": f"parted at token {shared}, to the reference's #{out['parted_at_rank']} "
                                          f"({gap:.3g} nats behind)"}
    return {**out, "ok": False, "why": f"parted at token {shared}: took {picked}, the reference {took} "
                                      f"({gap:.3g} nats ahead)"}


def closeness(truth: list[Answer], got: list[Answer]) -> list[dict]:
    """Per request: tokens kept before parting from the truth, whether the parting pick was outside the truth's
    top-k, the largest log-probability difference over the kept tokens."""
    out = []
    for t, g in zip(truth, got):
        v = compare(t, g, float("inf"), float("inf"))
        out.append({"shared": v["shared"], "max_dlogprob": v["max_dlogprob"], "length_ok": len(g.tokens) == len(t.tokens),
                    "outside": v["shared"] < v["length"] and v["parted_at_rank"] is None})
    return out


def _paired(fast: list[float], eager: list[float]) -> tuple[float, float]:
    d = [f - e for f, e in zip(fast, eager)]
    mean = statistics.fmean(d)
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0
    return mean, se


def truth_verdict(eager: list[dict], fast: list[dict]) -> dict:
    """Whether the fast engine is as close to the truth as eager in the same dtype (closeness() rows of each)."""
    def summary(rows):
        return {"shared_mean": statistics.fmean(r["shared"] for r in rows),
                "outside_top_share": statistics.fmean(r["outside"] for r in rows),
                "max_dlogprob_median": statistics.median(r["max_dlogprob"] for r in rows)}

    d_shared, se_shared = _paired([r["shared"] for r in fast], [r["shared"] for r in eager])
    d_out, se_out = _paired([float(r["outside"]) for r in fast], [float(r["outside"]) for r in eager])
    why = []
    if not all(r["length_ok"] for r in fast):
        why.append("an answer's length differs from the truth's")
    if d_shared < -max(TRUTH_MARGIN_TOKENS, 3 * se_shared):
        why.append(f"keeps {-d_shared:.2f} fewer of the truth's tokens (3 standard errors: {3 * se_shared:.2f})")
    if d_out > max(TRUTH_MARGIN_SHARE, 3 * se_out):
        why.append(f"parts outside the truth's top {TOP_K} {d_out:.0%} more often (3 standard errors: "
                   f"{3 * se_out:.0%})")
    return {"ok": not why, "why": "; ".join(why) or "as close as eager", "eager": summary(eager),
            "fast": summary(fast), "shared_diff_mean": d_shared, "shared_diff_se": se_shared,
            "outside_diff_mean": d_out, "outside_diff_se": se_out}


def schedule(max_prompt: int, known: int, seed: int = 0) -> list[tuple[float, list[int]]]:
    """(arrival s, prompt ids): 8 at once, then 48 one every 5 ms (more than the engines' 32 slots, so slots are
    reused while others decode); lengths scaled to ``max_prompt``."""
    rng = random.Random(seed)
    burst = [5, 17, 64, 100, 300, 512, 700, 1500]
    trickle = [3, 40, 130, 256, 448, 511, 512, 513, 800, 64, 200, 1024]
    lengths = burst + trickle * 4
    arrivals = [0.0] * len(burst) + [0.3 + 0.005 * i for i in range(4 * len(trickle))]
    scale = min(1.0, max_prompt / 1500)
    return [(t, [rng.randrange(100, known) for _ in range(max(1, int(n * scale)))])
            for t, n in zip(arrivals, lengths)]


def build_model(path: Path, tokenizer_dir: Path, known: int, device: str, config: dict) -> None:
    """The random model (transformers' own initialisation: norms at 1, so the next token depends on the context;
    a sharper LM head) saved in bf16 with the tokenizer; ids past the tokenizer's ``known`` never win (zero rows)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (path / "config.json").exists() and list(path.glob("*.safetensors")):
        return
    cfg = Qwen2Config(**{"vocab_size": max(known, config.pop("vocab_size", known)), **config})
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        # logits of std ~LOGIT_STD (the final norm's output has unit RMS): a real model's sharpness, so the top two
        # are seldom within rounding of each other and a fault moves log-probabilities by as much as it moves
        # logits (at the initialisation's 0.02 the logits spread ~1 and a 1 % fault moves them ~1e-3)
        model.lm_head.weight.normal_(0.0, LOGIT_STD / cfg.hidden_size ** 0.5)
        model.lm_head.weight[known:].zero_()
    save_with_tokenizer(model, path, tokenizer_dir)
    del model
    collect()


def engine_options(model_dir: Path, device: str, dtype: str, quantization: str, fast: bool,
                   max_model_len: int, chunked: bool = False) -> dict:
    common = {"model": str(model_dir), "device": device, "dtype": dtype, "quantization": quantization,
              "max_num_seqs": 32, "max_waiting_requests": 256, "max_model_len": max_model_len,
              "max_prefill_tokens": 2048, "kv_cache": "static"}
    if fast:  # the benchmarks' engine (gpu_engine.py's options, mixed passes on)
        mixed = min(512, max_model_len // 4 // 64 * 64)
        chunks = {"mixed_chunk_tokens": max(64, mixed // 2 // 64 * 64)} if chunked else {}
        return {**common, "mixed_graph_tokens": mixed, **chunks}
    return {**common, "fuse_projections": False, "cuda_graphs": False, "compile_decode": False,
            "compile_prefill": False, "prefill_graph_tokens": 0, "mixed_graph_tokens": 0}


async def answers(opts: dict, load: list[tuple[float, list[int]]], top: bool) -> tuple[list[Answer], dict]:
    """Every request's answer from one engine under ``load``, and the engine's pass counts."""
    from serve_app.engines.base import GenerationRequest, SamplingParams
    from serve_app.engines.registry import create_engine

    eng = create_engine("hf", opts, process="inline")
    t0 = time.perf_counter()
    await eng.start()
    ready_s = time.perf_counter() - t0

    async def one(i: int, at: float, ids: list[int]) -> Answer:
        await asyncio.sleep(at)
        sp = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True, top_logprobs=TOP_K if top else 0)
        toks, lps, tops = [], [], []
        async for c in eng.generate(GenerationRequest(f"r{i}", ids, sp)):
            toks += c.token_ids
            lps += c.logprobs
            if c.top_logprobs is not None:
                tops += [sorted(d.items(), key=lambda kv: -kv[1]) for d in c.top_logprobs]
        return Answer(toks, lps, tops if top else None)

    try:
        got = await asyncio.gather(*(one(i, at, ids) for i, (at, ids) in enumerate(load)))
        s = eng.stats()
        passes = {"ready_s": round(ready_s, 1), "forward_passes": s.forward_passes,
                  "prefill_passes": s.prefill_passes, "prefill_graph_passes": s.prefill_graph_passes,
                  "mixed_passes": s.mixed_passes,
                  "graphs": (eng.warm_up or {}).get("cuda_graphs", 0)}
    finally:
        await eng.shutdown()
        eng = None  # the next engine starts with this one's memory given back (gpu_memory_check.py, run 119)
        collect()
    return list(got), passes


async def run(args) -> list[dict]:
    import torch

    device = args.device
    config = {**QWEN7B, "num_hidden_layers": LAYERS} if args.model_config == "7b-4layer" else dict(TINY)
    from tokenizers import Tokenizer

    known = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json")).get_vocab_size()
    model_dir = Path(args.work) / f"answers-{args.model_config}"
    build_model(model_dir, Path(args.tokenizer), known, device, config)
    max_model_len = args.max_model_len
    load = schedule(max_model_len - OUTPUT_TOKENS - 1, known)
    rows = []
    device_row = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  "model": args.model_config, "output_tokens": OUTPUT_TOKENS}

    def save() -> None:  # after every case: a call cut short by its time limit keeps the cases it finished
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_answers_check.json").write_text(json.dumps(rows + [device_row], indent=1))

    memo: dict[str, tuple[list[Answer], dict]] = {}

    async def answers_of(opts: dict, top: bool):  # the truth is the float32 case's reference: run once
        key = json.dumps([opts, top], sort_keys=True)
        if key not in memo:
            memo[key] = await answers(opts, load, top=top)
        return memo[key]

    for name in args.cases:
        dtype, quant, tie, lp_tol, chunked = CASES[name]
        if quant == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
            rows.append({"case": name, "ok": True, "skipped": "no FP8 on this GPU"})
            save()
            continue
        t0 = time.perf_counter()
        try:
            ref, ref_passes = await answers_of(engine_options(model_dir, device, dtype, quant, False, max_model_len),
                                               top=True)
            fast, fast_passes = await answers_of(engine_options(model_dir, device, dtype, quant, True, max_model_len,
                                                                chunked), top=False)
            truth = None
            if tie is None:
                truth, _ = await answers_of(engine_options(model_dir, device, "float32", "none", False,
                                                           max_model_len), top=True)
        except Exception as e:  # noqa: BLE001 — the case reports it
            rows.append({"case": name, "ok": False, "error": repr(e)[:600]})
            print(f"FAIL {name}: {e!r}"[:700], flush=True)
            save()
            continue
        # against the eager twin: the verdict for float32, a report for the others
        verdicts = [compare(r, f, tie if tie is not None else float("inf"),
                            lp_tol if lp_tol is not None else float("inf")) for r, f in zip(ref, fast)]
        parted = [v["shared"] for v in verdicts if v["shared"] < v["length"]]
        row = {"case": name, "dtype": dtype, "quantization": quant, "tie_nats": tie, "logprob_nats": lp_tol,
               "requests": len(load), "identical": len(verdicts) - len(parted),
               "parted_ok": sum(v["ok"] and v["shared"] < v["length"] for v in verdicts),
               "parted_outside_top": sum(v["shared"] < v["length"] and v["parted_at_rank"] is None
                                         for v in verdicts),
               "first_parting_median": statistics.median(parted) if parted else None,
               "max_dlogprob": max(v["max_dlogprob"] for v in verdicts),
               "distinct_tokens_per_answer_median": statistics.median(len(set(a.tokens)) for a in ref),
               "reference": ref_passes, "fast": fast_passes}
        if truth is None:
            bad = [dict(request=i, prompt_tokens=len(load[i][1]), **v) for i, v in enumerate(verdicts)
                   if not v["ok"]]
            row.update(ok=not bad, failed=len(bad), failures=bad[:8])
            line = (f"{row['identical']}/{len(load)} identical, {row['parted_ok']} parted within bounds, "
                    f"{len(bad)} failed; max dlogprob {row['max_dlogprob']:.2g}")
        else:
            tv = truth_verdict(closeness(truth, ref), closeness(truth, fast))
            row.update(ok=tv["ok"], failed=0 if tv["ok"] else 1, failures=[] if tv["ok"] else [{"why": tv["why"]}],
                       against_truth=tv)
            line = (f"against float32: fast keeps {tv['fast']['shared_mean']:.1f} tokens, eager "
                    f"{tv['eager']['shared_mean']:.1f}; parts outside its top {TOP_K}: fast "
                    f"{tv['fast']['outside_top_share']:.0%}, eager {tv['eager']['outside_top_share']:.0%} "
                    f"({tv['why']}); against eager {dtype}: {row['identical']} identical, first parting "
                    f"{row['first_parting_median']}, max dlogprob {row['max_dlogprob']:.2g}")
        row.update(seconds=round(time.perf_counter() - t0, 1), verdicts=verdicts)
        rows.append(row)
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {name}: {line}; fast passes {fast_passes}", flush=True)
        for b in row["failures"][:4]:
            print(f"     request {b['request']} ({b['prompt_tokens']} prompt tokens): {b['why']}" if "request" in b
                  else f"     {b['why']}", flush=True)
        save()
    return rows + [device_row]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory (the model's weights are random)")
    p.add_argument("--work", default="/tmp/seekserve-bench")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model-config", default="7b-4layer", choices=["7b-4layer", "tiny"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--out", default=str(ROOT / "results"))
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = asyncio.run(run(args))
    print(f"\n{rows[-1]['device']}, model {rows[-1]['model']}; {time.perf_counter() - t0:.0f} s")
    print("against the eager reference in the same dtype (the verdict for float32); bf16 and fp8 are judged against "
          "the float32 truth (last columns: tokens kept before parting from it, fast / eager)")
    print(f"{'case':<16}{'result':<8}{'identical':>10}{'parted ok':>10}{'failed':>8}{'1st parting':>12}"
          f"{'max dlogprob':>14}{'truth kept':>16}")
    for r in rows[:-1]:
        if "identical" in r:
            first = "-" if r["first_parting_median"] is None else f"{r['first_parting_median']:g}"
            tv = r.get("against_truth")
            kept = f"{tv['fast']['shared_mean']:.1f} / {tv['eager']['shared_mean']:.1f}" if tv else "-"
            print(f"{r['case']:<16}{'ok' if r['ok'] else 'FAIL':<8}{r['identical']:>10}{r['parted_ok']:>10}"
                  f"{r['failed']:>8}{first:>12}{r['max_dlogprob']:>14.2g}{kept:>16}")
        else:
            print(f"{r['case']:<16}{'ok' if r['ok'] else 'FAIL':<8}{r.get('skipped') or r.get('error', '')}")
    sys.exit(0 if all(r["ok"] for r in rows[:-1]) else 1)


if __name__ == "__main__":
    main()
