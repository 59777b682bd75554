"""FP8 (e4m3) weights and activations for the decoder's linear layers.

Why: a batch-64 decode step of a 7B model streams its 15 GB of bf16 weights
from HBM, and a 512-token prefill pass is bound by bf16 tensor work; e4m3
halves the bytes and doubles the tensor rate (H100, graph-replayed GEMMs of
the 7B's shapes: 1.3-2.0x faster on every one, docs/gpu_notes.md run 114).

The scheme is vLLM's and torchao's dynamic FP8 with row-wise scales: each
weight is quantized once at load with one scale per output channel, each
activation row at run time with one scale of its own, and the product runs
in ``torch._scaled_mm`` (cuBLASLt/CUTLASS on sm89+; a reference kernel on
the CPU, which is only for checking). The bf16 checkpoint is the source: no
calibration, no quantized checkpoint. Under ``torch.compile`` the activation's
max/scale/cast fuses into the kernel that produced it (the RMSNorm or the
SiLU-and-multiply), so the extra pass over the activations is not paid twice.

Where the scales are applied (``scales``): "gemm" hands them to ``_scaled_mm``,
whose row-wise kernel on an H100 runs the 7B's decode shapes 1.06-1.76x slower
than its one-scale-per-tensor kernel (q/o at 64 rows 12.8 against 7.9 us, down
48.7 against 27.6; run 115); "epilogue" runs that per-tensor kernel with unit
scales and multiplies its output by the row and channel scales afterwards, an
elementwise step ``torch.compile`` fuses into the kernel after it (the residual
add, the rotary, the SiLU). Same numbers up to the bf16 rounding of the
unscaled product; no activation scale is shared across a batch's requests.
The engine's default is "epilogue" (HFEngineOptions.fp8_scales): in the engine
on an H100 a 64-row decode step took 5.88 ms against "gemm"'s 6.96 (run 120).

The LM head stays in the model's dtype, as vLLM keeps it by default: its
logits pick the tokens, and at 64 rows it is ~7 % of a step's GEMM time.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

# largest finite e4m3fn value
E4M3_MAX = 448.0
# an all-zero row (a padded batch row) must not divide by zero
_MIN_SCALE = 1e-12
# _scaled_mm's rule for the reduction and output dimensions
_DIM_MULTIPLE = 16
# where FP8Linear applies its scales: inside _scaled_mm's row-wise kernel, or after its per-tensor one
SCALES = ("gemm", "epilogue")
# modules never quantized, by attribute name
SKIP_NAMES = frozenset({"lm_head"})


def quantizable(name: str, out_features: int, in_features: int) -> bool:
    """Whether quantize_linears makes a linear layer of this attribute name and shape e4m3 (count_weights
    counts the same layers from a checkpoint's shapes)."""
    return name not in SKIP_NAMES and not out_features % _DIM_MULTIPLE and not in_features % _DIM_MULTIPLE


class FP8UnsupportedError(RuntimeError):
    """This device cannot run FP8 GEMMs (``torch._scaled_mm`` with row-wise scales)."""


def quantize_weight(weight, chunk_elements: int = 1 << 24):
    """(e4m3 weight [N, K], float32 scales [1, N]): one scale per output channel, so that channel's largest
    magnitude maps to E4M3_MAX. Converted about ``chunk_elements`` at a time (whole channels): the float32
    copies of a whole weight (two of them, 1.1 GB for the 7B's fused gate/up) would be most of the GPU's peak
    while an fp8 model loads layer by layer; a chunk's are 2 x 67 MB. The same numbers either way (a max is
    exact in any precision, and each element's conversion is the same)."""
    import torch

    w = weight.detach()
    scale = (w.abs().amax(dim=1).float() / E4M3_MAX).clamp(min=_MIN_SCALE)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    step = max(1, chunk_elements // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        rows = slice(start, start + step)
        q[rows] = (w[rows].float() / scale[rows, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale[None, :].contiguous()


def quantize_rows(x):
    """(e4m3 rows, float32 scales [M, 1]) of a 2-D activation, one scale per row (token)."""
    import torch

    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


@functools.cache
def fp8_linear_class():
    """The FP8Linear module class, made on first use so that importing this module does not import torch; one
    class for every caller."""
    import torch
    from torch import nn

    class FP8Linear(nn.Module):
        """A frozen ``nn.Linear`` whose weight is e4m3 with per-output-channel scales; inputs are quantized
        per row on each call and the product comes back in ``out_dtype``."""

        def __init__(self, linear: nn.Linear, out_dtype, scales: str = "gemm"):
            super().__init__()
            if scales not in SCALES:
                raise ValueError(f"scales must be one of {SCALES}; got {scales!r}")
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.out_dtype = out_dtype
            self.scales = scales
            q, scale = quantize_weight(linear.weight)
            self.weight = nn.Parameter(q, requires_grad=False)
            self.register_buffer("weight_scale", scale)
            self.register_buffer("unit_scale", torch.ones(() if scale.is_cuda else scale.shape, device=scale.device))
            self.bias = (nn.Parameter(linear.bias.detach().to(out_dtype), requires_grad=False)
                         if linear.bias is not None else None)

        def forward(self, x):
            lead = x.shape[:-1]
            xq, x_scale = quantize_rows(x.reshape(-1, self.in_features))
            # the weight is [N, K] row-major, so .t() is the column-major [K, N] _scaled_mm wants
            if self.scales == "gemm":
                out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale,
                                       out_dtype=self.out_dtype)
            else:
                # unit scales pick the per-tensor kernel on a GPU; on the CPU they go through the row-wise one,
                # as torch's CPU per-tensor kernel is ~40x slower
                unit_a = self.unit_scale if self.unit_scale.dim() == 0 else torch.ones_like(x_scale)
                out = torch._scaled_mm(xq, self.weight.t(), scale_a=unit_a, scale_b=self.unit_scale,
                                       out_dtype=self.out_dtype)
                out = (out.float() * x_scale * self.weight_scale).to(self.out_dtype)
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*lead, self.out_features)

        def extra_repr(self) -> str:
            return (f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise, "
                    f"scales in the {self.scales}")

    return FP8Linear


def check_device(device, out_dtype=None, scales: str = "gemm") -> None:
    """Raises FP8UnsupportedError unless an FP8Linear with these settings runs on ``device`` (row-wise scales in
    the GEMM take only a bf16 output on CUDA, for one)."""
    import torch
    from torch import nn

    out_dtype = out_dtype or torch.bfloat16
    if torch.device(device).type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise FP8UnsupportedError(
                f"quantization 'fp8' needs a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")
    try:
        probe = fp8_linear_class()(nn.Linear(32, 16, device=device, dtype=out_dtype), out_dtype, scales)
        probe(torch.ones(16, 32, device=device, dtype=out_dtype))
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise FP8UnsupportedError(f"quantization 'fp8' (fp8_scales {scales!r}, dtype {out_dtype}): torch "
                                  f"{torch.__version__} cannot run a scaled e4m3 GEMM on {device}: {e}") from e


def quantize_linears(model, out_dtype, scales: str = "gemm", device=None) -> int:
    """Replaces each ``nn.Linear`` of ``model`` (in place), except those named in SKIP_NAMES and those whose
    dimensions _scaled_mm cannot take, by an FP8Linear applying its scales as ``scales`` says; returns how many
    were replaced. With ``device``, each layer is moved there just before it is quantized, so a model loaded on
    the CPU reaches the GPU as e4m3 (the GPU's peak: the FP8 layers so far plus one layer in the model's dtype);
    the layers it leaves as they are stay where they were. Call after ``fuse_projections``: a fused weight gets
    its scales per output channel all the same."""
    import torch
    from torch import nn

    fp8_linear = fp8_linear_class()
    # names, not modules: no reference here keeps a replaced bf16 weight alive, so each is freed as its layer
    # is replaced and the peak stays one layer over the bf16 model, not both models side by side
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and name not in SKIP_NAMES]
    replaced = kept = 0
    for parent, name in targets:
        linear = getattr(parent, name)
        if not quantizable(name, linear.out_features, linear.in_features):
            kept += 1
        else:
            if device is not None:
                linear.to(device)
            setattr(parent, name, fp8_linear(linear, out_dtype, scales))
            replaced += 1
        linear = None
    if kept:
        log.info("fp8: %d linear layers kept in %s (dimensions not multiples of %d)", kept, out_dtype,
                 _DIM_MULTIPLE)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the replaced weights' memory goes back to the KV cache's budget
    return replaced
