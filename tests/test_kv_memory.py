"""The KV cache's memory check (serve_app/engines/memory.py): the sizes, the
suggested settings, and an engine on the real SmolLM2 refusing a cache that
does not fit before it allocates anything."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.engines.memory import Budget, KVLayout, check_static, check_tokens, device_budget
from serve_app.errors import EngineNotReadyError, KVCacheTooLargeError

GiB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent


def _qwen7b_config():
    from transformers import Qwen2Config

    # DeepSeek-R1-Distill-Qwen-7B's shape
    return Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064)


def test_a_token_of_the_7b_takes_56_kib_in_bf16_and_a_rank_its_share_of_the_heads():
    cfg = _qwen7b_config()
    # 28 layers x (keys + values) x 4 KV heads x 128 dims x 2 bytes
    assert KVLayout.of(cfg, 2).bytes_per_token == 28 * 2 * 4 * 128 * 2 == 57_344
    assert KVLayout.of(cfg, 2, tensor_parallel_size=2).bytes_per_token == 57_344 // 2
    # 8 ranks over 4 KV heads: each rank still holds a whole head
    assert KVLayout.of(cfg, 2, tensor_parallel_size=8).kv_heads == 1


def _suggested(message: str, name: str) -> int:
    return int(re.search(rf"{name} <= (\d+)", message).group(1))


@pytest.mark.parametrize("slots,tokens,spare", [(64, 32768, 0), (96, 8193, 1), (9, 100_000, 1)])
def test_a_cache_over_budget_names_the_largest_max_model_len_and_max_num_seqs_that_fit(slots, tokens, spare):
    layout = KVLayout.of(_qwen7b_config(), 2)
    budget = Budget(40 * GiB + 12_345, "left on the test GPU", knob="gpu_memory_utilization")
    assert check_static(layout, 1, tokens, budget, spare) == layout.bytes_per_token * tokens
    with pytest.raises(KVCacheTooLargeError) as e:
        check_static(layout, slots, tokens, budget, spare)
    msg = str(e.value)
    assert e.value.status_code == 503 and e.value.code == "kv_cache_too_large"
    assert f"{slots} sequences x {tokens} tokens" in msg and "left on the test GPU" in msg
    assert "a higher gpu_memory_utilization" in msg
    # each suggestion is the largest that fits: one more does not
    max_len, max_slots = _suggested(msg, "max_model_len"), _suggested(msg, "max_num_seqs")
    check_static(layout, slots, max_len + spare, budget, spare)
    with pytest.raises(KVCacheTooLargeError):
        check_static(layout, slots, max_len + spare + 1, budget, spare)
    check_static(layout, max_slots, tokens, budget, spare)
    with pytest.raises(KVCacheTooLargeError):
        check_static(layout, max_slots + 1, tokens, budget, spare)


def test_max_kv_tokens_over_budget_names_the_largest_that_fits():
    layout = KVLayout.of(_qwen7b_config(), 2, tensor_parallel_size=2)
    budget = Budget(3 * GiB, "left on rank 0")
    with pytest.raises(KVCacheTooLargeError, match=r"max_kv_tokens' KV cache \(200000 tokens") as e:
        check_tokens(layout, 200_000, budget)
    fits = _suggested(str(e.value), "max_kv_tokens")
    assert check_tokens(layout, fits, budget) <= budget.bytes
    with pytest.raises(KVCacheTooLargeError):
        check_tokens(layout, fits + 1, budget)
    assert "higher" not in str(e.value)  # no knob to name


def test_weights_already_over_the_budget_leave_no_setting_to_suggest_but_the_budget():
    layout = KVLayout.of(_qwen7b_config(), 2)
    budget = Budget(-2 * GiB, "left of gpu_memory_utilization 0.5 x 80.0 GB", knob="gpu_memory_utilization")
    with pytest.raises(KVCacheTooLargeError) as e:
        check_static(layout, 1, 16, budget)
    msg = str(e.value)
    assert "nothing is left for it" in msg and "max_model_len" not in msg and "max_num_seqs" not in msg
    assert msg.endswith("set a higher gpu_memory_utilization")


def test_two_replicas_sharing_a_gpu_at_045_each_both_get_their_share_and_never_more_than_is_free():
    from serve_app.engines.memory import gpu_budget

    total, weights, ctx = 80 * GiB, 8 * GiB, GiB // 2
    first = gpu_budget(total - weights - ctx, total, weights, 0.45, "H100")
    assert first.bytes == int(0.45 * total) - weights and first.knob == "gpu_memory_utilization"
    # the second starts once the first holds its weights, its whole cache and its CUDA context
    second = gpu_budget(total - (weights + first.bytes + ctx) - weights - ctx, total, weights, 0.45, "H100")
    assert second.bytes == first.bytes
    # beside a process holding 60 GiB it gets only what is free, and is told who holds the rest
    crowded = gpu_budget(total - 60 * GiB - weights - ctx, total, weights, 0.45, "H100")
    assert crowded.bytes == total - 60 * GiB - weights - ctx < first.bytes and crowded.knob == ""
    layout = KVLayout.of(_qwen7b_config(), 2)
    tokens = first.bytes // layout.bytes_per_token
    check_tokens(layout, tokens, second)
    with pytest.raises(KVCacheTooLargeError, match=r"the 12\.35 GB free on H100 \(85\.9 GB; 8\.59 GB held by this "
                                                   r"engine's weights, 64\.96 GB by the rest"):
        check_tokens(layout, tokens, crowded)


def test_on_a_gpu_the_share_is_counted_after_this_engines_weights_not_all_the_process_holds(monkeypatch):
    """An H100 (gpu_memory_check.py, first run) read 9.21 GB "of weights" for a 4.04-GB model while the
    script still held the last engine: the process's whole allocation had been taken for this engine's.
    torch.cuda's readings stand in for a GPU here (none on this box); the arithmetic is device_budget's."""
    import torch

    total, free, held_by_process, weights = 80 * GiB, 70 * GiB, 15 * GiB, 4 * GiB
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held_by_process)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    own = device_budget(torch.device("cuda"), 0.9, own_bytes=weights)
    assert own.bytes == int(0.9 * total) - weights
    assert "after this engine's 4.29 GB of weights" in own.source
    # without the engine's count (a tensor-parallel rank: one engine per process) all the process holds
    assert device_budget(torch.device("cuda"), 0.9).bytes == int(0.9 * total) - held_by_process


def test_the_cpu_budget_is_the_hosts_available_memory():
    import torch

    budget = device_budget(torch.device("cpu"), 0.9)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < budget.bytes <= total
    assert budget.knob == ""  # gpu_memory_utilization does not apply to the host


def test_gpu_memory_utilization_is_validated():
    from serve_app.engines.options import HFEngineOptions

    assert HFEngineOptions().gpu_memory_utilization == 0.9
    for bad in (0, 1.2, -0.1):
        with pytest.raises(ValidationError, match="gpu_memory_utilization"):
            HFEngineOptions(gpu_memory_utilization=bad)


# ---- the engine on the real SmolLM2 -----------------------------------------------
# 1024 slots x 8192 tokens x SmolLM2's 45 KiB (float32) a token: ~386 GB, more than any CI host has
TOO_BIG = {"device": "cpu", "kv_cache": "static", "max_num_seqs": 1024, "max_model_len": 8192,
           "max_kv_tokens": 8192}


@pytest.mark.asyncio
@pytest.mark.parametrize("process", ["inline", "separate"])
async def test_an_engine_refuses_a_static_cache_the_host_cannot_hold_before_allocating_it(embedded_model_dir,
                                                                                       process):
    from serve_app.engines.registry import create_engine

    eng = create_engine("hf", TOO_BIG, process=process)
    # a torch allocation error would be a RuntimeError: this is the check, before any allocation
    with pytest.raises(KVCacheTooLargeError, match=r"1024 sequences x 8192 tokens x 45\.0 KiB = 386\.55 GB\): it "
                       r"does not fit the .* GB of host memory available; set max_model_len <= \d+ or "
                       r"max_num_seqs <= \d+$"):
        await eng.start()
    if process == "separate":
        assert await asyncio.to_thread(eng._proc.wait, 15) == 1


@pytest.mark.asyncio
async def test_an_engine_refuses_a_max_model_len_past_the_model_s_positions(embedded_model_dir):
    from serve_app.engines.registry import create_engine

    # SmolLM2 has 8,192 positions; until 2026-12-06 the engine cut 16,384 to 8,192 without a word
    eng = create_engine("hf", {"device": "cpu", "max_num_seqs": 2, "max_model_len": 16384}, process="inline")
    with pytest.raises(EngineNotReadyError, match=r"max_model_len 16384 is longer than .*max_position_embeddings "
                                                  r"\(8192\).*set max_model_len <= 8192"):
        await eng.start()
    assert getattr(eng, "model", None) is None  # refused from the config, before the weights were loaded


@pytest.mark.asyncio
async def test_an_engine_refused_or_shut_down_gives_its_weights_back(embedded_model_dir):
    """What benchmarks/gpu_memory_check.py measures on a GPU (run 119): a refused engine gives back what it
    loaded while its error, and so the engine, are still held (as the event loop's wake-up handle holds them
    until the loop turns, or a caller that keeps the error), and one shut down and dropped frees its weights at
    once, not at the next full garbage collection."""
    import gc
    import weakref

    from transformers import PreTrainedModel

    from serve_app.engines.registry import create_engine

    def models() -> int:
        return sum(issubclass(type(o), PreTrainedModel) for o in gc.get_objects())

    def held(eng):
        layer = eng.model.model.layers[0]
        return [weakref.ref(x) for x in (eng, eng.model.model.embed_tokens.weight, layer.self_attn,
                                         layer.self_attn.qkv_proj.weight)]

    gc.collect()
    before = models()
    eng = create_engine("hf", TOO_BIG, process="inline")
    with pytest.raises(KVCacheTooLargeError) as refused:
        await eng.start()
    assert models() == before and refused.value.__traceback__ is not None
    del eng, refused

    eng = create_engine("hf", {**TOO_BIG, "max_num_seqs": 2, "max_model_len": 256}, process="inline")
    await eng.start()
    refs = held(eng)
    await eng.shutdown()
    await asyncio.sleep(0)
    gc.collect()  # whatever else the start left to the collector
    gc.disable()
    try:
        del eng
        assert [r() is None for r in refs] == [True] * 4
    finally:
        gc.enable()


@pytest.mark.asyncio
async def test_an_engine_whose_cache_fits_holds_what_it_checked_and_what_the_offline_plan_says(embedded_model_dir):
    from transformers import AutoConfig

    from serve_app.engines.memory import count_weights, plan_hf
    from serve_app.engines.options import HFEngineOptions
    from tests.conftest import started_engine

    opts = {**TOO_BIG, "dtype": "float32", "max_num_seqs": 2, "max_model_len": 1024}
    plan = plan_hf(HFEngineOptions(**{**opts, "cuda_graphs": False}),
                   AutoConfig.from_pretrained(embedded_model_dir, local_files_only=True),
                   count_weights(embedded_model_dir), 80 * GiB)
    async with started_engine("hf", opts) as eng:
        # 2 x 1024 tokens x 30 layers x (keys + values) x 3 KV heads x 64 dims x 4 bytes
        assert eng.warm_up["kv_cache_gb"] == pytest.approx(2 * 1024 * 30 * 2 * 3 * 64 * 4 / 1e9)
        assert eng._slots.cache.bytes == eng.kv_cache_bytes == plan.kv_bytes
        held = {p.data_ptr(): p.numel() * p.element_size() for p in eng.model.parameters()}
        assert plan.weights_bytes == sum(held.values())
        assert plan.error is None
        # what the engine reports of its weights: the parameters plus its few buffers (the rotary frequencies)
        assert eng.warm_up["weights_gb"] == pytest.approx(plan.weights_bytes / 1e9, rel=1e-3)
        assert eng.warm_up["load_peak_gb"] is None  # measured on a GPU only


def test_the_plan_counts_fp8_weights_as_the_quantized_model_holds_them(embedded_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from serve_app.engines.fp8 import quantize_linears
    from serve_app.engines.fused import fuse_projections
    from serve_app.engines.memory import count_weights

    count = count_weights(embedded_model_dir)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.bfloat16, local_files_only=True)
    fuse_projections(model)
    quantize_linears(model, torch.bfloat16)
    held = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    scales = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight_scale"))
    assert count.bytes(2, "fp8") == sum(held.values()) + scales
    assert count.bytes(2) > count.bytes(2, "fp8") > count.bytes(1)  # the tied embedding stays in bf16


def test_config_memory_prints_each_variant_and_fails_where_the_engine_would(tmp_path, capsys, embedded_model_dir):
    import yaml

    from serve_app.cli import main

    assert main(["config", "memory", str(ROOT / "configs" / "default.yaml"), "--gpu-memory-gib", "79.6"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct/stable" in out and "static 32 x 8193" in out and out.rstrip().endswith("yes")
    # 4 GiB: the default's 6 GB of static cache does not fit; the suggested max_model_len does
    assert main(["config", "memory", str(ROOT / "configs" / "default.yaml"), "--gpu-memory-gib", "4"]) == 1
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("no")
    fix = _suggested(captured.err, "max_model_len")
    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    cfg["models"][0]["variants"][0]["engine"]["options"]["max_model_len"] = fix
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["config", "memory", str(path), "--gpu-memory-gib", "4"]) == 0
    # no GPU size: argparse's usage error, exit 2
    with pytest.raises(SystemExit) as e:
        main(["config", "memory", str(path), "--gpu-memory-gib", "0"])
    assert e.value.code == 2 and "must be above 0" in capsys.readouterr().err
    # a model directory without weights: a clear error, exit 2
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((embedded_model_dir / "config.json").read_text())
    cfg["models"][0]["variants"][0]["engine"]["options"]["model"] = str(tmp_path / "empty")
    path.write_text(yaml.safe_dump(cfg))
    assert main(["config", "memory", str(path), "--gpu-memory-gib", "4"]) == 2
    assert "cannot read the model: no *.safetensors files in" in capsys.readouterr().err


def _header_only_checkpoint(path: Path, **config) -> int:
    """A Qwen2 checkpoint directory whose safetensors file holds every tensor's header and no data (a sparse file
    of the full size): what `config memory` reads, without 15 GB on disk. Returns the parameter count."""
    import json
    import struct

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**config)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    header, offset = {}, 0
    for name, p in model.state_dict().items():
        size = p.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(p.shape), "data_offsets": [offset, offset + size]}
        offset += size
    path.mkdir()
    cfg.save_pretrained(path)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset // 2


def test_the_gpu_example_config_fits_the_gpu_it_names_and_not_half_of_one(tmp_path, capsys):
    """configs/gpu-7b.yaml says its 64 x 8,192-token cache and a 7B's weights fit an 80 GB GPU: `config memory`
    on a checkpoint of DeepSeek-R1-Distill-Qwen-7B's shape (headers only) agrees, and on 40 GiB names the fix;
    the FP8 canary example fits too."""
    import yaml

    from benchmarks.gpu_engine import QWEN7B
    from serve_app.cli import main

    params = _header_only_checkpoint(tmp_path / "r1-7b", **{**QWEN7B, "max_position_embeddings": 131072})
    cfg = yaml.safe_load((ROOT / "configs" / "gpu-7b.yaml").read_text())
    cfg["models"][0]["variants"][0]["engine"]["options"]["model"] = str(tmp_path / "r1-7b")
    path = tmp_path / "gpu-7b.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["config", "memory", str(path), "--gpu-memory-gib", "79.6"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split()
    # weights 2 bytes a parameter; KV 28 layers x 2 x 4 heads x 128 x 2 bytes a token, 64 slots x 8,193 positions
    assert row[0] == "deepseek-r1-distill-qwen-7b/stable" and row[-1] == "yes"
    assert float(row[3]) == pytest.approx(params * 2 / 1e9, abs=0.01) == pytest.approx(15.23, abs=0.01)
    assert row[4:7] == ["static", "64", "x"] and row[7] == "8193"
    assert float(row[8]) == pytest.approx(64 * 8193 * 28 * 2 * 4 * 128 * 2 / 1e9, abs=0.01)
    assert main(["config", "memory", str(path), "--gpu-memory-gib", "40"]) == 1
    assert _suggested(capsys.readouterr().err, "max_model_len") < 8192

    # a checkpoint of 4,096 positions (the benchmarks' random 7B) cannot take the file's 8,192: refused, as the
    # engine would refuse it at start
    _header_only_checkpoint(tmp_path / "short", **QWEN7B)
    cfg["models"][0]["variants"][0]["engine"]["options"]["model"] = str(tmp_path / "short")
    path.write_text(yaml.safe_dump(cfg))
    assert main(["config", "memory", str(path), "--gpu-memory-gib", "79.6"]) == 1
    assert "max_position_embeddings (4096)" in capsys.readouterr().err

    # the FP8 canary example: both variants fit, the canary's decoder linears at a byte a weight
    cfg = yaml.safe_load((ROOT / "configs" / "gpu-7b-fp8-canary.yaml").read_text())
    for v in cfg["models"][0]["variants"]:
        v["engine"]["options"]["model"] = str(tmp_path / "r1-7b")
    path.write_text(yaml.safe_dump(cfg))
    assert main(["config", "memory", str(path), "--gpu-memory-gib", "79.6"]) == 0
    rows = {r.split()[0]: r.split() for r in capsys.readouterr().out.splitlines()[-2:]}
    assert float(rows["deepseek-r1-distill-qwen-7b/fp8"][3]) == pytest.approx(8.7, abs=0.05)
    assert rows["deepseek-r1-distill-qwen-7b/stable"][3] == row[3] and all(r[-1] == "yes" for r in rows.values())


@pytest.mark.asyncio
async def test_the_dynamic_cache_stays_within_max_kv_tokens_with_one_long_answer_beside_short_ones(
        embedded_model_dir):
    """Its rows pad to the longest, so one long answer beside short ones holds rows x the long one: admission
    counts that, not the sum of the rows (which would let two rows of 128 + 180 tokens take 2 x 180)."""
    from serve_app.engines.base import GenerationRequest, SamplingParams
    from tests.conftest import started_engine

    async with started_engine("hf", {"device": "cpu", "kv_cache": "dynamic", "max_num_seqs": 8,
                                     "max_model_len": 256, "max_kv_tokens": 300}) as eng:
        held = []
        decode = eng._runner.decode

        def recording(tokens):
            out = decode(tokens)
            held.append(eng._runner.batch.mask.numel())  # rows x columns the cache holds now
            return out

        eng._runner.decode = recording
        ids = eng.encode_chat([{"role": "user", "content": "Count from one to a hundred."}])
        assert len(ids) + 150 <= 256

        made = {}

        async def run(rid, max_tokens):
            made[rid] = 0
            async for c in eng.generate(GenerationRequest(rid, ids, SamplingParams(
                    max_tokens=max_tokens, temperature=0, ignore_eos=True))):
                made[rid] += len(c.token_ids)
            return made[rid]

        long = asyncio.create_task(run("long", 150))
        while made.get("long", 0) < 100:  # the short ones arrive once the long row is ~130 tokens wide
            await asyncio.sleep(0.01)
        shorts = [asyncio.create_task(run(f"s{i}", 4)) for i in range(3)]
        assert await long == 150 and await asyncio.gather(*shorts) == [4, 4, 4]
        # the sum rule runs all three beside the long one (~180 + 3 x ~34 of 300 reserved) in a cache of
        # 4 rows x ~130+ columns
        assert max(held) <= 300
        assert eng.stats().kv_cache_usage == 0.0


def test_the_padded_peak_is_what_a_step_by_step_left_padded_cache_reaches():
    import random

    from serve_app.engines.memory import padded_peak_tokens

    def simulated(rows):
        peak = 0
        for s in range(max(r for _, r in rows) + 1):
            there = [(c, r) for c, r in rows if r >= s]
            peak = max(peak, len(there) * max(c + s for c, _ in there))
        return peak

    rng = random.Random(7)
    for _ in range(500):
        rows = [(rng.randint(1, 300), rng.randint(0, 300)) for _ in range(rng.randint(1, 12))]
        assert padded_peak_tokens(rows) == simulated(rows), rows
    # short rows beside a long one: the peak is the long one's, alone, not rows x its reservation
    assert padded_peak_tokens([(30, 400)] + [(30, 20)] * 7) == max(8 * 50, 430)
    assert padded_peak_tokens([]) == 0


@pytest.mark.asyncio
async def test_static_slots_take_every_request_that_fits_a_slot_whatever_max_kv_tokens_says(embedded_model_dir):
    """The static cache's memory is all allocated (and checked) at start, a slot per sequence: four requests of
    ~190 tokens each run together in four slots though their sum is over max_kv_tokens (the sum rule ran them
    one at a time), and the usage reported is of the slots."""
    from serve_app.engines.base import GenerationRequest, SamplingParams
    from tests.conftest import started_engine

    async with started_engine("hf", {"device": "cpu", "kv_cache": "static", "max_num_seqs": 4,
                                     "max_model_len": 256, "max_kv_tokens": 300}) as eng:
        ids = eng.encode_chat([{"role": "user", "content": "Count from one to a hundred."}])
        seen = []

        async def run(rid):
            n = 0
            async for c in eng.generate(GenerationRequest(rid, ids, SamplingParams(
                    max_tokens=150, temperature=0, ignore_eos=True))):
                n += len(c.token_ids)
                s = eng.stats()
                seen.append((s.num_running, s.kv_cache_usage))
            return n

        assert await asyncio.gather(*(run(f"r{i}") for i in range(4))) == [150] * 4
        assert max(r for r, _ in seen) == 4
        # four rows of up to ~185 tokens in 4 x 256 slots
        assert 0.5 < max(u for _, u in seen) <= (len(ids) + 150) / 256


def test_status_shows_what_the_cache_and_the_weights_take_where_the_engine_reports_them():
    from serve_app.status import VariantStatus, render

    def row(engine):
        return VariantStatus("app", "LLMServer-m-stable", "HEALTHY", "", {"RUNNING": 1}, None, engine)

    shown = render([row({"num_waiting": 0, "num_running": 3, "kv_cache_usage": 0.25, "gpu_util_pct": None,
                         "warm_up": {"kv_cache_gb": 7.52, "weights_gb": 15.23}})])
    assert "KV 25% of 7.52 GB, weights 15.23 GB, GPU n/a" in shown
    # an engine without them (null, trtllm) shows what it did before
    assert "KV 0%, GPU 41%" in render([row({"num_waiting": 0, "num_running": 0, "gpu_util_pct": 41.0})])

