"""An engine in a process of its own (engine.process 'separate'): the contract across the process
boundary, without Ray (real child processes, real SmolLM2), then inside a real Ray Serve replica."""

import asyncio
import os
import signal

import httpx
import openai
import pytest
import pytest_asyncio

from serve_app.config import parse_config
from serve_app.deployments.coalesce import engine_chunks
from serve_app.engines.base import GenerationRequest, SamplingParams
from serve_app.engines.registry import create_engine, get_engine_class
from serve_app.errors import (
    ContextLengthExceededError,
    EngineError,
    EngineNotReadyError,
    InvalidRequestError,
    OverloadedError,
)
from tests.conftest import deploy_app, smol_config, started_engine, wait_for

QUESTION = "What is the capital of France? Answer in one word."
SMOL_OPTS = {"model": "embedded:smollm2-135m-instruct", "device": "cpu", "max_num_seqs": 8,
             "max_waiting_requests": 8, "max_model_len": 2048}


async def run(engine, rid, ids, **sampling):
    sampling.setdefault("max_tokens", 16)
    return [c async for c in engine.generate(GenerationRequest(rid, ids, SamplingParams(**sampling)))]


def ids_of(chunks):
    return [t for c in chunks for t in c.token_ids]


# ---- configuration (pure) ----------------------------------------------------
def test_config_refuses_separate_process_where_it_cannot_run():
    with pytest.raises(ValueError, match="not available for the 'trtllm' backend; it is for: hf, null"):
        parse_config({"models": [{"name": "m", "variants": [{"name": "stable", "engine": {
            "backend": "trtllm", "process": "separate", "options": {"model": "/models/x"}}}]}]})
    with pytest.raises(ValueError, match="engine.process 'separate' runs one rank"):
        parse_config({"models": [{"name": "m", "variants": [{
            "name": "stable", "tensor_parallel_size": 2,
            "engine": {"backend": "null", "process": "separate"}}]}]})
    with pytest.raises(ValueError, match="process"):
        parse_config({"models": [{"name": "m", "variants": [{"name": "stable", "engine": {
            "backend": "null", "process": "thread"}}]}]})
    cfg = parse_config({"models": [{"name": "m", "variants": [{"name": "stable", "engine": {
        "backend": "null", "process": "separate"}}]}]})
    assert cfg.models[0].variants[0].engine.process == "separate"


def test_auto_is_the_default_and_separates_only_an_hf_engine_of_one_rank_on_a_gpu():
    from serve_app.engines.options import HFEngineOptions, NullEngineOptions
    from serve_app.engines.base import ParallelConfig
    from serve_app.engines.process import SeparateProcessEngine
    from serve_app.engines.registry import auto_engine_process

    cfg = parse_config({"models": [{"name": "m", "variants": [{"name": "stable", "engine": {"backend": "null"}}]}]})
    assert cfg.models[0].variants[0].engine.process == "auto"
    one, two = ParallelConfig(tensor_parallel_size=1), ParallelConfig(tensor_parallel_size=2)
    assert auto_engine_process("hf", HFEngineOptions(device="cuda"), one) == "separate"
    assert auto_engine_process("hf", HFEngineOptions(device="cuda"), two) == "inline"
    assert auto_engine_process("hf", HFEngineOptions(device="cpu"), one) == "inline"
    assert auto_engine_process("hf", HFEngineOptions(device="auto"), None) == "inline"  # no GPU on this box
    assert auto_engine_process("null", NullEngineOptions(), one) == "inline"
    # and the engine it makes is the inline one
    assert not isinstance(create_engine("null", {}, process="auto"), SeparateProcessEngine)


def test_create_engine_lists_the_valid_process_layouts():
    with pytest.raises(ValueError, match="valid: auto, inline, separate"):
        create_engine("null", {}, process="fork")
    # the config's literal and the list the registry and benchmarks use are one set
    from typing import get_args

    from serve_app.config import EngineSpec
    from serve_app.engines.options import ENGINE_PROCESSES

    assert get_args(EngineSpec.model_fields["process"].annotation) == ENGINE_PROCESSES


# ---- the real model across the boundary ----------------------------------------
pytestmark_async = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smol_pair(embedded_model_dir):
    inline = create_engine("hf", SMOL_OPTS)
    separate = create_engine("hf", SMOL_OPTS, process="separate")
    # one after the other: both import transformers in a worker thread, and its lazy imports are not
    # safe to race (seen once: "cannot import name 'AutoModelForCausalLM'")
    await inline.start()
    await separate.start()
    yield inline, separate
    await asyncio.gather(inline.shutdown(), separate.shutdown())


@pytestmark_async
async def test_separate_process_answers_as_inline_does(smol_pair):
    inline, separate = smol_pair
    assert separate._proc.pid != os.getpid() and separate._proc.poll() is None
    ids = separate.encode_chat([{"role": "user", "content": QUESTION}])
    assert ids == inline.encode_chat([{"role": "user", "content": QUESTION}])
    assert separate.max_model_len == inline.max_model_len == 2048
    a = await run(inline, "a", ids, temperature=0, max_tokens=20)
    b = await run(separate, "b", ids, temperature=0, max_tokens=20)
    assert "Paris" in "".join(c.text for c in b)
    assert ids_of(a) == ids_of(b)
    assert [c.text for c in a] == [c.text for c in b]
    assert b[-1].finish_reason == "stop" and b[0].queue_time_s is not None
    assert separate.token_text(ids_of(b)[0]) == inline.token_text(ids_of(a)[0])
    # the child froze what its start left (a full collection of it stalls the engine for ~1 s on a GPU host)
    gc = await _eventually(lambda: (separate.process_gc or {}).get("frozen_objects", 0) > 10_000)
    assert gc, separate.process_gc


@pytestmark_async
async def test_concurrent_streams_share_the_child_batch_and_stats_come_back(smol_pair):
    _, separate = smol_pair
    before = separate.stats().generated_tokens
    prompts = [separate.encode_chat([{"role": "user", "content": f"Count from {i} to {i + 5}."}]) for i in range(6)]
    outs = await asyncio.gather(*[run(separate, f"c{i}", p, temperature=0, max_tokens=10)
                                  for i, p in enumerate(prompts)])
    assert all(o[-1].num_generated_tokens == len(ids_of(o)) > 0 for o in outs)
    made = sum(len(ids_of(o)) for o in outs)
    # the child reports its engine's counters on its own; the last burst within ~50 ms
    s = await _eventually(lambda: separate.stats().generated_tokens >= before + made)
    assert s and separate.stats().num_running == 0 and separate.stats().healthy


@pytestmark_async
async def test_a_backend_without_submit_streams_through_the_child_by_generator():
    # the null engine has no submit(): the child's relay iterates its generate() instead (hf pushes, above)
    async with started_engine("null", {"num_tokens": 5, "tokens_per_s": 1000, "token_text": "x"},
                              process="separate") as null:
        assert not get_engine_class("null").supports_submit and get_engine_class("hf").supports_submit
        chunks = await run(null, "n", [1, 2, 3], max_tokens=5)
        assert "".join(c.text for c in chunks) == "xxxxx" and chunks[-1].finish_reason == "length"
        with pytest.raises(ContextLengthExceededError):
            await run(null, "too-long", [1] * 10_000, max_tokens=5)
        # an option the backend reads while it runs, changed in the child (a benchmark's compare); a bad one is
        # refused before anything changes, here or there
        null.update_options({"token_text": "y"})
        assert "".join(c.text for c in await run(null, "n2", [1, 2, 3], max_tokens=5)) == "yyyyy"
        with pytest.raises(InvalidRequestError, match="tokens_per_s"):
            null.update_options({"token_text": "z", "tokens_per_s": -1})
        assert null.options.token_text == "y"
        assert "".join(c.text for c in await run(null, "n3", [1, 2, 3], max_tokens=5)) == "yyyyy"


@pytestmark_async
async def test_admission_errors_cross_as_their_own_type(smol_pair):
    _, separate = smol_pair
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 2048"):
        await run(separate, "long", [1] * 2040, max_tokens=20)
    # the replica keeps serving after a refused request
    ok = await run(separate, "after", separate.encode_text("Hello"), temperature=0, max_tokens=3)
    assert ok[-1].finish_reason is not None


@pytestmark_async
async def test_a_consumer_that_leaves_aborts_in_the_child(smol_pair):
    _, separate = smol_pair
    ids = separate.encode_text("Once upon a time")
    aborted = separate.stats().aborted_requests
    gen = separate.generate(GenerationRequest("leave", ids, SamplingParams(max_tokens=500, ignore_eos=True)))
    await gen.__anext__()
    await gen.aclose()
    assert await _eventually(lambda: separate.stats().aborted_requests == aborted + 1
                             and separate.stats().num_running == 0)
    # an explicit abort ends the stream with finish_reason "abort"
    gen = separate.generate(GenerationRequest("stop-me", ids, SamplingParams(max_tokens=500, ignore_eos=True)))
    first = await gen.__anext__()
    await separate.abort("stop-me")
    rest = [c async for c in gen]
    assert (rest or [first])[-1].finish_reason == "abort"


async def _eventually(pred, timeout_s: float = 10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.05)
    return pred()


# ---- faults (null backend: no model cost) ----------------------------------------
@pytest.mark.asyncio
async def test_overload_crosses_as_429_error_type():
    async with started_engine("null", {"num_tokens": 50, "tokens_per_s": 20, "max_num_seqs": 1,
                                       "max_waiting_requests": 1}, process="separate") as eng:
        ids = eng.encode_text("hi")
        first = eng.generate(GenerationRequest("r1", ids, SamplingParams(max_tokens=50)))
        await first.__anext__()  # running
        second = asyncio.ensure_future(run(eng, "r2", ids, max_tokens=50))  # waiting
        await _eventually(lambda: eng.stats().num_waiting == 1)
        with pytest.raises(OverloadedError, match="waiting queue is full"):
            await run(eng, "r3", ids, max_tokens=5)
        await first.aclose()
        assert (await second)[-1].finish_reason == "length"


@pytest.mark.asyncio
async def test_a_dead_child_fails_open_streams_and_health_not_silently():
    async with started_engine("null", {"num_tokens": 100, "tokens_per_s": 20}, process="separate") as eng:
        await eng.check_health()
        gen = eng.generate(GenerationRequest("doomed", eng.encode_text("hi"), SamplingParams(max_tokens=100)))
        await gen.__anext__()
        os.kill(eng._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match=r"exited \(exit code -9\)"):
            async for _ in gen:
                pass
        with pytest.raises(EngineNotReadyError, match="exited"):
            await eng.check_health()
        with pytest.raises(EngineNotReadyError):
            await run(eng, "later", eng.encode_text("hi"))
        assert eng.stats().healthy is False


@pytest.mark.asyncio
async def test_a_request_the_dead_child_never_answered_is_not_ready_not_failed():
    async with started_engine("null", {"num_tokens": 100, "tokens_per_s": 20}, process="separate") as eng:
        proc = eng._proc
        os.kill(proc.pid, signal.SIGSTOP)  # the request reaches the socket, never the engine
        gen = eng.generate(GenerationRequest("unseen", eng.encode_text("hi"), SamplingParams(max_tokens=5)))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.2)
        assert not first.done()
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(EngineNotReadyError, match="exited"):
            await first
        assert eng.stats().healthy is False


# ---- pushed: the replica's streams over submit() (serve_app/deployments/coalesce.pushed) ----------------
def _paced_stream(eng, rid, ids, max_tokens, interval_s=0.0):
    return engine_chunks(eng, GenerationRequest(rid, ids, SamplingParams(max_tokens=max_tokens)), interval_s,
                         push=True)


@pytest.mark.asyncio
async def test_a_pushed_stream_paces_a_submitted_request_as_a_coalesced_one():
    # tokens 20 ms apart and a 200-ms interval: the request's trip to the child and back has taken 40 ms on a
    # loaded CI box, so the bounds leave that room and still tell a first chunk sent at once from a held one
    async with started_engine("null", {"num_tokens": 40, "tokens_per_s": 50, "token_text": "x"},
                              process="separate") as eng:
        assert eng.supports_submit
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = [(loop.time(), c) async for c in _paced_stream(eng, "p", [1, 2, 3], 40, interval_s=0.2)]
        assert "".join(c.text for _, c in out) == "x" * 40  # nothing lost
        # not held for the interval: a held first chunk would come at 200 ms with ten tokens
        assert out[0][0] - t0 < 0.15 and len(out[0][1].token_ids) <= 3, (out[0][0] - t0, out[0][1].token_ids)
        assert out[-1][1].finish_reason == "length" and out[-1][1].num_generated_tokens == 40
        assert len(out) <= 6, [len(c.token_ids) for _, c in out]  # ~0.8 s of tokens, one message per 200 ms
        gaps = [b - a for (a, _), (b, _) in zip(out[1:-1], out[2:-1])]
        assert gaps and all(g >= 0.19 for g in gaps), gaps
        assert not eng._routes  # the route went with the last chunk: a submitted request has no generator


@pytest.mark.asyncio
async def test_closing_a_pushed_stream_aborts_the_request_in_the_child():
    async with started_engine("null", {"num_tokens": 500, "tokens_per_s": 50}, process="separate") as eng:
        stream = _paced_stream(eng, "gone", [1, 2], 500)
        await stream.__anext__()
        await stream.aclose()  # a client that disconnects
        assert await _eventually(lambda: eng.stats().aborted_requests == 1 and eng.stats().num_running == 0)
        assert await _eventually(lambda: not eng._routes)  # the abort's last chunk took the route with it
        # refused at the first __anext__, as generate() refuses, and nothing is left behind
        with pytest.raises(ContextLengthExceededError):
            await _paced_stream(eng, "long", [1] * 10_000, 5).__anext__()
        live = _paced_stream(eng, "twice", [1], 500)
        await live.__anext__()
        with pytest.raises(InvalidRequestError, match="duplicate request id"):
            await _paced_stream(eng, "twice", [1], 5).__anext__()
        await live.aclose()
        assert await _eventually(lambda: eng.stats().num_running == 0 and not eng._routes)


@pytest.mark.asyncio
async def test_a_dead_child_fails_a_pushed_stream():
    async with started_engine("null", {"num_tokens": 100, "tokens_per_s": 20}, process="separate") as eng:
        stream = _paced_stream(eng, "doomed", [1], 100)
        await stream.__anext__()
        os.kill(eng._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="exited"):
            async for _ in stream:
                pass
        with pytest.raises(EngineNotReadyError):
            await _paced_stream(eng, "later", [1], 5).__anext__()


@pytest.mark.asyncio
async def test_the_child_stops_when_the_replica_goes_away():
    eng = create_engine("null", {}, process="separate")
    await eng.start()
    proc = eng._proc
    eng._loop.remove_reader(eng._conn.fileno())
    eng._conn.close()  # what the replica process's death does to the socket
    assert await asyncio.to_thread(proc.wait, 15) == 0


@pytest.mark.asyncio
async def test_a_child_that_cannot_start_fails_the_replica_start(embedded_model_dir):
    # the tokenizer loads in the replica; the model cannot load in the child (no GPU here), and the replica
    # gets the engine's own error, as it would from an engine in its own process
    eng = create_engine("hf", {**SMOL_OPTS, "device": "cuda"}, process="separate")
    with pytest.raises(EngineNotReadyError, match="'cuda' but no GPU is visible"):
        await eng.start()
    assert await asyncio.to_thread(eng._proc.wait, 15) == 1


# ---- inside a real Ray Serve replica -------------------------------------------------
@pytest.fixture(scope="module")
def smol_separate(serve_session):
    cfg = smol_config("smol-sep", max_num_seqs=8)
    cfg["models"][0]["variants"][0]["engine"]["process"] = "separate"
    deploy_app(cfg, name="smolsep", route_prefix="/smolsep")
    base = serve_session["base"] + "/smolsep"
    return {"base": base, "client": openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                                  timeout=120)}


def test_replica_with_a_separate_engine_process_answers_over_http(smol_separate):
    client = smol_separate["client"]
    msgs = [{"role": "user", "content": QUESTION}]
    full = client.chat.completions.create(model="smol-sep", messages=msgs, temperature=0, max_tokens=20)
    assert "Paris" in full.choices[0].message.content
    parts = [ch.delta.content or "" for chunk in client.chat.completions.create(
        model="smol-sep", messages=msgs, temperature=0, max_tokens=20, stream=True) for ch in chunk.choices]
    assert "".join(parts) == full.choices[0].message.content
    stats = httpx.get(smol_separate["base"] + "/admin/engine-stats", timeout=30).json()["smol-sep/stable"]
    pid = stats["warm_up"]["engine_process_pid"]
    assert pid and stats["warm_up"]["kv_cache"] == "dynamic" and stats["load_time_s"] > 0
    assert wait_for(lambda: httpx.get(smol_separate["base"] + "/admin/engine-stats", timeout=30)
                    .json()["smol-sep/stable"]["generated_tokens"] > 0)


def test_replica_whose_engine_process_dies_is_replaced(smol_separate):
    base, client = smol_separate["base"], smol_separate["client"]

    def stats():
        try:
            return httpx.get(base + "/admin/engine-stats", timeout=30).json()["smol-sep/stable"]
        except (httpx.HTTPError, KeyError, ValueError):  # while the replica is being replaced
            return {}

    pid = stats()["warm_up"]["engine_process_pid"]
    os.kill(pid, signal.SIGKILL)  # the OOM killer's way; same host as this test
    r = httpx.post(base + "/v1/completions", json={"model": "smol-sep", "prompt": "Hi", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    # Serve's health check sees it and starts a new replica with a new engine process
    assert wait_for(lambda: stats().get("warm_up", {}).get("engine_process_pid") not in (None, pid),
                    timeout_s=120, interval_s=1.0)
    done = client.completions.create(model="smol-sep", prompt="The capital of France is", temperature=0,
                                     max_tokens=3)
    assert done.choices[0].text
