"""How much longer the first replay of a captured CUDA graph takes than the next ones (7B, H200).

Why: CUDA uploads a graph to the device on its first launch unless it was uploaded before, and the
engine's mixed passes first meet a load mid-run (docs/gpu_notes.md run 61's TTFT tail). aa10bf3 made
`capture_graph` replay every graph once when captured; this measured that a first replay costs ~0.2 ms
more than later ones (run 63), so the next commit took the replay out again. Uncompiled passes (no
minutes of compile): the decode step at 64 rows and span 768, and the one-prompt prefill pass of 512
tokens, each captured fresh, then replayed 1 + 5 times.

    python3 benchmarks/graph_first_replay.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed_replay_ms(graph) -> tuple[float, float]:
    """(wall ms from launch to done, GPU ms between events) of one replay."""
    import torch

    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    graph.replay()
    b.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000, a.elapsed_time(b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "results"))
    args = p.parse_args()
    import torch

    from benchmarks.gpu_engine import random_qwen7b
    from serve_app.engines.fused import fuse_projections
    from serve_app.engines.slot_kv import ATTENTION_NAME, SlotDecoder, capture_graph, register_attention

    model = random_qwen7b()
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    fuse_projections(model)
    dec = SlotDecoder(model, num_slots=64, max_len=2048, dtype=torch.bfloat16, device=torch.device("cuda"),
                      use_graphs=True, batch_sizes=[64], span_step=256)
    ids = torch.full((1, 512), 1000, dtype=torch.long, device="cuda")
    slot = torch.zeros(1, dtype=torch.long, device="cuda")
    last = torch.full((1,), 511, dtype=torch.long, device="cuda")
    passes = {"decode_64_rows_span_768": lambda: dec._step(64, 768),
              "prefill_one_prompt_512": lambda: dec._prefill_pass(ids, slot, last)}
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with torch.inference_mode():
        for name, run in passes.items():
            graph, _ = capture_graph(run, None, torch.cuda.Stream())  # as the engine captures, own pool
            first = timed_replay_ms(graph)
            later = [timed_replay_ms(graph) for _ in range(5)]
            res[name] = {"first_wall_ms": round(first[0], 2), "first_gpu_ms": round(first[1], 2),
                         "later_wall_ms": round(statistics.median(w for w, _ in later), 2),
                         "later_gpu_ms": round(statistics.median(g for _, g in later), 2)}
            print(json.dumps({name: res[name]}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_first_replay.json").write_text(json.dumps(res, indent=2))
    print(f"\n{'pass':<28}{'first wall / GPU ms':>22}{'later wall / GPU ms':>22}")
    for name in passes:
        r = res[name]
        print(f"{name:<28}{r['first_wall_ms']:>11.2f} / {r['first_gpu_ms']:<8.2f}{r['later_wall_ms']:>11.2f} / "
              f"{r['later_gpu_ms']:<8.2f}")


if __name__ == "__main__":
    main()
