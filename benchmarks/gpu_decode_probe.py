"""Where a decode step's time goes on the GPU, and what fusing and compiling buy.

    python benchmarks/gpu_decode_probe.py [--out DIR] [--variants eager,fused,...]

7B-class model (gpu_engine.QWEN7B shape, random bf16 weights, built in memory).
For each variant of the slot decoder's step (eager transformers modules;
projections fused; torch.compile of the step; both), CUDA-graph replay time at
batch 1/8/32/64 over a 768-token span, and a profile of one step (kernel count,
GPU-busy time, top kernels). Then M=1 and M=64 GEMMs of the model's shapes
(achieved bandwidth), and prefill throughput. Prints a table last and writes
gpu_decode_probe.json. Runs on the device machine, no Ray needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import QWEN7B, random_qwen7b, time_replay_ms

SPAN = 768
ROWS = (1, 8, 32, 64)


def profile_step(fn, top_n: int = 10) -> dict:
    """Kernels of one eager (not captured) step: count, summed GPU time, the heaviest names."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time / 1000.0)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top_n]
    by_kind: dict[str, float] = {}
    for k, v in by_name.items():
        by_kind[kernel_kind(k)] = by_kind.get(kernel_kind(k), 0.0) + sum(v)
    return {"kernels": len(kernels), "busy_ms": sum(e.device_time for e in kernels) / 1000.0,
            "gemm_ms": by_kind.get("gemm", 0.0), "by_kind_ms": {k: round(v, 3) for k, v in by_kind.items()},
            "top": [{"name": k, "n": len(v), "ms": round(sum(v), 3)} for k, v in top]}


def kernel_kind(name: str) -> str:
    """gemm (cuBLAS / CUTLASS / nvjet), attention (flash / fused attention), triton (Inductor's fused
    elementwise and reductions) or other (aten's own kernels, copies)."""
    low = name.lower()
    if any(s in low for s in ("gemm", "gemv", "cutlass", "sm90", "nvjet")):
        return "gemm"
    if any(s in low for s in ("flash", "fmha", "attention", "cudnn")):
        return "attention"
    return "triton" if "triton" in low else "other"


def step_logits(out):
    """The logits of a decode step's output, (logits, next tokens, logprobs) since sampling moved into the
    graph (run 18); a read written for the bare logits lost run 51's first probe after its timings."""
    return out[0]


def decoder_variant(model, compile_mode: str | None) -> dict:
    import torch

    from serve_app.engines.slot_kv import SlotDecoder

    dec = SlotDecoder(model, num_slots=64, max_len=2048, dtype=torch.bfloat16, device=torch.device("cuda"),
                      use_graphs=True, batch_sizes=list(ROWS), span_step=SPAN)
    dec.spans = [SPAN]
    out: dict = {}
    t0 = time.monotonic()
    if compile_mode:
        dec._step = torch.compile(dec._step, dynamic=True, mode=compile_mode)
    with torch.inference_mode():
        dec.positions.fill_(SPAN - 1)
        if compile_mode:
            # the engine's first compiled call is its largest batch (SlotDecoder.compile), and with
            # max-autotune that call's sizes are the ones the GEMMs are tuned for
            dec._step(max(ROWS), SPAN)
            dec.positions.fill_(SPAN - 1)
        out["profile_b1"] = profile_step(lambda: dec._step(1, SPAN))
        out["profile_b64"] = profile_step(lambda: dec._step(64, SPAN))
        out["first_steps_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        dec.capture()
        out["capture_s"] = time.monotonic() - t1
        out["replay_ms"] = {str(r): time_replay_ms(dec.graphs[(r, SPAN)][0], 30, warmup=2) for r in ROWS}
        # the fused/compiled step must still compute the same logits as the eager one did
        dec.positions.fill_(SPAN - 1)
        dec.tokens.fill_(123)
        g, o = dec.graphs[(1, SPAN)]
        g.replay()
        logits = step_logits(o)
        out["logits_b1_sample"] = logits[0, :4].float().tolist()
        out["argmax_b1"] = int(logits[0].argmax())
    dec = None
    torch.cuda.empty_cache()
    return out


def gemm_shapes() -> dict[str, tuple[int, int]]:
    """The 7B's weight shapes (N, K) by name, unfused and as the engine fuses them."""
    h, f, kv, v = QWEN7B["hidden_size"], QWEN7B["intermediate_size"], 512, QWEN7B["vocab_size"]
    return {"q/o 3584x3584": (h, h), "k or v 512x3584": (kv, h), "qkv fused 4608x3584": (h + 2 * kv, h),
            "gate or up 18944x3584": (f, h), "gate_up fused 37888x3584": (2 * f, h), "down 3584x18944": (h, f),
            "lm_head 152064x3584": (v, h)}


def mean_us(op, count: int, reps: int = 40) -> float:
    """Mean GPU time of ``op(i)`` (the i-th of ``count`` weights in rotation, so the 50 MB L2 cache does not serve
    the small ones), ``reps`` calls captured as one CUDA graph (after two runs outside it) and replayed. Why a
    graph: from a Python loop the small shapes are bound by the host's launches, not the GPU (q/o at 64 rows:
    23.6 us in a tight loop, 40.9 through a closure, machines AO and AP; _scaled_mm's ~28 us for every small FP8
    shape)."""
    import torch

    from serve_app.engines.slot_kv import capture_graph

    def run():
        for i in range(reps):
            op(i % count)

    graph, _ = capture_graph(run, torch.cuda.graph_pool_handle(), torch.cuda.Stream())
    return time_replay_ms(graph, 1, warmup=1) / reps * 1000


def gemm_row(lib: str, name: str, m: int, n: int, k: int, us: float, weight_bytes: int) -> dict:
    return {"lib": lib, "shape": name, "m": m, "us": round(us, 1),
            "tb_s": round(n * k * weight_bytes / (us * 1e-6) / 1e12, 2),
            "tflop_s": round(2 * m * n * k / (us * 1e-6) / 1e12)}


def gemm_bandwidth(ms: tuple[int, ...] = (1, 64)) -> list[dict]:
    """F.linear at M rows (decode: 1 and 64; a prefill pass: 512 per prompt) over the model's weight shapes."""
    import torch
    import torch.nn.functional as F

    rows = []
    for lib in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
        except Exception as e:  # noqa: BLE001 - a missing library is a result
            rows.append({"lib": lib, "error": repr(e)})
            continue
        for name, (n, k) in gemm_shapes().items():
            count = 2 if n * k > 200_000_000 else 8
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                rows.append(gemm_row(lib, name, m, n, k, mean_us(lambda i: F.linear(x, ws[i]), count), 2))
            ws.clear()
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def gemm_fp8(ms: tuple[int, ...]) -> list[dict]:
    """The fused shapes as FP8 (e4m3) GEMMs through torch._scaled_mm, bf16 out, three ways: ``fp8`` one scale
    per tensor (the GEMM's best case); ``fp8_row`` one scale per activation row and weight channel (what
    quantization 'fp8' runs); ``fp8_lin`` the engine's FP8Linear module whole, uncompiled, so its activation
    quantization runs as separate kernels (the engine compiles them into the kernel before); ``fp8_epi`` the same
    with fp8_scales 'epilogue' (the per-tensor kernel, then the scales as a multiply the engine's compile fuses
    into the next kernel; here a kernel of its own). M is rounded up to
    a multiple of 16. ``tb_s`` counts the FP8 weight's bytes (half the bf16 weight's). ``rel_err``: FP8Linear's
    output against the float32 product of the same bf16 activation and weight (|out - ref| / |ref| over the
    whole output), the kernel's and the quantization's error together."""
    import torch
    from torch import nn

    from serve_app.engines.fp8 import fp8_linear_class, quantize_rows, quantize_weight

    one = torch.tensor(1.0, device="cuda")
    fp8_linear = fp8_linear_class()
    rows = []
    for name, (n, k) in gemm_shapes().items():
        if name.startswith(("k or v", "gate or up")):
            continue
        count = 2 if n * k > 200_000_000 else 8
        try:
            wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
            ws = [w.to(torch.float8_e4m3fn) for w in wb]
            rw = [quantize_weight(w) for w in wb]
            lins, epis = [], []
            for w in wb:
                lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                lin.weight.data.copy_(w)
                lins.append(fp8_linear(lin, torch.bfloat16))
                epis.append(fp8_linear(lin, torch.bfloat16, "epilogue"))
        except Exception as e:  # noqa: BLE001 - no FP8 on this torch or card is a result
            return rows + [{"lib": "fp8", "error": repr(e)}]
        for m in ms:
            m16 = -(-m // 16) * 16
            xb = torch.randn(m16, k, device="cuda", dtype=torch.bfloat16)
            x = xb.to(torch.float8_e4m3fn)
            xq, x_scale = quantize_rows(xb)
            ops = {
                "fp8": lambda i: torch._scaled_mm(x, ws[i].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                "fp8_row": lambda i: torch._scaled_mm(xq, rw[i][0].t(), scale_a=x_scale, scale_b=rw[i][1],
                                                      out_dtype=torch.bfloat16),
                "fp8_lin": lambda i: lins[i](xb),
                "fp8_epi": lambda i: epis[i](xb),
            }
            for lib, op in ops.items():
                try:
                    us = mean_us(op, count)
                except Exception as e:  # noqa: BLE001
                    rows.append({"lib": lib, "shape": name, "m": m16, "error": repr(e)[:300]})
                    continue
                row = gemm_row(lib, name, m16, n, k, us, 1)
                if lib in ("fp8_lin", "fp8_epi"):
                    ref = xb.float() @ wb[0].float().t()
                    mod = (lins if lib == "fp8_lin" else epis)[0]
                    row["rel_err"] = round(float((mod(xb).float() - ref).norm() / ref.norm()), 4)
                rows.append(row)
        ws.clear()
        wb.clear()
        rw.clear()
        lins.clear()
        epis.clear()
    return rows


def prefill_rate(model) -> list[dict]:
    import torch

    from serve_app.engines.slot_kv import SlotDecoder

    dec = SlotDecoder(model, num_slots=16, max_len=1024, dtype=torch.bfloat16, device=torch.device("cuda"),
                      use_graphs=False, batch_sizes=[1], span_step=1024)
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    rows = []
    with torch.inference_mode():
        for n in (1, 4, 16):
            prompts = [[1000 + i] * 512 for i in range(n)]
            dec.prefill(prompts, list(range(n)), 0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                dec.prefill(prompts, list(range(n)), 0)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / 3 * 1000
            tflop = 2 * params * 512 * n / 1e12
            rows.append({"prompts": n, "tokens": 512 * n, "ms": round(ms, 1), "tflop_s": round(tflop / (ms / 1000), 0)})
    dec = None
    torch.cuda.empty_cache()
    return rows


def prefill_profile(model, prompts: tuple[int, ...] = (1, 2, 4, 8), length: int = 512,
                    device: str = "cuda", compile_prefill: bool = True, num_slots: int = 64) -> list[dict]:
    """The engine's prefill pass (compiled as the engine's warm-up compiles it) for 1, 2, 4, 8 prompts
    of 512 tokens, then one prompt replayed from the engine's captured graph: time, TFLOP/s of the
    parameters' work (the LM head's over every token, unlike gpu_engine.py's: ~8 % more on the 7B, kept
    so the committed runs compare), and where the GPU time goes by kernel kind, with the heaviest
    kernels by name (cuBLAS's names carry their tile shapes)."""
    import torch

    from serve_app.engines.slot_kv import SlotDecoder, prefill_graph_padding

    # the captured length a prompt of `length` pads to; room for it, and for the warm-up's own shapes (two
    # prompts of 37 tokens) whatever the profiled ones. As many KV slots as the engine has (its default
    # max_num_seqs): a pass's cost can follow the slot count (the KV write did before c18e22c, which the
    # probe's 8 slots hid: 10.95 ms here against 13.82 in the engine)
    padded = prefill_graph_padding(length)
    slots, max_len = max(*prompts, 2, num_slots), padded + 8
    dec = SlotDecoder(model, num_slots=slots, max_len=max_len, dtype=model.dtype, device=torch.device(device),
                      use_graphs=False, batch_sizes=[1], span_step=max_len, compile_prefill=compile_prefill)
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    rows = []
    with torch.inference_mode():
        if compile_prefill:
            dec.compile_prefill_pass()
        for n, graph in [(n, False) for n in prompts] + [(1, True)]:
            if graph:  # as the engine's warm-up captures them (SlotDecoder.capture_prefill_graphs)
                dec.prefill_graph_tokens = padded
                dec.capture_prefill_graphs()
            batch = [[(1000 + i) % model.config.vocab_size] * length for i in range(n)]
            run = lambda: dec.prefill(batch, list(range(n)), 0)  # noqa: E731
            run()
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for _ in range(5):
                run()
            sync()
            ms = (time.perf_counter() - t0) / 5 * 1000
            row = {"prompts": n, "graph": graph, "tokens": length * n, "ms": round(ms, 2),
                   "tflop_s": round(2 * params * length * n / 1e12 / (ms / 1000)),
                   "eager_passes": dec.prefill_eager_passes, "graph_passes": dec.prefill_graph_passes}
            if device == "cuda":
                row["profile"] = profile_step(run, top_n=14)
            rows.append(row)
    row_compile = {"compile_s": round(dec.prefill_compile_s, 1), "compile_error": dec.prefill_compile_error,
                   "graphs": len(dec.prefill_graph_lengths), "graph_error": dec.prefill_graph_error}
    dec = None
    if device == "cuda":
        torch.cuda.empty_cache()
    return [row_compile] + rows


def print_prefill_profile(rows: list[dict]) -> None:
    print("\nprefill pass (compiled):", rows[0])
    print(f"{'prompts':>8}{'ms':>8}{'TFLOP/s':>9}{'busy':>8}{'gemm':>8}{'attn':>8}{'triton':>8}{'other':>8}"
          f"{'kernels':>9}")
    for r in rows[1:]:
        pr = r.get("profile", {})
        k = pr.get("by_kind_ms", {})
        print(f"{str(r['prompts']) + (' graph' if r.get('graph') else ''):>8}{r['ms']:>8.2f}{r['tflop_s']:>9}{pr.get('busy_ms', 0):>8.2f}"
              f"{k.get('gemm', 0):>8.2f}{k.get('attention', 0):>8.2f}{k.get('triton', 0):>8.2f}"
              f"{k.get('other', 0):>8.2f}{pr.get('kernels', 0):>9}")
    for r in rows[1:]:
        print(f"\n{r['prompts']} prompt(s){', replayed graph' if r.get('graph') else ''}, heaviest kernels:")
        for t in r.get("profile", {}).get("top", []):
            print(f"  {t['ms']:>8.3f} ms {t['n']:>4} x  {t['name']}")


def print_gemm(rows: list[dict]) -> None:
    print("\nGEMM (F.linear, bf16; the fp8 rows: torch._scaled_mm, e4m3, TB/s of the fp8 weight; fp8: per-tensor "
          "scales, fp8_row: row-wise, fp8_lin / fp8_epi: the engine's FP8Linear with its scales in the GEMM / after it, "
          "uncompiled; rel_err: its output against float32):")
    print(f"{'lib':<9}{'shape':<26}{'M':>5}{'us':>9}{'TB/s':>7}{'TFLOP/s':>9}{'rel_err':>9}")
    for r in rows:
        if "error" in r:
            print(r["lib"], r["error"])
            continue
        print(f"{r['lib']:<9}{r['shape']:<26}{r['m']:>5}{r['us']:>9.1f}{r['tb_s']:>7.2f}{r['tflop_s']:>9}"
              f"{r.get('rel_err', ''):>9}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    p.add_argument("--variants", default="eager,compiled,fused,fused+compiled",
                   help="comma-separated; a compiled variant may name its own torch.compile mode after a "
                        "colon, e.g. fused+compiled:max-autotune-no-cudagraphs")
    p.add_argument("--compile-mode", default="default", help="torch.compile mode of compiled variants that name none")
    p.add_argument("--gemm-rows", default="1,64", help="comma-separated M of the GEMM table")
    p.add_argument("--fp8", action="store_true", help="the GEMM table also as FP8 (torch._scaled_mm)")
    p.add_argument("--gemm-only", action="store_true", help="the GEMM table alone (no model, prefill or variants)")
    p.add_argument("--prefill-profile", action="store_true",
                   help="after the GEMM table, the compiled prefill pass at 1/2/4/8 prompts profiled; no variants")
    args = p.parse_args()
    import torch

    from serve_app.engines.fused import fuse_projections
    from serve_app.engines.slot_kv import ATTENTION_NAME, register_attention

    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "variants": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "gpu_decode_probe.json").write_text(json.dumps(res, indent=2))

    gemm_rows = tuple(int(m) for m in args.gemm_rows.split(","))
    res["gemm"] = gemm_bandwidth(gemm_rows)
    if args.fp8:
        res["gemm"] += gemm_fp8(gemm_rows)
    save()
    if args.gemm_only:
        print_gemm(res["gemm"])
        return
    t0 = time.monotonic()
    model = random_qwen7b()
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    res["build_s"] = time.monotonic() - t0
    if args.prefill_profile:
        res["fused_modules"] = fuse_projections(model)
        res["prefill_profile"] = prefill_profile(model)
        save()
        print_gemm(res["gemm"])
        print_prefill_profile(res["prefill_profile"])
        return
    res["prefill"] = prefill_rate(model)
    save()
    fused = False
    for v in args.variants.split(","):
        if v.startswith("fused") and not fused:
            res["fused_modules"] = fuse_projections(model)
            fused = True
        torch._dynamo.reset()
        t1 = time.monotonic()
        name, _, mode = v.partition(":")
        try:
            r = decoder_variant(model, (mode or args.compile_mode) if "compiled" in name else None)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            r = {"error": repr(e), "trace": traceback.format_exc()[-3000:]}
        r["total_s"] = time.monotonic() - t1
        res["variants"][v] = r
        save()
        print(v, json.dumps({k: r.get(k) for k in ("replay_ms", "total_s", "error")}), flush=True)
    if fused:
        res["prefill_fused"] = prefill_rate(model)
    save()

    print_gemm(res["gemm"])
    print("\nprefill (eager):", res["prefill"], "\nprefill (fused):", res.get("prefill_fused"))
    print(f"\n{'variant':<18}{'b1 ms':>8}{'b8':>8}{'b32':>8}{'b64':>8}{'kernels b1':>12}{'busy b1':>9}{'gemm b1':>9}"
          f"{'setup s':>9}  argmax")
    for v, r in res["variants"].items():
        if "error" in r:
            print(f"{v:<18} failed: {r['error'][:200]}")
            continue
        rp, pr = r["replay_ms"], r["profile_b1"]
        print(f"{v:<18}{rp['1']:>8.2f}{rp['8']:>8.2f}{rp['32']:>8.2f}{rp['64']:>8.2f}{pr['kernels']:>12}"
              f"{pr['busy_ms']:>9.2f}{pr['gemm_ms']:>9.2f}{r['total_s']:>9.1f}  {r['argmax_b1']}")


if __name__ == "__main__":
    main()
