"""Contract test of the TensorRT-LLM adapter against FakeTensorRTLLM (tests/fake_tensorrt_llm.py).

It checks the arguments we pass to the documented LLM API and how its outputs
map onto our engine contract. It does NOT run TensorRT-LLM."""

import asyncio

import pytest

from serve_app.engines.base import GenerationRequest, ParallelConfig, SamplingParams
from serve_app.engines.registry import create_engine
from serve_app.errors import ContextLengthExceededError, EngineError, InvalidRequestError, OverloadedError
from tests import fake_tensorrt_llm as fake

OPTIONS = {
    "model": "/models/deepseek-r1-distill-qwen-7b",
    "max_batch_size": 64,
    "max_num_tokens": 4096,
    "kv_cache_free_gpu_memory_fraction": 0.85,
    "kv_cache_dtype": "fp8",
    "enable_block_reuse": True,
    "cuda_graph_batch_sizes": [1, 8, 32, 64],
    "cuda_graph_padding": True,
    "lora": {"adapters": {"legal": "/adapters/legal", "medical": "/adapters/medical"}, "max_loras": 2},
    "max_waiting_requests": 1,
}


@pytest.fixture
def trt():
    state = fake.install()
    yield state
    fake.uninstall()


async def started(trt, **overrides):
    eng = create_engine("trtllm", {**OPTIONS, **overrides},
                        ParallelConfig(tensor_parallel_size=2, bundle_indices=[0, 1], env={"NCCL_NVLS_ENABLE": "0"}))
    await eng.start()
    return eng


def step(ids, text, lps, finish=None):
    return fake.FakeCompletionOutput(ids, text, lps, finish)


def lp(**pairs):
    return {int(k[1:]): fake.Logprob(v) for k, v in pairs.items()}


async def collect(eng, req):
    return [c async for c in eng.generate(req)]


def request(rid="r1", max_tokens=8, **sampling):
    return GenerationRequest(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens, **sampling))


async def test_llm_constructor_arguments(trt):
    eng = await started(trt)
    kw = trt.llm.init_kwargs
    assert kw["model"] == OPTIONS["model"] and kw["tensor_parallel_size"] == 2
    assert kw["max_batch_size"] == 64 and kw["max_num_tokens"] == 4096
    assert kw["orchestrator_type"] == "ray" and kw["enable_chunked_prefill"] is True
    assert kw["kv_cache_config"].kwargs == {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True, "dtype": "fp8"}
    assert kw["cuda_graph_config"].kwargs == {"batch_sizes": [1, 8, 32, 64], "enable_padding": True}
    assert kw["lora_config"].kwargs == {"lora_dir": ["/adapters/legal", "/adapters/medical"], "max_lora_rank": 64,
                                        "max_loras": 2, "max_cpu_loras": 16}
    # rank workers go to this replica's bundles; NCCL env is set before LLM() starts them
    assert trt.environ_at_init["TRTLLM_RAY_BUNDLE_INDICES"] == "0,1"
    assert trt.environ_at_init["NCCL_NVLS_ENABLE"] == "0"
    await eng.shutdown()
    assert trt.llm.shut_down


async def test_stream_mapping_sampling_and_lora(trt):
    eng = await started(trt)
    trt.llm.script = [
        step([11], "He", [lp(t11=-0.1, t12=-2.5)]),
        step([12, 13], "llo", [lp(t12=-0.2, t99=-1.0), lp(t13=-0.3)]),
        step([2], "", [lp(t2=-0.05)], finish="stop"),
    ]
    req = request(temperature=0.7, top_p=0.9, seed=3, stop=["END"], top_logprobs=2)
    req.adapter = "medical"
    chunks = await collect(eng, req)
    call = trt.llm.calls[0]
    assert call["inputs"] == [5, 6, 7] and call["streaming"] is True
    assert call["sampling_params"].kwargs == {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "logprobs": 2,
                                              "ignore_eos": False, "seed": 3, "stop": ["END"]}
    lr = call["lora_request"]
    assert (lr.lora_name, lr.lora_int_id, lr.lora_path) == ("medical", 1, "/adapters/medical")
    assert "".join(c.text for c in chunks) == "Hello"
    assert [c.token_ids for c in chunks] == [[11], [12, 13], [2]]
    assert [c.logprobs for c in chunks] == [[-0.1], [-0.2, -0.3], [-0.05]]
    assert chunks[1].top_logprobs == [{12: -0.2, 99: -1.0}, {13: -0.3}]
    assert [c.finish_reason for c in chunks] == [None, None, "stop"]
    assert chunks[-1].num_generated_tokens == 4 and chunks[-1].num_prompt_tokens == 3


async def test_logprobs_always_requested_for_confidence(trt):
    eng = await started(trt)
    trt.llm.script = [step([1], "a", [lp(t1=-0.5)], finish="length")]
    await collect(eng, request(max_tokens=1))
    assert trt.llm.calls[0]["sampling_params"].kwargs["logprobs"] == 1
    assert "lora_request" in trt.llm.calls[0] and trt.llm.calls[0]["lora_request"] is None


async def test_sampled_token_missing_from_logprobs_is_an_engine_error(trt):
    eng = await started(trt)
    trt.llm.script = [step([11], "x", [lp(t12=-0.1)])]
    with pytest.raises(EngineError, match="sampled token 11 is missing"):
        await collect(eng, request())


async def test_cancel_aborts_the_trtllm_request(trt):
    eng = await started(trt)
    trt.llm.script = [step([i], "t", [lp(**{f"t{i}": -0.1})]) for i in range(1, 50)]
    trt.llm.delay_s = 0.01
    gen = eng.generate(request(max_tokens=100))
    await gen.__anext__()
    await gen.aclose()
    assert trt.llm.results[0].aborted
    assert eng.stats().aborted_requests == 1


async def test_admission_errors(trt):
    eng = await started(trt, max_seq_len=16, max_batch_size=1, cuda_graph_batch_sizes=[1])
    with pytest.raises(ContextLengthExceededError):
        await collect(eng, request(max_tokens=20))
    bad = request()
    bad.adapter = "finance"
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter"):
        await collect(eng, bad)
    trt.llm.script = [step([i], "t", [lp(**{f"t{i}": -0.1})]) for i in range(1, 50)]
    trt.llm.delay_s = 0.05
    gens = [eng.generate(request(f"q{i}", max_tokens=8)) for i in range(2)]
    firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
    await asyncio.sleep(0.01)
    with pytest.raises(OverloadedError):
        await collect(eng, request("q3"))
    for g, f in zip(gens, firsts):
        await f
        await g.aclose()


async def test_iteration_stats_feed_engine_stats(trt):
    eng = await started(trt, stats_interval_s=0.01)
    trt.llm.stats = [{"iter": 7, "numActiveRequests": 3, "numQueuedRequests": 5,
                      "kvCacheStats": {"usedNumBlocks": 25, "maxNumBlocks": 100}}]
    await asyncio.sleep(0.05)
    s = eng.stats()
    assert (s.num_running, s.num_waiting, s.kv_cache_usage, s.forward_passes) == (3, 5, 0.25, 7)
    await eng.shutdown()
    assert trt.llm is not None and trt.llm.shut_down


def test_options_validation():
    from serve_app.engines.options import TRTLLMEngineOptions

    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        TRTLLMEngineOptions(model="/m", cuda_graph_batch_sizes=[8, 4])
    with pytest.raises(ValueError, match="above max_batch_size"):
        TRTLLMEngineOptions(model="/m", max_batch_size=16, cuda_graph_batch_sizes=[1, 32])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        TRTLLMEngineOptions(model="/m", lora={"max_loras": 8, "max_cpu_loras": 2})


async def test_missing_tensorrt_llm_is_a_clear_not_ready_error():
    fake.uninstall()
    from serve_app.errors import EngineNotReadyError

    eng = create_engine("trtllm", {"model": "/m"})
    with pytest.raises(EngineNotReadyError, match="seekserve\\[trtllm\\]"):
        await eng.start()
