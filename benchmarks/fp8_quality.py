"""How far quantization 'fp8' moves a real model's answers (the embedded SmolLM2 by default), on the CPU.

    python benchmarks/fp8_quality.py [--model DIR_OR_EMBEDDED] [--tokens 48] [--out DIR]

For each prompt the full-precision model (float32 on the CPU, the engine's default there) answers greedily;
the same model with its decoder's linear layers quantized as the engine does it (fuse_projections, then
serve_app.engines.fp8.quantize_linears) is then fed that answer token by token (teacher forcing) and compared
position by position: how often its top token is the full model's, the KL divergence of its next-token
distribution from the full model's, and its own greedy answer's first token that differs. The same figures for
the model in bfloat16 (the engine's dtype on a GPU) anchor them: what bf16 alone moves. torch's CPU
``_scaled_mm`` computes the row-wise scaled e4m3 product the GPU's kernel computes, so these are the scheme's
numbers; gpu_decode_probe.py --fp8 reports the GPU kernel's error on the 7B's shapes. A 135M model is more
sensitive to quantization than a 7B one: its figures bound what a larger model loses from above, they do not
predict it. Prints a table last, writes fp8_quality.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.",
    "What does a bank do with deposits?",
    "Write a haiku about the sea.",
    "What is the largest planet in the solar system?",
    "How many days are in a leap year?",
    "What is a hospital triage nurse's job?",
]


def quantized(full):
    """(a copy of ``full`` with its linear layers quantized as the engine quantizes them, how many)."""
    import torch

    from serve_app.engines.fp8 import quantize_linears
    from serve_app.engines.fused import fuse_projections

    quant = copy.deepcopy(full)
    fuse_projections(quant)
    return quant, quantize_linears(quant, torch.float32)


def compare(full, quant, tok, prompt: str, tokens: int) -> dict:
    """The full model's greedy answer to ``prompt`` and ``quant``'s, and ``quant`` teacher-forced over the full
    model's: same top token, KL of its next-token distribution from the full model's, first differing token."""
    import torch

    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    n = ids.shape[1]
    with torch.no_grad():
        ref = full.generate(ids, max_new_tokens=tokens, do_sample=False)
        own = quant.generate(ids, max_new_tokens=tokens, do_sample=False)
        lf = full(ref).logits[0, n - 1:-1].float().log_softmax(-1)
        lq = quant(ref).logits[0, n - 1:-1].float().log_softmax(-1)
    target = ref[0, n:]
    same = (lq.argmax(-1) == target)
    kl = (lf.exp() * (lf - lq)).sum(-1)
    a, b = ref[0, n:].tolist(), own[0, n:].tolist()
    diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diverge is None and len(a) != len(b):
        diverge = min(len(a), len(b))
    return {"prompt": prompt, "tokens": len(a), "top1_agree": round(same.float().mean().item(), 4),
            "kl_mean": round(kl.mean().item(), 5), "kl_max": round(kl.max().item(), 4),
            "first_diverging_token": diverge,
            "full": tok.decode(a, skip_special_tokens=True), "answer": tok.decode(b, skip_special_tokens=True)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="embedded:smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=48, help="greedy answer length per prompt")
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve_app.engines.model_store import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    quant, layers = quantized(full)
    half = copy.deepcopy(full).to(torch.bfloat16)
    t0 = time.perf_counter()
    res = {"model": args.model, "torch": torch.__version__, "quantized_layers": layers, "tokens": args.tokens}
    for arm, model in (("fp8", quant), ("bf16", half)):
        rows = [compare(full, model, tok, q, args.tokens) for q in PROMPTS]
        res[arm] = {"rows": rows,
                    "top1_agree_mean": round(sum(r["top1_agree"] for r in rows) / len(rows), 4),
                    "kl_mean": round(sum(r["kl_mean"] for r in rows) / len(rows), 5),
                    "identical_answers": sum(r["first_diverging_token"] is None for r in rows)}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_quality.json").write_text(json.dumps(res, indent=2))
    for r, h in zip(res["fp8"]["rows"], res["bf16"]["rows"]):
        print(f"\n{r['prompt']}\n  float32: {r['full']!r}\n  fp8:     {r['answer']!r}\n  bf16:    {h['answer']!r}")
    print(f"\n{args.model}: {layers} linear layers as e4m3 (row-wise scales), and the model in bfloat16, each "
          f"teacher-forced on the float32 model's {args.tokens}-token greedy answers (fp8 / bf16)")
    print(f"{'prompt':<42}{'top-1 same':>16}{'KL mean':>16}{'diverges at':>14}")

    def div(r):
        return "never" if r["first_diverging_token"] is None else str(r["first_diverging_token"])

    for r, h in zip(res["fp8"]["rows"], res["bf16"]["rows"]):
        print(f"{r['prompt'][:41]:<42}{r['top1_agree']:>8.3f} / {h['top1_agree']:.3f}"
              f"{r['kl_mean']:>8.4f} / {h['kl_mean']:.4f}{div(r):>7} / {div(h)}")
    f, h = res["fp8"], res["bf16"]
    print(f"{'mean (answers the same throughout)':<42}{f['top1_agree_mean']:>8.3f} / {h['top1_agree_mean']:.3f}"
          f"{f['kl_mean']:>8.4f} / {h['kl_mean']:.4f}{f['identical_answers']:>7} / {h['identical_answers']}")


if __name__ == "__main__":
    main()
