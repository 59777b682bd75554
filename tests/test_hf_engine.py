"""The transformers engine on the real SmolLM2, without Ray."""

import asyncio
import contextlib

import pytest
import pytest_asyncio

from serve_app.engines.base import GenerationRequest, SamplingParams
from serve_app.engines.registry import create_engine
from serve_app.errors import ContextLengthExceededError, EngineError, InvalidRequestError, OverloadedError

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["dynamic", "static"])
async def engine(embedded_model_dir, request):
    # every test runs on both KV caches: transformers' DynamicCache and our static slots
    # (the static path's CUDA graphs need a GPU; on the CPU the same steps run eagerly)
    eng = create_engine(
        "hf",
        {"device": "cpu", "max_num_seqs": 16, "max_waiting_requests": 4, "max_model_len": 2048,
         "kv_cache": request.param},
    )
    await eng.start()
    yield eng
    await eng.shutdown()


async def run(engine, rid, ids, **sampling):
    sampling.setdefault("max_tokens", 16)
    chunks = []
    async for c in engine.generate(GenerationRequest(rid, ids, SamplingParams(**sampling))):
        chunks.append(c)
    return chunks


def text_of(chunks):
    return "".join(c.text for c in chunks)


def ids_of(chunks):
    return [t for c in chunks for t in c.token_ids]


async def test_greedy_answer_is_real(engine):
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    chunks = await run(engine, "paris", ids, temperature=0, max_tokens=20)
    assert "Paris" in text_of(chunks)
    assert chunks[-1].finish_reason == "stop"
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].num_generated_tokens == len(ids_of(chunks))


class ListSink:
    """A sink for Engine.submit: what the engine pushes, in order."""

    def __init__(self):
        self.items = []

    def put_nowait(self, item):
        self.items.append(item)

    def ended(self) -> bool:
        return bool(self.items) and (isinstance(self.items[-1], BaseException)
                                     or self.items[-1].finish_reason is not None)


async def until_ended(sink: ListSink, timeout_s: float = 60.0) -> list:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not sink.ended():
        assert asyncio.get_running_loop().time() < deadline, sink.items
        await asyncio.sleep(0.01)
    return sink.items


async def test_submit_pushes_what_generate_streams(engine):
    # the engine process's relay takes chunks this way (no generator, no task per request)
    assert engine.supports_submit
    ids = engine.encode_chat([{"role": "user", "content": "Name three colours."}])
    streamed = await run(engine, "gen", ids, temperature=0, max_tokens=12)
    sink = ListSink()
    engine.submit(GenerationRequest("pushed", ids, SamplingParams(temperature=0, max_tokens=12)), sink)
    pushed = await until_ended(sink)
    assert ids_of(pushed) == ids_of(streamed) and text_of(pushed) == text_of(streamed)
    assert pushed[-1].finish_reason == streamed[-1].finish_reason == "length"
    assert pushed[0].queue_time_s is not None
    # refused before it is queued: raised by submit itself, nothing pushed
    refused = ListSink()
    with pytest.raises(ContextLengthExceededError):
        engine.submit(GenerationRequest("too-long", [1] * 2040, SamplingParams(max_tokens=20)), refused)
    assert refused.items == []
    # only abort() stops a pushed request: its last item says so
    stopped = ListSink()
    engine.submit(GenerationRequest("stop-me", ids, SamplingParams(temperature=0, max_tokens=1000)), stopped)
    await engine.abort("stop-me")
    assert (await until_ended(stopped))[-1].finish_reason == "abort"


async def test_batched_greedy_equals_sequential_and_shares_forward_passes(engine):
    prompts = [
        engine.encode_chat([{"role": "user", "content": f"Write the numbers from {i} to {i + 4}."}])
        for i in range(8)
    ]
    alone = [ids_of(await run(engine, f"alone{i}", p, temperature=0, max_tokens=12)) for i, p in enumerate(prompts)]
    before = engine.stats().forward_passes
    together = await asyncio.gather(
        *[run(engine, f"together{i}", p, temperature=0, max_tokens=12) for i, p in enumerate(prompts)]
    )
    passes = engine.stats().forward_passes - before
    assert [ids_of(c) for c in together] == alone
    generated = sum(len(ids_of(c)) for c in together)
    # sequential decoding needs one pass per generated token
    assert passes < generated / 2, (passes, generated)


async def test_seed_reproduces_sampling_and_logprobs_are_consistent(engine):
    ids = engine.encode_chat([{"role": "user", "content": "Tell me a short story about a cat."}])
    a = await run(engine, "s1", ids, temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, top_logprobs=3)
    b = await run(engine, "s2", ids, temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, top_logprobs=3)
    assert ids_of(a) == ids_of(b)
    lps = [x for c in a for x in c.logprobs]
    tops = [t for c in a for t in c.top_logprobs]
    assert len(lps) == len(ids_of(a)) == len(tops)
    for tok, lp, top in zip(ids_of(a), lps, tops):
        assert lp <= 0.0
        assert len(top) == 3
        # the best alternative is at least as likely as the sampled token
        assert max(top.values()) >= lp - 1e-5
        if tok in top:
            assert abs(top[tok] - lp) < 1e-4


async def test_stop_string_cuts_output(engine):
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    full = text_of(await run(engine, "nostop", ids, temperature=0, max_tokens=20))
    assert "Paris" in full
    cut = await run(engine, "stop", ids, temperature=0, max_tokens=20, stop=["Paris"])
    assert text_of(cut) == full[: full.index("Paris")]
    assert cut[-1].finish_reason == "stop"


async def test_length_limit_and_context_check(engine):
    ids = engine.encode_text("Once upon a time")
    chunks = await run(engine, "len", ids, temperature=0, max_tokens=5, ignore_eos=True)
    assert chunks[-1].finish_reason == "length"
    assert len(ids_of(chunks)) == 5
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 2048"):
        await run(engine, "long", ids, max_tokens=2048)


async def test_abort_frees_the_slot(engine):
    ids = engine.encode_text("Count slowly:")
    gen = engine.generate(GenerationRequest("abortme", ids, SamplingParams(max_tokens=500, ignore_eos=True)))
    await gen.__anext__()
    assert engine.stats().num_running == 1
    aborted_before = engine.stats().aborted_requests
    await gen.aclose()
    for _ in range(100):
        if engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.05)
    s = engine.stats()
    assert s.num_running == 0
    assert s.aborted_requests == aborted_before + 1


async def test_a_failed_prefill_fails_its_requests_and_the_engine_goes_on(engine):
    # a device fault inside transformers' decoder (injected into the model object; both caches call it)
    model = engine.model.get_decoder()
    real = model.forward
    state = {"armed": True}

    def faulty(*args, **kw):
        ids = kw.get("input_ids")
        if state["armed"] and ids is not None and ids.shape[-1] > 1:  # the next prefill only
            state["armed"] = False
            raise RuntimeError("injected device fault")
        return real(*args, **kw)

    model.forward = faulty
    try:
        ids = engine.encode_chat([{"role": "user", "content": "Say hello."}])
        with pytest.raises(EngineError, match="injected device fault"):
            await asyncio.wait_for(run(engine, "faulted", ids, temperature=0, max_tokens=4), 60)
    finally:
        model.forward = real
    assert not state["armed"]
    chunks = await asyncio.wait_for(run(engine, "after-fault", ids, temperature=0, max_tokens=4), 60)
    assert chunks[-1].finish_reason in ("stop", "length")
    s = engine.stats()
    assert s.num_running == 0 and s.num_waiting == 0


async def test_waiting_queue_bound_rejects(engine):
    ids = engine.encode_text("Hello")
    # fill the batch (16) and the waiting queue (4), then one more must be rejected
    gens = [
        engine.generate(GenerationRequest(f"fill{i}", ids, SamplingParams(max_tokens=200, ignore_eos=True)))
        for i in range(20)
    ]
    tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
    await asyncio.sleep(0)  # let every request reach the engine's queue
    with pytest.raises(OverloadedError):
        await run(engine, "overflow", ids, max_tokens=4)
    for g, t in zip(gens, tasks):
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        await g.aclose()
    for _ in range(200):
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.stats().num_waiting == 0


async def test_static_slots_match_dynamic_cache_and_rows_do_not_leak(embedded_model_dir):
    opts = {"device": "cpu", "max_num_seqs": 6, "max_model_len": 512}
    dyn = create_engine("hf", {**opts, "kv_cache": "dynamic"})
    slots = create_engine("hf", {**opts, "kv_cache": "static"})
    await dyn.start()
    await slots.start()
    try:
        prompts = [dyn.encode_chat([{"role": "user", "content": q}]) for q in
                   ("What is the capital of France?", "Name three colours.", "Count to five.", "Say hi.")]
        want = [ids_of(await run(dyn, f"d{i}", p, temperature=0, max_tokens=24)) for i, p in enumerate(prompts)]
        # the same prompts through the slots, staggered so rows join and leave mid-batch,
        # next to sampled rows (temperature on the GPU path, seeded top_p on the host path)
        async def later(i, p):
            await asyncio.sleep(0.05 * i)
            return ids_of(await run(slots, f"s{i}", p, temperature=0, max_tokens=24))

        noise = [run(slots, f"n{i}", prompts[i], temperature=1.0, max_tokens=30, ignore_eos=True) for i in range(2)]
        got, *sampled = await asyncio.gather(asyncio.gather(*[later(i, p) for i, p in enumerate(prompts)]), *noise)
        assert got == want
        for chunks in sampled:
            lps = [x for c in chunks for x in c.logprobs]
            assert len(ids_of(chunks)) == 30 and all(lp <= 0.0 for lp in lps)
        seeded = [ids_of(await run(slots, f"seed{i}", prompts[0], temperature=0.8, top_p=0.9, seed=7,
                                   max_tokens=12)) for i in range(2)]
        assert seeded[0] == seeded[1]
        assert slots.stats().num_running == 0 and slots.stats().kv_cache_usage == 0.0
        # on the CPU nothing is captured or compiled, and the start says so
        w = slots.warm_up
        assert w["kv_cache"] == "static" and w["cuda_graphs"] == 0 and not w["prefill_compiled"]
        assert w["prefill_eager_passes"] == 0 and w["load_s"] > 0
    finally:
        await dyn.shutdown()
        await slots.shutdown()


async def staggered(eng, tag, prompts, noise_tokens=80, **sampling):
    """Answers to ``prompts`` (greedy unless ``sampling`` says otherwise), sent 4 forward passes apart while a
    sampled stream decodes throughout, so each arrives alone while rows decode."""
    sampling = {"temperature": 0, "max_tokens": 24, **sampling}
    start = eng.stats().forward_passes
    noise = asyncio.create_task(run(eng, f"{tag}-noise", prompts[1], temperature=1.0, max_tokens=noise_tokens,
                                    ignore_eos=True))
    tasks = []
    for i, p in enumerate(prompts):
        while eng.stats().forward_passes < start + 4 * (i + 1):
            await asyncio.sleep(0.002)
        tasks.append(asyncio.create_task(run(eng, f"{tag}{i}", p, **sampling)))
    got = [ids_of(chunks) for chunks in await asyncio.gather(*tasks)]
    assert len(ids_of(await noise)) == noise_tokens
    return got


async def test_prompts_prefilled_inside_the_running_rows_decode_step_change_no_answer(embedded_model_dir):
    # on a GPU mixed passes are captured graphs; on the CPU the same pass runs directly, so the engine's side
    # (a free slot inside the rows, the first token read after the pass, the rows' tokens in flight) is checked
    eng = create_engine("hf", {"device": "cpu", "max_num_seqs": 6, "max_model_len": 512, "kv_cache": "static"})
    await eng.start()
    try:
        prompts = [eng.encode_chat([{"role": "user", "content": q}]) for q in
                   ("What is the capital of France?", "Name three colours.", "Count to five.", "Say hi.")]
        staggered_ = lambda tag, **kw: staggered(eng, tag, prompts, **kw)  # noqa: E731

        separate = await staggered_("sep")
        seeded = dict(temperature=0.8, seed=11, max_tokens=12)
        seeded_apart = await staggered_("seed-a", **seeded)
        assert eng.stats().mixed_passes == 0 and eng.warm_up["mixed_graphs"] == 0
        eng._slots.mixed_graph_tokens = 128
        eng._slots.capture_mixed_graphs()
        assert eng.warm_up["mixed_graphs"] == 2 * 1 * 2  # lengths 64, 128 x rows 6 x spans 256, 512
        passes = eng.stats().prefill_passes
        mixed = await staggered_("mix")
        assert mixed == separate
        # every greedy prompt arrived alone while the sampled stream decoded
        assert eng.stats().mixed_passes == len(prompts) == eng.stats().prefill_passes - passes - 1
        assert eng.stats().num_running == 0 and eng.stats().kv_cache_usage == 0.0
        # the first token drawn on the device (plain temperature: Gumbel-max), as the rows' are: at a temperature
        # this low the draw is the greedy pick, so a token lost, doubled or not made the row's input shows
        cold = await staggered_("cold", temperature=1e-6)
        assert cold == separate
        # sampling that needs the host (a seed) reads its first token right after the mixed pass, as after a
        # prefill; only the first prompt meets rows that all sample on the device, so only it goes mixed
        mixed = eng.stats().mixed_passes
        seeded_mixed = await staggered_("seed-m", **seeded)
        assert seeded_mixed == seeded_apart and eng.stats().mixed_passes == mixed + 1
        assert eng.stats().num_running == 0 and eng.stats().kv_cache_usage == 0.0
    finally:
        await eng.shutdown()


class HandOutLog:
    """Sinks for Engine.submit that write every request's chunks into one list of hand-outs, in the order the
    engine hands them out: one hand-out (the engine's one wake-up of this event loop per pass) is a list of
    (request id, tokens generated so far)."""

    def __init__(self):
        self.handouts: list[list[tuple[str, int]]] = []
        self.ended: set[str] = set()
        self._open = False

    def _close(self):
        self._open = False

    def sink(self, rid: str):
        log = self

        class _Sink:
            def put_nowait(self, item):
                if isinstance(item, BaseException):
                    raise AssertionError(f"{rid} failed: {item!r}")
                if not log._open:
                    # a hand-out's chunks are put in one callback; this runs right after it
                    log._open = True
                    log.handouts.append([])
                    asyncio.get_running_loop().call_soon(log._close)
                log.handouts[-1].append((rid, item.num_generated_tokens))
                if item.finish_reason is not None:
                    log.ended.add(rid)

        return _Sink()

    def with_item(self, item) -> list[tuple[str, int]]:
        return next(h for h in self.handouts if item in h)


async def test_a_step_hands_out_starting_then_ending_streams_then_the_rest_each_in_its_own_order():
    from serve_app.engines.base import EngineChunk
    from serve_app.engines.base import handout_order

    def chunk(rid, n_gen, finish=None, tokens=1):
        return EngineChunk(rid, [7] * tokens, "x", [0.0] * tokens, None, finish, 3, n_gen)

    a, b, c, d, e = (object() for _ in range(5))
    boom = EngineError("generation failed")
    outbox = [(a, chunk("a", 5)), (b, chunk("b", 9)), (c, chunk("c", 1)), (b, chunk("b", 9, "stop", 0)),
              (d, boom), (a, chunk("a", 6)), (e, chunk("e", 2, tokens=2))]
    order = [(rid, item) for rid, item in handout_order(outbox)]
    # c starts (its first token; e's two tokens are its first chunk too); b ends (a token, then its finish);
    # d failed; a goes on
    assert [x[1] for x in order] == [outbox[i][1] for i in (2, 6, 1, 3, 4, 0, 5)]


@contextlib.asynccontextmanager
async def mixed_engine(mixed_tokens: int = 128):
    """A static-slot engine on the CPU with mixed passes for prompts of up to ``mixed_tokens`` tokens (captured
    graphs on a GPU; on the CPU the same pass runs directly)."""
    eng = create_engine("hf", {"device": "cpu", "max_num_seqs": 6, "max_model_len": 512, "kv_cache": "static"})
    await eng.start()
    try:
        eng._slots.mixed_graph_tokens = mixed_tokens
        eng._slots.capture_mixed_graphs()
        yield eng
    finally:
        await eng.shutdown()


async def test_a_mixed_pass_hands_out_its_first_token_before_its_rows(embedded_model_dir):
    # every hop from the engine to the client (the engine thread, the engine process's relay, the replica, the
    # HTTP stream) takes a pass's chunks in the order the engine hands them out; a new prompt's first token
    # behind the 63 rows of its pass would wait for their work at each hop, so it goes first
    async with mixed_engine() as eng:
        log = HandOutLog()
        ids = eng.encode_chat([{"role": "user", "content": "Name three colours."}])
        loop = asyncio.get_running_loop()

        def submit(rid, **sampling):
            eng.submit(GenerationRequest(rid, ids, SamplingParams(**sampling)), log.sink(rid))

        async def until(rids):
            deadline = loop.time() + 60
            while not set(rids) <= log.ended:
                assert loop.time() < deadline, log.handouts[-4:]
                await asyncio.sleep(0.005)

        rows = [f"row{i}" for i in range(3)]
        for rid in rows:
            submit(rid, temperature=1.0, max_tokens=200, ignore_eos=True)
        while not log.handouts:
            await asyncio.sleep(0.005)
        mixed = eng.stats().mixed_passes
        checked = 0
        for i in range(3):
            submit(f"new{i}", temperature=0, max_tokens=2)
            await until([f"new{i}"])
            handout = log.with_item((f"new{i}", 1))
            if len([r for r, _ in handout if r in rows]) > len(rows):
                continue  # the loop ran two hand-outs in one turn (a busy box): the pass is not told apart
            assert handout[0] == (f"new{i}", 1), handout
            assert sorted(r for r, _ in handout[1:]) == rows, handout
            checked += 1
        assert checked, log.handouts
        assert eng.stats().mixed_passes == mixed + 3
        for rid in rows:
            await eng.abort(rid)
        await until(rows)


async def test_prompts_that_wait_together_go_one_per_mixed_pass_by_default(embedded_model_dir):
    # mixed_one_prompt_per_pass: prompts that wait together are taken one per mixed pass with the rows' decode
    # step instead of into one prefill pass that stalls the rows; the answers are the same either way
    async with mixed_engine() as eng:
        eng.options.mixed_graph_tokens = 128  # the option needs it (the helper set the decoder's)
        prompts = [eng.encode_chat([{"role": "user", "content": q}]) for q in
                   ("What is the capital of France?", "Name three colours.", "Count to five.")]

        async def together(tag):
            noise = asyncio.create_task(run(eng, f"{tag}-noise", prompts[1], temperature=1.0, max_tokens=80,
                                            ignore_eos=True))
            start = eng.stats().forward_passes
            while eng.stats().forward_passes < start + 3:  # the sampled row decodes
                await asyncio.sleep(0.002)
            before = eng.stats()
            # one turn of this loop submits all three (the engine takes its inbox between passes): they wait
            # together
            got = await asyncio.gather(*[run(eng, f"{tag}{i}", p, temperature=0, max_tokens=16)
                                         for i, p in enumerate(prompts)])
            after = eng.stats()
            await noise
            return ([ids_of(c) for c in got], after.prefill_passes - before.prefill_passes,
                    after.mixed_passes - before.mixed_passes)

        # the default (None) is on wherever mixed passes are: off first, as a benchmark's --compare switches it
        eng.update_options({"mixed_one_prompt_per_pass": False})
        apart, passes, mixed = await together("all")
        assert passes < len(prompts) and mixed < len(prompts)  # a pass of several prompts
        eng.update_options({"mixed_one_prompt_per_pass": None})
        # the SDPA kernel is chosen as the engine starts: a live change is refused, not stored unused
        with pytest.raises(InvalidRequestError, match="prompt_attention"):
            eng.update_options({"prompt_attention": "auto", "launch_lead_ms": 2.0})
        assert eng.options.launch_lead_ms != 2.0
        one, passes, mixed = await together("one")
        assert one == apart
        assert passes == mixed == len(prompts)  # each in its own mixed pass
        assert eng.stats().num_running == 0 and eng.stats().kv_cache_usage == 0.0


async def test_prompts_prefilled_in_chunks_inside_the_decode_steps_change_no_answer(embedded_model_dir):
    # chunked prefill (mixed_chunk_tokens): each prompt goes into its slot 64 tokens per mixed pass, the running
    # rows decoding in the same passes; the answers must be those of whole-prompt passes, every chunk must be one
    # pass, and a request cancelled between two of its chunks must give its slot back
    eng = create_engine("hf", {"device": "cpu", "max_num_seqs": 6, "max_model_len": 512, "kv_cache": "static"})
    await eng.start()
    try:
        facts = "Paris is in France. Rome is in Italy. Madrid is in Spain. Lisbon is in Portugal. "
        prompts = [eng.encode_chat([{"role": "user", "content": facts * k + q}]) for k, q in
                   ((2, "Where is Rome?"), (3, "Name three colours."), (4, "Where is Madrid?"),
                    (9, "Where is Lisbon?"))]
        lengths = [len(p) for p in prompts]
        # two chunks each, and the last prompt longer than any captured mixed pass (128): it is chunked too
        assert all(64 < n <= 128 for n in lengths[:3]) and 192 < lengths[3] <= 256, lengths
        chunks = [-(-n // 64) for n in lengths]
        whole = await staggered(eng, "whole", prompts)
        eng._slots.mixed_graph_tokens, eng._slots.mixed_chunk_tokens = 128, 64
        eng._slots.capture_mixed_graphs()
        eng.options.mixed_graph_tokens = 128
        eng.options.mixed_chunk_tokens = 64
        before = eng.stats()
        chunked = await staggered(eng, "chunk", prompts)
        assert chunked == whole
        after = eng.stats()
        # every prompt arrived alone while the sampled stream decoded: every chunk a mixed pass
        assert after.mixed_passes - before.mixed_passes == sum(chunks)
        assert after.prefill_passes - before.prefill_passes == sum(chunks) + 1  # + the sampled stream's own
        assert after.prompt_tokens - before.prompt_tokens == sum(lengths) + len(prompts[1])

        # cancelled between its two chunks
        noise = asyncio.create_task(run(eng, "c-noise", prompts[1], temperature=1.0, max_tokens=60, ignore_eos=True))
        while eng.stats().num_running == 0:
            await asyncio.sleep(0.002)
        victim = asyncio.create_task(run(eng, "c-victim", prompts[2], temperature=0, max_tokens=24))
        caught = False
        for _ in range(5000):
            seq = eng._chunked
            if seq is not None and seq.req.request_id == "c-victim" and 0 < seq.pos < lengths[2]:
                caught = True
                break
            await asyncio.sleep(0.001)
        assert caught, "the victim's prompt was never seen between two chunks"
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert len(ids_of(await noise)) == 60
        assert eng.stats().num_running == 0 and eng.stats().kv_cache_usage == 0.0
        assert eng._chunked is None and sorted(eng._free) == list(range(6))
        assert eng.stats().aborted_requests >= 1
        # and the engine still answers as before
        again = await staggered(eng, "again", prompts)
        assert again == whole
    finally:
        await eng.shutdown()


async def test_held_prompts_share_one_prefill_pass(engine):
    ids = engine.encode_text("The quick brown fox jumps over the lazy dog.")
    opts = engine.options
    base = (opts.max_prefill_wait_steps, opts.max_prefill_tokens, opts.prefill_hold_min_running)

    async def three_spaced_prompts(tag):
        # one stream decodes throughout, so holding is allowed; each prompt comes two forward passes after
        # the one before, so a prompt admitted on arrival has had its own pass by then
        start = engine.stats().prefill_passes
        long = asyncio.ensure_future(run(engine, f"{tag}-long", ids, max_tokens=400, ignore_eos=True))
        while engine.stats().prefill_passes == start:  # the long stream's own prefill is done
            await asyncio.sleep(0.005)
        before = engine.stats().prefill_passes
        sent = []
        for i in range(3):
            if sent:
                passes = engine.stats().forward_passes
                while engine.stats().forward_passes < passes + 2:
                    await asyncio.sleep(0.005)
            sent.append(asyncio.ensure_future(run(engine, f"{tag}-{i}", ids, temperature=0, max_tokens=4)))
        outs = await asyncio.gather(*sent)
        passes = engine.stats().prefill_passes - before
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        return passes, [text_of(o) for o in outs]

    try:
        opts.max_prefill_wait_steps = 0
        eager_passes, eager_texts = await three_spaced_prompts("now")
        # held for up to 1,000 passes, but a full pass's worth (the three prompts) goes at once
        # one running stream of the engine's rows is under the default fraction: hold whenever anything decodes
        opts.max_prefill_wait_steps, opts.max_prefill_tokens, opts.prefill_hold_min_running = 1000, 3 * len(ids), 0.0
        held_passes, held_texts = await three_spaced_prompts("held")
    finally:
        opts.max_prefill_wait_steps, opts.max_prefill_tokens, opts.prefill_hold_min_running = base
    assert eager_passes == 3
    assert held_passes == 1
    assert held_texts == eager_texts and all(held_texts)
