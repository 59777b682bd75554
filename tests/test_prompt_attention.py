"""prompt_attention 'flash_multi_prompt' (slot_kv.prompt_kernels): the SDPA backends a prefill pass may use are
narrowed for passes of several prompts only, and the narrowing holds inside torch.compile's graphs, which is
where the engine's multi-prompt pass runs. On the CPU cuDNN does not exist, so a backend the CPU lacks stands
in for 'not cuDNN': a pass it reaches fails, a pass it does not reach runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend

from serve_app.engines import slot_kv


def _prefill(prompts: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # [prompts, heads, tokens, head dim], GQA as the 7B (4 query heads per KV head here 2)
    q = torch.randn(prompts, 4, 16, 8, generator=g)
    k = torch.randn(prompts, 2, 16, 8, generator=g)
    v = torch.randn(prompts, 2, 16, 8, generator=g)
    return q, k, v


def _attend(q, k, v):
    out, _ = slot_kv.slot_attention(None, q, k, v, None, scaling=8 ** -0.5)
    return out


def _engines_narrowing(monkeypatch) -> None:
    """The list use_prompt_attention('flash_multi_prompt') sets on CUDA, set here as it would be there
    (monkeypatch puts the process's own value back afterwards)."""
    monkeypatch.setattr(slot_kv, "_MULTI_PROMPT_BACKENDS", None)
    slot_kv.use_prompt_attention("flash_multi_prompt", "cuda")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_only_passes_of_several_prompts_are_narrowed(monkeypatch, compiled):
    def fresh():
        torch._dynamo.reset()  # the narrowing is read when a pass is traced
        return torch.compile(_attend, fullgraph=True) if compiled else _attend

    attend = fresh()
    monkeypatch.setattr(slot_kv, "_MULTI_PROMPT_BACKENDS", [SDPBackend.EFFICIENT_ATTENTION])  # none on the CPU
    one = attend(*_prefill(1))
    assert torch.allclose(one, _attend(*_prefill(1)), atol=1e-5)  # one prompt: torch's own pick
    with pytest.raises(Exception, match="(?i)no viable backend|no available kernel"):
        attend(*_prefill(2))
    # the engine's list (all but cuDNN) runs the same numbers as torch's pick
    attend = fresh()
    monkeypatch.setattr(slot_kv, "_MULTI_PROMPT_BACKENDS", None)
    picked = attend(*_prefill(3, seed=1))
    attend = fresh()
    _engines_narrowing(monkeypatch)
    assert torch.allclose(attend(*_prefill(3, seed=1)), picked, atol=1e-5)
    torch._dynamo.reset()


def test_flash_multi_prompt_leaves_cudnn_on_for_the_process_and_out_of_several_prompts_passes():
    check = ("import torch; from torch.nn.attention import SDPBackend\n"
             "from serve_app.engines import slot_kv\n"
             "slot_kv.use_prompt_attention('flash_multi_prompt', 'cuda')\n"
             "assert torch.backends.cuda.cudnn_sdp_enabled()\n"
             "assert SDPBackend.CUDNN_ATTENTION not in slot_kv._MULTI_PROMPT_BACKENDS\n"
             "assert SDPBackend.FLASH_ATTENTION == slot_kv._MULTI_PROMPT_BACKENDS[0]\n"
             "assert not torch.compiler.config.cache_key_tag\n")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
    # a CPU engine narrows nothing
    proc = subprocess.run([sys.executable, "-c", "from serve_app.engines import slot_kv\n"
                           "slot_kv.use_prompt_attention('flash_multi_prompt', 'cpu')\n"
                           "assert slot_kv._MULTI_PROMPT_BACKENDS is None"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
