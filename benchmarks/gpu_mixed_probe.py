"""What a mixed pass (decode rows + new prompts in one forward) costs against the passes it replaces.

    python benchmarks/gpu_mixed_probe.py [--out DIR]

7B-class model (gpu_engine.QWEN7B shape, random bf16 weights, built in memory),
projections fused, no graphs and no compile (mixed and prefill passes run eagerly
in the engine too). 64 busy slots at position ~600; for 1 and 4 new 512-token
prompts: a prefill pass alone, an eager decode step alone, and the mixed pass
(SlotDecoder.mixed) with 0 and 64 decode rows. Each: GPU time (CUDA events) and
host time to launch it (wall clock until the call returns, before any sync). Then
a profile of one mixed pass: the heaviest kernels and host-side ops. Prints a
table last and writes gpu_mixed_probe.json. Runs on the device machine, no Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import random_qwen7b  # noqa: E402

BUSY = 64
POS = 600
PROMPT = 512


def timed(fn, reps: int = 5) -> dict:
    """Median GPU ms (events around the call) and host ms (until the call returned)."""
    import statistics

    import torch

    gpu, host = [], []
    fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append(1000 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return {"gpu_ms": round(statistics.median(gpu), 3), "host_ms": round(statistics.median(host), 3)}


def profile(fn) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages()
    top_gpu = sorted(table, key=lambda e: -e.device_time_total)[:12]
    top_cpu = sorted(table, key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "gpu": [{"name": e.key[:80], "n": e.count, "ms": round(e.device_time_total / 1000, 3)} for e in top_gpu],
        "cpu_self": [{"name": e.key[:80], "n": e.count, "ms": round(e.self_cpu_time_total / 1000, 3)}
                     for e in top_cpu],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    args = p.parse_args()
    import random

    import torch

    from serve_app.engines.fused import fuse_projections
    from serve_app.engines.slot_kv import ATTENTION_NAME, SlotDecoder, register_attention

    model = random_qwen7b()
    fuse_projections(model)
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    dec = SlotDecoder(model, num_slots=BUSY + 8, max_len=2048, dtype=torch.bfloat16, device=torch.device("cuda"),
                      use_graphs=False, batch_sizes=[BUSY], span_step=256)
    rng = random.Random(0)
    busy = list(range(BUSY))
    dec.positions[:BUSY] = POS
    dec.active[:BUSY] = 1
    res: dict = {"busy_rows": BUSY, "position": POS, "prompt_tokens": PROMPT, "gpu": torch.cuda.get_device_name(0)}
    with torch.inference_mode():
        res["decode_step_eager"] = timed(lambda: dec._step(BUSY, POS + 1))
        for k in (1, 4):
            prompts = [[rng.randrange(1000, 40000) for _ in range(PROMPT)] for _ in range(k)]
            new = list(range(BUSY, BUSY + k))
            res[f"prefill_{k}"] = timed(lambda: dec.prefill(prompts, new, 0))  # noqa: B023
            res[f"mixed_0_{k}"] = timed(lambda: dec.mixed([], [], prompts, new))  # noqa: B023
            res[f"mixed_{BUSY}_{k}"] = timed(lambda: dec.mixed(busy, [POS] * BUSY, prompts, new))  # noqa: B023
        one = [[rng.randrange(1000, 40000) for _ in range(PROMPT)]]
        res["profile_mixed_64_1"] = profile(lambda: dec.mixed(busy, [POS] * BUSY, one, [BUSY]))
        res["profile_prefill_1"] = profile(lambda: dec.prefill(one, [BUSY], 0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_mixed_probe.json").write_text(json.dumps(res, indent=2))
    for name in ("profile_prefill_1", "profile_mixed_64_1"):
        print(f"\n{name}: heaviest GPU ops")
        for e in res[name]["gpu"]:
            print(f"  {e['name']:<80}{e['n']:>6}{e['ms']:>10.3f}")
        print(f"{name}: heaviest host (self CPU) ops")
        for e in res[name]["cpu_self"]:
            print(f"  {e['name']:<80}{e['n']:>6}{e['ms']:>10.3f}")
    print(f"\n{'pass (64 busy rows at ~600, 512-token prompts)':<50}{'GPU ms':>10}{'host ms':>10}")
    for key, label in [("decode_step_eager", "decode step alone (eager)"),
                       ("prefill_1", "prefill pass, 1 prompt"), ("mixed_0_1", "mixed, 0 decode rows + 1 prompt"),
                       (f"mixed_{BUSY}_1", f"mixed, {BUSY} decode rows + 1 prompt"),
                       ("prefill_4", "prefill pass, 4 prompts"), ("mixed_0_4", "mixed, 0 decode rows + 4 prompts"),
                       (f"mixed_{BUSY}_4", f"mixed, {BUSY} decode rows + 4 prompts")]:
        print(f"{label:<50}{res[key]['gpu_ms']:>10.2f}{res[key]['host_ms']:>10.2f}")


if __name__ == "__main__":
    main()
