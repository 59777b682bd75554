"""Decode attention alone: the slot decoder's form against fused kernels, on the engine's shapes.

    python benchmarks/gpu_attention_probe.py [--device cuda|cpu] [--rows 1 8 64] [--span 768] [--out DIR]

Why: the profile of one compiled batch-64 decode step (gpu_decode_probe.py, 2026-12-02; raw
docs/results/gpu_decode_probe-h200-2026-12-02.json) put its attention at ~1.2 ms for 28 layers (two batched
matmuls with a fp32 softmax between them, at span 768) where reading the keys and values takes ~0.7 ms at
4.2 TB/s, and at batch 1 ~0.26 ms where the reads take ~0.02. A fused kernel is the remaining lever on the
decode step (docs/gpu_notes.md); this measures what the maintained ones give before the engine changes.

Each variant runs one decode step's attention: 28 layers, each over its own K/V buffer laid out as the
engine's (``[slots, kv_heads, max_len + 1, head_dim]``, sliced to ``[rows, :, :span]``), rows masked to
their own lengths. On cuda the 28 calls are captured in one CUDA graph and replayed (CUDA events); on cpu
(small shapes) only the agreement with a float64 reference is checked. A variant that fails is a result.

Variants:
- ``engine``: serve_app.engines.slot_kv.slot_attention (query heads grouped per KV head, matmul, masked
  fp32 softmax, matmul), under torch.compile as in the engine's compiled step.
- ``engine_reduce``: the engine's form with both matmuls written as a broadcast multiply and a sum, so
  Inductor generates its own reduction kernels (K and V read by Triton, the scores and the softmax fused
  with them where it can) instead of calling cuBLAS's batched GEMM at 7 query rows per KV head.
- ``sdpa_*``: F.scaled_dot_product_attention with each KV head's 7 query heads as 7 query positions (no
  GQA support needed, K and V read once) and an additive mask shared by the layers; ``default`` lets
  torch pick, ``efficient`` / ``cudnn`` force a backend.
- ``flex``: FlexAttention (compiled) with GQA and a score_mod that masks past each row's length.
- ``flex_block``: FlexAttention (compiled) with GQA and a block mask of each row's length (a mask_mod), so
  blocks past a row's length are skipped and a one-query call takes flex's decoding kernel, which splits the
  span across thread blocks (split-KV) where the engine's form reads it in one pass per row. ``flex`` (run
  46: 7.70 ms at 64 rows) masked through a score_mod, which visits every block. The block mask is built once
  per row set, outside the timed graph (an engine would build it once per step, for all layers).
- ``flash_unmasked``: SDPA's flash kernel with GQA and no mask. Not a valid decode (rows see positions
  past their length): the bound of a fused kernel that reads the whole span.

Prints a table last and writes gpu_attention_probe.json. No Ray, no model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import print_table, save_json  # noqa: E402

# DeepSeek-R1-Distill-Qwen-7B's attention (gpu_engine.QWEN7B)
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 28, 28, 4, 128
COPY_TB_S = 4.2  # the H200's measured copy bandwidth (docs/gpu_notes.md)
VARIANTS = ("engine", "engine_reduce", "sdpa_default", "sdpa_efficient", "sdpa_cudnn", "flex", "flex_block",
            "flash_unmasked")


def make_inputs(torch, rows: int, span: int, max_len: int, layers: int, slots: int, device, seed: int = 0):
    """Per-layer K/V buffers of the engine's layout, one query per layer, per-row positions in the span."""
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: 7.5 GB of buffers on cuda
    shape = (slots, KV_HEADS, max_len + 1, HEAD_DIM)

    def randn(*size):
        return torch.randn(size, generator=g, device=device, dtype=torch.bfloat16)

    keys = [randn(*shape) for _ in range(layers)]
    values = [randn(*shape) for _ in range(layers)]
    queries = [randn(rows, HEADS, 1, HEAD_DIM) for _ in range(layers)]
    # rows end within the span's last quarter, as in a bucket the longest row chose
    lo = max(1, span - span // 4)
    pos = torch.randint(lo, span, (rows,), generator=g, device=device)
    pos[0] = span - 1
    return keys, values, queries, pos


def reference(torch, q, k, v, pos, scale):
    """float64 attention of one layer, each row over positions 0..pos[row]."""
    span = k.shape[2]
    group = HEADS // KV_HEADS
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = (q.double() @ kk.transpose(-1, -2)) * scale  # [rows, H, 1, span]
    keep = torch.arange(span, device=q.device)[None, :] <= pos[:, None]
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vv).transpose(1, 2)  # [rows, 1, H, d]


def build_variant(torch, name: str, pos, span: int, scale: float):
    """(per-step setup, per-layer attention) for a variant; the layer function returns [rows, 1, H, d]."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = pos.shape[0]
    group = HEADS // KV_HEADS
    span_ids = torch.arange(span, device=pos.device)

    if name == "engine":
        from serve_app.engines.slot_kv import slot_attention

        def layer(q, k, v, mask):
            return slot_attention(None, q, k, v, mask, scaling=scale)[0]

        def setup():
            return (span_ids[None, :] <= pos[:, None])[:, None, None, :]

        return setup, torch.compile(layer, dynamic=False)

    if name == "engine_reduce":
        def layer(q, k, v, mask):
            b = q.shape[0]
            qg = q.reshape(b, KV_HEADS, group, 1, HEAD_DIM).float()
            scores = (qg * k.unsqueeze(2)).sum(-1) * scale  # [rows, KVH, g, span]
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out = (probs.unsqueeze(-1) * v.unsqueeze(2)).sum(-2)  # [rows, KVH, g, d]
            return out.to(q.dtype).reshape(b, 1, HEADS, HEAD_DIM)

        def setup():
            return (span_ids[None, :] <= pos[:, None])[:, None, None, :]

        return setup, torch.compile(layer, dynamic=False)

    if name.startswith("sdpa_"):
        backend = {"sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                   "sdpa_default": None}[name]

        def setup():
            keep = span_ids[None, :] <= pos[:, None]
            bias = torch.zeros(rows, 1, 1, span, dtype=torch.bfloat16, device=pos.device)
            return bias.masked_fill(~keep[:, None, None, :], float("-inf")).expand(rows, KV_HEADS, group, span)

        def layer(q, k, v, bias):
            qg = q.reshape(rows, KV_HEADS, group, HEAD_DIM)  # the group's query heads as query positions
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale)
            return out.reshape(rows, 1, HEADS, HEAD_DIM)

        return setup, layer

    if name == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        def mask_past(score, b, h, q_idx, kv_idx):
            return torch.where(kv_idx <= pos[b], score, -float("inf"))

        flex = torch.compile(flex_attention, dynamic=False)

        def layer(q, k, v, _):
            return flex(q, k, v, score_mod=mask_past, enable_gqa=True, scale=scale).transpose(1, 2)

        return (lambda: None), layer

    if name == "flex_block":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def within(b, h, q_idx, kv_idx):
            return kv_idx <= pos[b]

        block_mask = create_block_mask(within, B=rows, H=None, Q_LEN=1, KV_LEN=span, device=pos.device)
        flex = torch.compile(flex_attention, dynamic=False)

        def layer(q, k, v, _):
            return flex(q, k, v, block_mask=block_mask, enable_gqa=True, scale=scale).transpose(1, 2)

        return (lambda: None), layer

    if name == "flash_unmasked":
        def layer(q, k, v, _):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            return out.transpose(1, 2)

        return (lambda: None), layer
    raise ValueError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}")


def run_variant(torch, name: str, rows: int, span: int, inputs, reps: int) -> dict:
    keys, values, queries, pos = inputs
    scale = HEAD_DIM ** -0.5
    setup, layer = build_variant(torch, name, pos, span, scale)
    ks = [k[:rows, :, :span] for k in keys]
    vs = [v[:rows, :, :span] for v in values]

    def step():
        shared = setup()
        return [layer(queries[i], ks[i], vs[i], shared) for i in range(len(ks))]

    res: dict = {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        outs = step()  # compiles where the variant compiles
        res["first_call_s"] = round(time.perf_counter() - t0, 1)
        ref = reference(torch, queries[0], ks[0], vs[0], pos, scale)
        res["max_abs_err"] = float((outs[0].double() - ref).abs().max())
        if pos.device.type == "cuda":
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            from benchmarks.gpu_engine import time_replay_ms

            res["step_ms"] = round(time_replay_ms(graph, reps, warmup=3), 3)
            kv_bytes = len(ks) * 2 * rows * KV_HEADS * span * HEAD_DIM * 2
            res["kv_read_floor_ms"] = round(kv_bytes / (COPY_TB_S * 1e12) * 1e3, 3)
            res["tb_s"] = round(kv_bytes / (res["step_ms"] * 1e-3) / 1e12, 2)
            del graph
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--rows", type=int, nargs="+", default=None, help="default: 1 8 64 on cuda, 1 3 on cpu")
    p.add_argument("--span", type=int, default=None, help="attention span; default 768 on cuda, 48 on cpu")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    args = p.parse_args()
    import torch

    cuda = args.device == "cuda"
    rows_list = args.rows or ([1, 8, 64] if cuda else [1, 3])
    span = args.span or (768 if cuda else 48)
    # cpu: a check of the variants' agreement, on shapes small enough to be quick
    layers, max_len = (LAYERS, 2048) if cuda else (2, 64)
    slots = max(rows_list)
    device = torch.device(args.device)
    res: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                 "layers": layers, "span": span, "max_len": max_len, "runs": []}
    out = Path(args.out) / "gpu_attention_probe.json"
    for rows in rows_list:
        inputs = make_inputs(torch, rows, span, max_len, layers, slots, device, seed=rows)
        for name in args.variants.split(","):
            torch._dynamo.reset()
            row = {"variant": name, "rows": rows}
            try:
                row.update(run_variant(torch, name, rows, span, inputs, args.reps))
            except Exception as e:  # noqa: BLE001 - a variant that cannot run here is a result
                row["error"] = repr(e)[:300]
                row["trace"] = traceback.format_exc()[-1500:]
            res["runs"].append(row)
            save_json(out, res)
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        del inputs  # 7.5 GB on cuda: freed before the next batch size's buffers
        if cuda:
            torch.cuda.empty_cache()

    print(f"\ndecode attention, {layers} layers, span {span} ({res['device']}, torch {res['torch']}):")
    table = [{"variant": r["variant"], "rows": r["rows"], "step_ms": r.get("step_ms"),
              "kv_floor_ms": r.get("kv_read_floor_ms"), "TB/s": r.get("tb_s"),
              "max_abs_err": f"{r['max_abs_err']:.1e}" if "max_abs_err" in r else None,
              "error": (r.get("error") or "")[:60]} for r in res["runs"]]
    print_table(table, ["variant", "rows", "step_ms", "kv_floor_ms", "TB/s", "max_abs_err", "error"])


if __name__ == "__main__":
    main()
