"""quantization 'fp8' (serve_app/engines/fp8.py) on the CPU.

torch's CPU ``_scaled_mm`` is a reference kernel for the same row-wise scaled
e4m3 product the GPU's runs, so the scheme's numbers and the engine's wiring
are checked here on real weights (SmolLM2); its speed needs a GPU
(benchmarks/gpu_decode_probe.py --fp8, gpu_engine.py --set quantization=...).
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from pydantic import ValidationError

from serve_app.engines.fp8 import E4M3_MAX, check_device, quantize_linears, quantize_rows, quantize_weight
from serve_app.engines.fused import fuse_projections

def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=500,
                                        max_position_embeddings=256)).eval()


def test_weight_scales_are_per_output_channel_and_round_trip_within_e4m3_precision():
    torch.manual_seed(0)
    w = torch.randn(48, 32) * torch.logspace(-3, 1, 48)[:, None]  # channels four decades apart
    q, scale = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (1, 48)
    # each channel's largest magnitude lands on e4m3's largest value
    torch.testing.assert_close(q.float().abs().amax(dim=1), torch.full((48,), E4M3_MAX))
    back = q.float() * scale.t()
    # 3 mantissa bits: within 2^-4 of each value (relative), whatever the channel's scale
    big = w.abs() > w.abs().amax(dim=1, keepdim=True) / 64
    assert ((back - w).abs()[big] <= w.abs()[big] / 16 + 1e-12).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_converted_in_chunks_is_the_weight_converted_whole(dtype):
    torch.manual_seed(3)
    w = (torch.randn(70, 48) * torch.logspace(-2, 2, 70)[:, None]).to(dtype)
    whole_w = w.float()
    whole_scale = (whole_w.abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
    whole_q = (whole_w / whole_scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    for chunk in (1, 48 * 16, 48 * 64, 1 << 24):  # a row at a time, 16 rows, 64 rows, all at once
        q, scale = quantize_weight(w, chunk_elements=chunk)
        assert torch.equal(scale[0], whole_scale)
        assert torch.equal(q.view(torch.uint8), whole_q.view(torch.uint8)), chunk


def test_a_zero_row_quantizes_to_zeros_not_nans():
    x = torch.zeros(3, 32)
    x[1] = torch.linspace(-2, 2, 32)
    q, scale = quantize_rows(x)
    assert scale.shape == (3, 1)
    assert torch.isfinite(q.float()).all()
    assert (q[0].float() == 0).all() and (q[2].float() == 0).all()


def test_quantized_layers_compute_the_product_within_fp8_error_and_keep_the_lm_head():
    model = _tiny_qwen2()
    ref = copy.deepcopy(model)
    fuse_projections(model)
    # per layer: fused q/k/v, o, fused gate/up, down
    assert quantize_linears(model, torch.float32) == 4 * 2
    assert type(model.lm_head) is torch.nn.Linear
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.bias is not None  # Qwen2's q/k/v biases kept
    ids = torch.randint(0, 500, (2, 11))
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < 0.05  # quantized (not a copy), yet near the full-precision logits


def test_scales_after_the_gemm_give_the_numbers_scales_inside_it_do():
    torch.manual_seed(1)
    model = _tiny_qwen2()
    fuse_projections(model)
    inside, after = copy.deepcopy(model), copy.deepcopy(model)
    quantize_linears(inside, torch.float32, "gemm")
    quantize_linears(after, torch.float32, "epilogue")
    assert {m.scales for m in after.modules() if hasattr(m, "scales")} == {"epilogue"}
    ids = torch.randint(0, 500, (3, 9))
    with torch.no_grad():
        torch.testing.assert_close(after(ids).logits, inside(ids).logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="scales must be one of"):
        quantize_linears(_tiny_qwen2(), torch.float32, "both")


def test_layers_scaled_mm_cannot_take_stay_unquantized():
    from torch import nn

    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 20), nn.Linear(20, 32))
    assert quantize_linears(model, torch.float32) == 1
    assert [type(m).__name__ for m in model] == ["FP8Linear", "Linear", "Linear"]
    out = model(torch.randn(2, 5, 32))
    assert out.shape == (2, 5, 32)


def test_with_a_device_each_layer_moves_there_as_it_is_quantized_and_the_rest_stays():
    """The engine loads an fp8 model on the CPU and quantizes it onto the GPU layer by layer, so the GPU never
    holds the model's bf16 linear weights whole; "meta" stands in for the GPU here."""
    model = _tiny_qwen2()
    fuse_projections(model)
    assert quantize_linears(model, torch.float32, device="meta") == 4 * 2
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        on_meta = ".qkv_proj." in name or ".o_proj." in name or ".gate_up_proj." in name or ".down_proj." in name
        assert t.device.type == ("meta" if on_meta else "cpu"), name
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 (compute capability 8.9+)")
@pytest.mark.asyncio
async def test_an_fp8_engine_never_holds_the_bf16_linear_weights_on_the_gpu(embedded_model_dir):
    from transformers import AutoModelForCausalLM

    from serve_app.engines.registry import create_engine

    bf16 = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.bfloat16, local_files_only=True)
    bf16_bytes = sum(p.numel() * p.element_size() for p in bf16.parameters())
    linear_bytes = sum(m.weight.numel() * 2 for n, m in bf16.named_modules()
                       if type(m) is torch.nn.Linear and n != "lm_head")
    del bf16
    torch.cuda.reset_peak_memory_stats()
    eng = create_engine("hf", {"device": "cuda", "kv_cache": "dynamic", "max_num_seqs": 2, "max_model_len": 256,
                               "max_kv_tokens": 512, "quantization": "fp8"})
    await eng.start()
    try:
        # the load's peak stays below the bf16 model by about half its linear weights (the e4m3 saving)
        assert torch.cuda.max_memory_allocated() < bf16_bytes - 0.4 * linear_bytes
    finally:
        await eng.shutdown()


def test_check_device_passes_on_the_cpu():
    check_device("cpu")


def test_a_kernel_torch_refuses_is_a_clear_error_before_any_layer_changes(monkeypatch):
    """On CUDA, _scaled_mm's row-wise kernel takes only a bf16 output: a float16 engine must fail at start
    naming the setting, not at its first request. torch's own refusal stands in here (the CPU kernel takes
    every dtype)."""
    from serve_app.engines.fp8 import FP8UnsupportedError

    def refuse(*args, **kwargs):
        raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.raises(FP8UnsupportedError, match=r"fp8_scales 'gemm', dtype torch.float16.*Only bf16"):
        check_device("cpu", torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_check_device_names_the_gpu_when_it_has_no_fp8():
    from serve_app.engines.fp8 import FP8UnsupportedError

    if torch.cuda.get_device_capability() >= (8, 9):
        check_device("cuda")
    else:
        with pytest.raises(FP8UnsupportedError, match="compute capability 8.9"):
            check_device("cuda")


def test_quantization_option_is_validated():
    from serve_app.config import VariantConfig
    from serve_app.engines.options import HFEngineOptions

    assert HFEngineOptions(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValidationError, match="quantization"):
        HFEngineOptions(quantization="int4")
    assert HFEngineOptions(quantization="fp8").fp8_scales == "epilogue"  # measured faster (gpu_notes run 120)
    assert HFEngineOptions(quantization="fp8", fp8_scales="gemm").fp8_scales == "gemm"
    with pytest.raises(ValidationError, match="fp8_scales 'gemm' applies to quantization 'fp8'"):
        HFEngineOptions(fp8_scales="gemm")
    # an unquantized engine's options, dumped and validated again as they travel to its process, stay valid
    plain = HFEngineOptions()
    assert HFEngineOptions.model_validate(plain.model_dump()) == plain
    with pytest.raises(ValidationError, match="quantization 'fp8' runs on one rank"):
        VariantConfig(name="a", tensor_parallel_size=2,
                      engine={"backend": "hf", "options": {"device": "cpu", "quantization": "fp8"}})


def test_quantized_smollm2_stays_close_to_the_full_precision_model(embedded_model_dir):
    """Teacher-forced over the full model's own greedy answers: the quantized one picks the same next token
    at most positions and its distribution stays close (benchmarks/fp8_quality.py's comparison, on two prompts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.fp8_quality import compare, quantized

    tok = AutoTokenizer.from_pretrained(embedded_model_dir, local_files_only=True)
    full = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32,
                                                local_files_only=True).eval()
    fp8, layers = quantized(full)
    assert layers == 4 * full.config.num_hidden_layers
    rows = [compare(full, fp8, tok, q, 16) for q in ("What is the capital of France?", "Name three primary colors.")]
    agree, kls = [r["top1_agree"] for r in rows], [r["kl_mean"] for r in rows]
    assert min(agree) >= 0.75, agree
    assert 0 < max(kls) < 0.2, kls


@pytest.mark.asyncio
@pytest.mark.parametrize("kv_cache,scales", [("dynamic", "gemm"), ("static", "gemm"), ("static", "epilogue")])
async def test_engine_with_fp8_answers_a_real_question(embedded_model_dir, kv_cache, scales):
    from serve_app.engines.base import GenerationRequest, SamplingParams
    from serve_app.engines.registry import create_engine

    eng = create_engine("hf", {"device": "cpu", "max_num_seqs": 4, "max_model_len": 512, "kv_cache": kv_cache,
                               "quantization": "fp8", "fp8_scales": scales})
    await eng.start()
    try:
        assert {getattr(m, "scales", None) for m in eng.model.modules() if type(m).__name__ == "FP8Linear"} \
            == {scales}
        ids = eng.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
        text = ""
        async for c in eng.generate(GenerationRequest("q", ids, SamplingParams(max_tokens=12, temperature=0))):
            text += c.text
        assert "Paris" in text
    finally:
        await eng.shutdown()


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("scales", ["gemm", "epilogue"])
def test_the_compiled_decode_step_runs_fp8_layers_with_the_eager_results(scales):
    """The engine compiles its decode step with FP8Linear inside (the activation's quantization and, with
    'epilogue', the scales' multiply fuse into Inductor's kernels around the extern _scaled_mm): same logits
    as the eager step in every bucket, from one compile (Inductor's C++ backend stands in for Triton)."""
    from torch._dynamo.utils import counters

    from serve_app.engines.slot_kv import ATTENTION_NAME, SlotDecoder, register_attention

    register_attention()
    model = _tiny_qwen2()
    model.set_attn_implementation(ATTENTION_NAME)
    fuse_projections(model)
    quantize_linears(model, torch.float32, scales)
    decs = [SlotDecoder(model, num_slots=4, max_len=64, dtype=torch.float32, device=torch.device("cpu"),
                        use_graphs=False, batch_sizes=[1, 2, 4], span_step=32, compile_step=c) for c in (False, True)]
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = decs
    with torch.inference_mode():
        compiled.compile()
        graphs = counters["stats"]["unique_graphs"]
        for dec in decs:
            dec.prefill([[5 + i] * (3 + i) for i in range(4)], list(range(4)), 0)
            dec.positions.copy_(torch.tensor([3 + i for i in range(4)]))
        for rows in compiled.batch_sizes:
            for span in compiled.spans:
                for dec in decs:
                    dec.tokens.copy_(torch.arange(100, 104))
                torch.testing.assert_close(compiled._step(rows, span), eager._step(rows, span), rtol=1e-3, atol=1e-3)
    assert counters["stats"]["unique_graphs"] == graphs
