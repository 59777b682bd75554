"""Fused projections for Llama-family decoder layers (Llama, Qwen2, Mistral).

Why: at batch 1 a decode step is a string of small GEMMs and elementwise
kernels. Three query/key/value projections read the same input and so do the
MLP's gate and up projections; one GEMM over the concatenated weights reads
the same bytes with fewer, larger kernels (the key and value projections of a
GQA model are small enough to run far below the memory bandwidth on their
own). vLLM and TensorRT-LLM load these weights fused for the same reason.

The fused forwards below compute exactly what transformers' forwards compute
(same rotary helper of the model's own module, same attention interface, same
cache ``update`` call); only the projections are merged. Modules of any other
class are left as they are: a model this module does not know runs unfused.
Tensor-parallel shards are never fused (transformers' ``tp_plan`` splits
``q_proj``/``gate_proj`` by name).
"""

from __future__ import annotations

import functools
import logging
import sys

log = logging.getLogger(__name__)

# attention / MLP classes whose forward matches the fused ones below (checked in transformers 5.17)
_ATTENTION_CLASSES = {"LlamaAttention", "Qwen2Attention", "MistralAttention"}
_MLP_CLASSES = {"LlamaMLP", "Qwen2MLP", "MistralMLP"}


def _merged_linear(parts):
    import torch
    from torch import nn

    first = parts[0]
    bias = first.bias is not None
    merged = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=bias,
                       device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        merged.weight.copy_(torch.cat([p.weight for p in parts], dim=0))
        if bias:
            merged.bias.copy_(torch.cat([p.bias for p in parts], dim=0))
    return merged


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                       **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    q = q.view(hidden_shape).transpose(1, 2)
    k = k.view(hidden_shape).transpose(1, 2)
    v = v.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = self.rotary_fn(q, k, cos, sin)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.eager_fn)
    extra = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
    out, weights = interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **extra, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _mlp_forward(self, x):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


@functools.cache
def _fused_class(cls, forward):
    """``cls`` with ``forward`` as its forward. A fused module takes this class rather than a forward bound to
    itself in its ``__dict__``: that bound method is a reference cycle, so a dropped model's fused layers (all
    of a 7B's decoder weights) stayed on the GPU until a full garbage collection (found through run 119)."""
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                        "__qualname__": f"{cls.__qualname__}[fused]"})


def fuse_projections(model) -> int:
    """Merges q/k/v and gate/up projections in place; returns how many modules were fused."""
    fused = 0
    for module in model.modules():
        name = type(module).__name__
        if name in _ATTENTION_CLASSES and not hasattr(module, "qkv_proj"):
            source = sys.modules[type(module).__module__]
            parts = [module.q_proj, module.k_proj, module.v_proj]
            module.qkv_proj = _merged_linear(parts)
            module.qkv_sizes = [p.out_features for p in parts]
            module.rotary_fn = source.apply_rotary_pos_emb
            module.eager_fn = source.eager_attention_forward
            del module.q_proj, module.k_proj, module.v_proj
            module.__class__ = _fused_class(type(module), _attention_forward)
            fused += 1
        elif name in _MLP_CLASSES and not hasattr(module, "gate_up_proj"):
            module.gate_up_proj = _merged_linear([module.gate_proj, module.up_proj])
            del module.gate_proj, module.up_proj
            module.__class__ = _fused_class(type(module), _mlp_forward)
            fused += 1
    if not fused:
        log.info("fuse_projections: no known Llama-family modules in %s; running unfused", type(model).__name__)
    return fused
