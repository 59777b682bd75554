"""The first pass of each new multi-prompt prefill shape: which part of it pays the 31-78 ms.

    python benchmarks/gpu_first_use_probe.py [--device cuda|cpu] [--prompt-attention CHOICE] [--out DIR]

Why: in every engine run since the per-pass GPU sums (docs/gpu_notes.md, runs 111-139, twelve of them on
H100s and H200s) the warm-up load's multi-prompt prefill passes cost more than the same kinds later: the
passes of 2, 3 and 4 prompts of 512 tokens +31 to +78 ms per prompt count over their later mean (run 138:
prefill_3p once at 89.6 ms against 34.6). Those passes are the compiled pass with dynamic shapes, not a
captured graph, so the first time a (prompts, length) shape runs it pays whatever is built or allocated per
shape; the one-prompt and mixed passes are graphs captured before ready and show nothing. Run 139's stack paid it inside
a measured load (its first 3-prompt pass, four requests ~80 ms late at 32 concurrent), which the engine
alone had paid in its warm-up load. Which part pays decides the remedy (a backend, a warm-up, or buckets),
so each candidate is timed alone:

- ``sdpa_default`` / ``sdpa_flash`` / ``sdpa_cudnn`` / ``sdpa_efficient``: the prefill's attention call
  (slot_kv.slot_attention's: ``[n, 28, L, 128]`` queries, ``[n, 4, L, 128]`` keys and values, causal, GQA)
  with torch's pick or one backend forced; cuDNN builds an execution graph per shape (pytorch#191576 found
  a rebuild at ~42 ms a call), flash has nothing to build. ``sdpa_engine``: torch's pick after the engine's
  own choice (HFEngineOptions.prompt_attention, or --prompt-attention), in the engine's own context for a pass
  of that many prompts (slot_kv.prompt_kernels: 'flash_multi_prompt' leaves cuDNN out of passes of several).
  ``sdpa_engine_compiled``: the same through the engine's own attention (slot_kv.slot_attention) compiled as its
  prefill pass is, with dynamic shapes warmed at (1, 19) and (2, 37), so a new shape reuses the compile and
  shows what the compiled pass runs; on CUDA each row names the attention kernel the profiler saw.
- ``gemm``: the pass's four GEMM shapes at M = n x L (cuBLAS picks an algorithm per shape).
- ``alloc``: the activations a pass of n x L tokens allocates, first from a fresh caching allocator and then
  again after freeing them (the first needs cudaMalloc).

Each arm runs in a fresh process, since every one of these caches lives as long as its process, and times
each shape's first call and its second (host wall time to a synchronize). An arm's first shape also pays
the process's first launch of each kernel (CUDA loads modules lazily); its later shapes are the test: a
per-shape cost shows as a first call well over the second. The default arm also records which backend
torch picks. Prints a table last and writes gpu_first_use_probe.json. No model, no Ray.
On cpu (tiny shapes) it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # serve_app, for the sdpa_engine arm run as a script

ARMS = ("sdpa_default", "sdpa_engine", "sdpa_engine_compiled", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "gemm",
        "alloc")
# (prompts, tokens each): the benchmark's fixed 512-token prompts in passes of 2-4, and two other lengths,
# as real prompts of mixed lengths would give; then one prompt, which 'flash_multi_prompt' leaves to torch
SHAPES = ((2, 512), (3, 512), (4, 512), (2, 448), (4, 320), (1, 512))
# the 7B's (DeepSeek-R1-Distill-Qwen-7B shape) heads, KV heads, head dim, hidden, ffn
FULL_DIMS = (28, 4, 128, 3584, 18944)
STEADY_CALLS = 20
CPU_DIMS = (4, 2, 8, 32, 64)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed_ms(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return 1000 * (time.perf_counter() - t0)


def _backend_names() -> dict[int, str]:
    from torch.nn.attention import SDPBackend

    return {int(v): k for k, v in SDPBackend.__members__.items()}


def _attention_kernel(call) -> str:
    """Which attention kernel one call launched, from the CUDA profiler's kernel names: cuDNN's are named
    cudnn*, torch's flash flash_fwd*; 'other' for neither (the math path's GEMMs and softmax)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if any("cudnn" in n for n in names):
        return "cudnn"
    return "flash" if any("flash" in n for n in names) else "other"


def run_arm(arm: str, device: str, shapes, dims, prompt_attention: str | None = None) -> dict:
    """One arm in this (fresh) process: per shape, its first call's and second call's wall ms.
    ``prompt_attention``: the engine's choice for the sdpa_engine arm (None: HFEngineOptions' default)."""
    import contextlib

    import torch
    import torch.nn.functional as F

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; valid: {', '.join(ARMS)}")
    heads, kv_heads, head_dim, hidden, ffn = dims
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.ones(1, device=device)  # the context, outside any timing
    compiled_arm = arm == "sdpa_engine_compiled"

    def qkv(n: int, length: int):
        """A pass's queries, keys and values (v apart from k: aliased inputs are a guard of their own); for the
        compiled arm marked as the engine's pass has them, its prompts and their length varying."""
        q = torch.randn(n, heads, length, head_dim, device=device, dtype=dtype)
        k = torch.randn(n, kv_heads, length, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        if compiled_arm:
            for t in (q, k, v):
                if n > 1:
                    torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(t, 2)
        return q, k, v

    kernels = lambda prompts: contextlib.nullcontext()  # noqa: E731
    if arm in ("sdpa_engine", "sdpa_engine_compiled"):
        from serve_app.engines.options import HFEngineOptions
        from serve_app.engines.slot_kv import prompt_kernels, use_prompt_attention

        use_prompt_attention(prompt_attention or HFEngineOptions().prompt_attention, torch.device(device))
        kernels = prompt_kernels
    if compiled_arm:
        from serve_app.engines.slot_kv import slot_attention

        def attend(q, k, v):
            return slot_attention(None, q, k, v, None, scaling=head_dim ** -0.5)[0]

        compiled = torch.compile(attend)
        for n, length in ((1, 19), (2, 37)):  # the engine's prefill warm-up shapes (compile_prefill_pass)
            compiled(*qkv(n, length))
        _sync(device)
    rows: list[dict] = []
    for n, length in shapes:
        row: dict = {"prompts": n, "tokens": length}
        try:
            if arm.startswith("sdpa_"):
                from torch.nn.attention import SDPBackend, sdpa_kernel

                q, k, v = qkv(n, length)
                forced = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                          "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}.get(arm)
                if forced is None and not compiled_arm and device == "cuda":  # sdpa_default, sdpa_engine
                    with kernels(n):
                        picked = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
                    row["picked"] = _backend_names().get(int(picked), str(picked))

                def call():
                    if compiled_arm:
                        compiled(q, k, v)
                    elif forced is None:
                        with kernels(n):
                            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    else:
                        with sdpa_kernel(forced):
                            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            elif arm == "gemm":
                x = torch.randn(n * length, hidden, device=device, dtype=dtype)
                up = torch.randn(hidden, 2 * ffn, device=device, dtype=dtype)  # gate and up, as one
                down = torch.randn(ffn, hidden, device=device, dtype=dtype)
                qkv = torch.randn(hidden, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
                o = torch.randn(heads * head_dim, hidden, device=device, dtype=dtype)
                h = torch.randn(n * length, ffn, device=device, dtype=dtype)

                def call():
                    x @ qkv, x @ o, x @ up, h @ down
            else:  # alloc
                def call():
                    # what one layer of the pass holds at its peak: hidden states, gate-and-up, the SiLU product
                    held = [torch.empty(n * length, hidden, device=device, dtype=dtype),
                            torch.empty(n * length, 2 * ffn, device=device, dtype=dtype),
                            torch.empty(n * length, ffn, device=device, dtype=dtype)]
                    held.clear()  # all three at once, as the pass's peak; then back to the allocator's cache
            row["first_ms"] = round(_timed_ms(call, device), 3)
            if compiled_arm and device == "cuda":
                row["picked"] = _attention_kernel(call)
            row["second_ms"] = round(_timed_ms(call, device), 3)
            # the kernel's own speed, launches overlapped: whether a backend without a first-use cost is slower
            row["steady_ms"] = round(_timed_ms(lambda: [call() for _ in range(STEADY_CALLS)], device)
                                     / STEADY_CALLS, 4)
        except (RuntimeError, NotImplementedError) as e:  # a backend that refuses a shape is a result
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return {"arm": arm, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--prompt-attention", choices=("flash", "flash_multi_prompt", "auto"),
                   help="the engine's choice for the sdpa_engine arm (default: HFEngineOptions' own)")
    p.add_argument("--arm", choices=ARMS, help="run one arm in this process and print its JSON (the parent's "
                                                "way of giving each arm a fresh process)")
    args = p.parse_args()
    dims = FULL_DIMS if args.device == "cuda" else CPU_DIMS
    shapes = SHAPES if args.device == "cuda" else tuple((n, max(4, t // 64)) for n, t in SHAPES)
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.device, shapes, dims, args.prompt_attention)))
        return
    import torch

    from serve_app.engines.options import HFEngineOptions

    results: dict = {"device": args.device, "dims": dims, "torch": torch.__version__, "arms": [],
                     "prompt_attention": args.prompt_attention or HFEngineOptions().prompt_attention}
    if args.device == "cuda":
        results.update(gpu=torch.cuda.get_device_name(0), cudnn=torch.backends.cudnn.version())
    for arm in ARMS:
        choice = ["--prompt-attention", args.prompt_attention] if args.prompt_attention else []
        proc = subprocess.run([sys.executable, __file__, "--arm", arm, "--device", args.device, *choice],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            results["arms"].append({"arm": arm, "error": proc.stderr.strip()[-300:]})
            continue
        results["arms"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_first_use_probe.json").write_text(json.dumps(results, indent=2))
    print(f"{results.get('gpu', args.device)}; torch {results['torch']}; cuDNN {results.get('cudnn', '-')}; "
          f"the engine's prompt_attention {results['prompt_attention']}")
    print(f"{'arm':<22}{'prompts x tokens':>18}{'first ms':>10}{'second ms':>11}{'steady ms':>11}  note")
    for a in results["arms"]:
        if "rows" not in a:
            print(f"{a['arm']:<22}{'':>18}{'':>10}{'':>11}{'':>11}  failed: {a['error'][-120:]}")
            continue
        for r in a["rows"]:
            shape = f"{r['prompts']} x {r['tokens']}"
            if "error" in r:
                print(f"{a['arm']:<22}{shape:>18}{'':>10}{'':>11}{'':>11}  {r['error'][:80]}")
            else:
                print(f"{a['arm']:<22}{shape:>18}{r['first_ms']:>10.2f}{r['second_ms']:>11.2f}"
                      f"{r['steady_ms']:>11.3f}  {r.get('picked', '')}")


if __name__ == "__main__":
    main()
