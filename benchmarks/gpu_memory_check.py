"""The KV cache's memory check on a real GPU: what the engine checks against what the GPU then holds.

    python3 benchmarks/gpu_memory_check.py --tokenizer .bench_assets [--out $OUT]

Why: the check (serve_app/engines/memory.py) reads the GPU's budget through
torch's allocator (`device_budget`), and on the CPU box only its pure parts
and the host branch run. Here, on the device, each case starts the real hf
engine (inline, eager: no compile, so a case takes seconds) on a short
random model of the 7B's layer shape (4 layers, so a token's KV is 8 KiB
and a cache too large for any GPU is one setting away):

- fits: a 64 x 2,048 static cache starts; the GPU then holds the weights
  and the cache the check counted (torch's allocated bytes against them);
- too large: 64 x 400,000 tokens is refused before anything is allocated,
  with a max_model_len that fits; that setting then starts;
- crowded: with most of the GPU taken by another tensor, the budget is what
  is free, and the message says so;
- dynamic: a max_kv_tokens too large is refused with the largest that fits;
- fp8: the load's peak (weights quantized layer by layer onto the GPU)
  against the bf16 load's.

Prints a table last and writes gpu_memory_check.json. A case that does not
behave so is a FAIL row, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import build_model_dir  # noqa: E402

GB = 1e9
LAYERS = 4


def options(model_dir: Path, **over) -> dict:
    # eager and uncaptured: the check runs before any of that, and a case then takes seconds, not minutes
    return {"model": str(model_dir), "device": "cuda", "dtype": "bfloat16", "max_num_seqs": 64,
            "max_model_len": 2048, "max_kv_tokens": 1 << 22, "kv_cache": "static", "cuda_graphs": False,
            "compile_decode": False, "compile_prefill": False, "prefill_graph_tokens": 0, "mixed_graph_tokens": 0,
            **over}


async def start(opts: dict):
    """(engine, None) once started, or (None, the start's error)."""
    import torch

    from serve_app.engines.registry import create_engine

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    eng = create_engine("hf", opts, process="inline")
    try:
        await eng.start()
    except Exception as e:  # noqa: BLE001 — the case reports it
        return None, e
    return eng, None


def collect() -> None:
    """Frees what a dropped engine held, once no variable refers to it any more (a helper that took the engine
    as an argument could not drop the caller's reference: run 118's script measured with the last engine held)."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def suggested(message: str, name: str) -> int | None:
    m = re.search(rf"{name} <= (\d+)", message)
    return int(m.group(1)) if m else None


async def run(args) -> list[dict]:
    import torch

    from serve_app.errors import KVCacheTooLargeError

    model_dir = Path(args.work) / "qwen2-4layer-random"
    # the 7B's layers, 4 of them; positions enough for a cache too large for any GPU
    build_model_dir(model_dir, Path(args.tokenizer), num_hidden_layers=LAYERS, max_position_embeddings=1 << 20)
    free0, total = torch.cuda.mem_get_info()
    rows: list[dict] = []

    def row(case: str, ok: bool, **fields) -> None:
        rows.append({"case": case, "ok": ok, **fields})
        print(f"{'ok  ' if ok else 'FAIL'} {case}: {json.dumps(fields)}", flush=True)

    async def started(case: str, opts: dict, measure) -> dict | None:
        """Start an engine that must start; a row of ``measure(warm_up)`` -> (ok, fields), taken while it runs;
        its warm-up report, or None. The engine is shut down and dropped before this returns."""
        eng, err = await start(opts)
        if eng is None:
            row(case, False, error=repr(err)[:400])
            return None
        warm = eng.warm_up or {}
        ok, fields = measure(warm)
        row(case, ok, **fields)
        await eng.shutdown()
        del eng
        collect()
        return warm

    async def refused(case: str, opts: dict, ok) -> str | None:
        """Start an engine that must be refused; a row whether ``ok(message)`` holds; the message, or None."""
        eng, err = await start(opts)
        if eng is not None:
            row(case, False, error="it started")
            await eng.shutdown()
            del eng
            collect()
            return None
        message = str(err)
        row(case, isinstance(err, KVCacheTooLargeError) and ok(message), message=message[:400])
        del err  # its traceback holds the refused engine (which has let its weights go: the next row checks that)
        collect()
        return message

    def fits(w: dict):  # what the GPU holds once started against what the check counted
        held_gb = torch.cuda.memory_allocated() / GB
        counted_gb = w["weights_gb"] + w["kv_cache_gb"]
        return abs(held_gb - counted_gb) < 0.05 * counted_gb + 0.2, dict(
            kv_cache_gb=round(w["kv_cache_gb"], 3), weights_gb=round(w["weights_gb"], 3),
            allocated_gb=round(held_gb, 3), load_peak_gb=round(w["load_peak_gb"], 3),
            kv_counted_gb=round(64 * 2048 * 2 * LAYERS * 4 * 128 * 2 / GB, 3))

    warm = await started("fits", options(model_dir), fits)
    bf16_peak = warm["load_peak_gb"] if warm else None

    # too large: refused before allocating, then the suggested max_model_len starts
    before = torch.cuda.memory_allocated()
    message = await refused("too large: refused", options(model_dir, max_model_len=400_000),
                            lambda m: suggested(m, "max_model_len") is not None)
    fit = suggested(message, "max_model_len") if message else None
    # the engine's own weights were on the GPU when it refused; they must be gone with it
    row("too large: nothing left behind", torch.cuda.memory_allocated() - before < 0.05 * GB,
        allocated_after_gb=round((torch.cuda.memory_allocated() - before) / GB, 3))
    if fit:
        def within_share(w: dict):
            used = (total - torch.cuda.mem_get_info()[0]) / total
            return used <= 0.9 + 0.02, dict(max_model_len=fit, kv_cache_gb=round(w["kv_cache_gb"], 2),
                                            gpu_used_share=round(used, 3))

        await started("too large: the suggested max_model_len starts", options(model_dir, max_model_len=fit),
                      within_share)

    # crowded: another tensor holds most of the GPU, so the budget is what is free
    hog = torch.empty(int(0.7 * total), dtype=torch.uint8, device="cuda")
    await refused("crowded: refused on what is free", options(model_dir, max_model_len=100_000),
                  lambda m: "free on" in m)
    del hog
    torch.cuda.empty_cache()

    # dynamic: max_kv_tokens too large for the GPU
    await refused("dynamic: max_kv_tokens refused",
                  options(model_dir, kv_cache="dynamic", max_kv_tokens=20_000_000, max_model_len=4096),
                  lambda m: suggested(m, "max_kv_tokens") is not None)

    # fp8: the load's peak against bf16's
    if torch.cuda.get_device_capability() >= (8, 9):
        await started("fp8: load peak", options(model_dir, quantization="fp8"), lambda w: (
            bf16_peak is not None and w["load_peak_gb"] < bf16_peak,
            dict(load_peak_gb=round(w["load_peak_gb"], 3), weights_gb=round(w["weights_gb"], 3),
                 bf16_load_peak_gb=bf16_peak)))
    rows.append({"gpu": torch.cuda.get_device_name(), "total_gb": total / GB, "free_at_start_gb": free0 / GB})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory (the model's weights are random)")
    p.add_argument("--work", default="/tmp/seekserve-bench")
    p.add_argument("--out", default=str(ROOT / "results"))
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = asyncio.run(run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_memory_check.json").write_text(json.dumps(rows, indent=1))
    gpu = rows[-1]
    print(f"\n{gpu['gpu']}, {gpu['total_gb']:.1f} GB ({gpu['free_at_start_gb']:.1f} free); "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"{'case':<48}result")
    for r in rows[:-1]:
        print(f"{r['case']:<48}{'ok' if r['ok'] else 'FAIL'}")
    sys.exit(0 if all(r["ok"] for r in rows[:-1]) else 1)


if __name__ == "__main__":
    main()
