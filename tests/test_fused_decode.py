"""Fused projections and the compiled decode step (serve_app/engines/fused.py, slot_kv.py).

On the CPU: fusing changes no result (real SmolLM2, random Qwen2 with biases,
random Mistral), leaves unknown models alone, and one torch.compile serves
every decode bucket without recompiling (Inductor's C++ backend stands in for
its Triton one; the guards that caused recompiles are the same). The compiled
engine end to end needs a GPU.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from serve_app.engines.fused import fuse_projections
from serve_app.engines.slot_kv import ATTENTION_NAME, SlotDecoder, register_attention


def _tiny(arch: str):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=500, max_position_embeddings=256)
    if arch == "qwen2":  # q/k/v with biases
        return Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    return MistralForCausalLM(MistralConfig(**shape)).eval()


@pytest.fixture(scope="module")
def smollm2(embedded_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32,
                                                local_files_only=True).eval()


@pytest.mark.parametrize("arch", ["smollm2", "qwen2", "mistral"])
def test_fused_model_computes_what_the_unfused_one_does(arch, request):
    model = request.getfixturevalue("smollm2") if arch == "smollm2" else _tiny(arch)
    fused = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert fuse_projections(fused) == 2 * layers
    names = {n for n, _ in fused.named_parameters()}
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in model.parameters())
    ids = torch.randint(10, 400, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
        # with a KV cache, token by token
        a = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
        b = fused.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert a.tolist() == b.tolist()


def test_unknown_architecture_is_left_alone_and_fusing_twice_is_a_no_op():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100))
    before = [n for n, _ in gpt2.named_parameters()]
    assert fuse_projections(gpt2) == 0
    assert [n for n, _ in gpt2.named_parameters()] == before
    model = _tiny("qwen2")
    assert fuse_projections(model) == 4
    assert fuse_projections(model) == 0


def test_a_dropped_fused_model_frees_its_weights_without_a_garbage_collection():
    """Freed when the last reference goes, as an unfused model is: a forward bound to its own module is a
    reference cycle, and a 7B's decoder weights then stayed on the GPU until a full collection."""
    import gc
    import weakref

    model = _tiny("qwen2")
    fuse_projections(model)
    layer = model.model.layers[0]
    refs = [weakref.ref(x) for x in (layer.self_attn, layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight)]
    del layer
    gc.collect()
    gc.disable()
    try:
        del model
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()


def _decoder(model, compile_step: bool) -> SlotDecoder:
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    return SlotDecoder(model, num_slots=8, max_len=128, dtype=torch.float32, device=torch.device("cpu"),
                       use_graphs=False, batch_sizes=[1, 2, 4, 8], span_step=32, compile_step=compile_step)


needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="Inductor's CPU backend needs a C++ compiler")


def _eager_and_compiled(compile_step: bool, fuse: bool = True) -> tuple[SlotDecoder, SlotDecoder]:
    """Two decoders over one tiny Qwen2 (the second to be compiled), with Dynamo's caches and counters
    cleared so a test counts only its own compiles."""
    from torch._dynamo.utils import counters

    model = _tiny("qwen2")
    if fuse:
        fuse_projections(model)
    pair = _decoder(model, compile_step=False), _decoder(model, compile_step=compile_step)
    torch._dynamo.reset()
    counters.clear()
    return pair


def test_compiled_decoder_has_no_batch_of_one_and_a_spare_position():
    dec = _decoder(_tiny("qwen2"), compile_step=True)
    assert dec.batch_sizes == [2, 4, 8]
    assert dec.cache.keys[0].shape[2] == 129 and dec.spans[-1] == 128
    plain = _decoder(_tiny("qwen2"), compile_step=False)
    assert plain.batch_sizes == [1, 2, 4, 8] and plain.cache.keys[0].shape[2] == 128


def test_span_step_rebuckets_the_spans_up_to_the_full_length():
    dec = _decoder(_tiny("qwen2"), compile_step=True)
    assert dec.span_step == 32 and dec.spans == [32, 64, 96, 128]
    dec.span_step = 48
    assert dec.spans == [48, 96, 128] and dec.graphs == {}  # nothing captured on the CPU
    with torch.inference_mode():
        dec.prefill([[5, 6, 7]], [0], 0)
        dec.positions[0], dec.active[0] = 100, 1
        dec.decode(1, 101)  # without graphs a step runs at its exact span; the buckets only pick graphs
    assert dec.positions[0].item() == 101


@needs_cxx
def test_one_compile_serves_every_decode_bucket_with_the_eager_results():
    from torch._dynamo.utils import counters

    eager, compiled = _eager_and_compiled(compile_step=True)
    with torch.inference_mode():
        compiled.compile_prefill_pass()  # as capture() does on a GPU: the prefill compiles first
        compiled.compile()
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 3
        for dec in (eager, compiled):
            dec.prefill([[5 + i] * (3 + i) for i in range(8)], list(range(8)), 0)
            dec.positions.copy_(torch.tensor([3 + i for i in range(8)]))
            dec.tokens.copy_(torch.arange(100, 108))
        for rows in compiled.batch_sizes:
            for span in compiled.spans:
                for dec in (eager, compiled):  # the step writes its greedy tokens back: same inputs each time
                    dec.tokens.copy_(torch.arange(100, 108))
                torch.testing.assert_close(compiled._step(rows, span), eager._step(rows, span), rtol=1e-4, atol=1e-4)
    # the buckets' shapes (batch 2..8, spans 32..128 including the full length) reused the first compile
    assert counters["stats"]["unique_graphs"] == graphs


@needs_cxx
@pytest.mark.parametrize("narrowed", [False, True], ids=["torch-pick", "flash-multi-prompt"])
def test_two_warm_up_compiles_serve_every_prefill_shape_with_the_eager_results(monkeypatch, narrowed):
    from torch._dynamo.utils import counters

    from tests.test_prompt_attention import _engines_narrowing

    if narrowed:  # prompt_attention 'flash_multi_prompt' (set on CUDA only): its sdpa_kernel block in the traced pass
        _engines_narrowing(monkeypatch)
    eager, compiled = _eager_and_compiled(compile_step=False)
    with torch.inference_mode():
        compiled.compile_prefill_pass()
        assert compiled.prefill_compile_error is None and compiled.prefill_compiled
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == 2  # one prompt, and two or more
        # one prompt of one token (padded to two), one long prompt, ragged batches of 2..8 prompts
        shapes = [[1], [57], [3, 9], [17, 2, 40], [5 + 11 * i for i in range(8)]]
        for lengths in shapes:
            prompts = [[(7 * i + j) % 450 + 20 for j in range(n)] for i, n in enumerate(lengths)]
            slots = list(range(len(prompts)))[::-1]
            want = eager.prefill(prompts, slots, 0)
            got = compiled.prefill(prompts, slots, 0)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for layer in range(len(eager.cache.keys)):  # the same keys and values landed in the same slots
                for s, n in zip(slots, lengths):
                    torch.testing.assert_close(compiled.cache.keys[layer][s, :, :n], eager.cache.keys[layer][s, :, :n],
                                               rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(compiled.cache.values[layer][s, :, :n],
                                               eager.cache.values[layer][s, :, :n], rtol=1e-4, atol=1e-4)
    # no shape compiled anew, and none fell back to the eager pass
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled.prefill_eager_passes == 0


@needs_cxx
def test_the_compiled_prefill_writes_its_prompts_in_place_and_nowhere_else():
    """A write into the view k[:, :, :n] (index_copy_, as the pass had it) compiles into a copy of that view
    for every slot, the write, and a copy back: on the H200 7B at 64 slots, a replayed one-prompt pass of 512
    tokens took 13.36 ms with it and 10.58 without (docs/gpu_notes.md run 58).
    The pass must allocate nothing the size of all slots, and must leave the other slots' keys and values,
    and the positions past the pass's length, as they were."""
    from torch._inductor.utils import run_and_get_code

    register_attention()
    model = _tiny("qwen2")
    model.set_attn_implementation(ATTENTION_NAME)
    slots = 61  # a count no other dimension of the tiny model has, to find it in the generated code
    dec = SlotDecoder(model, num_slots=slots, max_len=128, dtype=torch.float32, device=torch.device("cpu"),
                      use_graphs=False, batch_sizes=[2], span_step=32, compile_prefill=True)
    torch._dynamo.reset()
    with torch.inference_mode():
        _, code = run_and_get_code(dec.compile_prefill_pass)
        assert dec.prefill_compile_error is None
        allocations = [line for c in code for line in c.splitlines() if "= empty_strided" in line]
        assert allocations and not [a for a in allocations if f"(({slots}, " in a]
        for t in dec.cache.keys + dec.cache.values:
            t.fill_(7.0)
        lengths, where = [9, 30], [40, 3]
        dec.prefill([[20 + i] * n for i, n in enumerate(lengths)], where, 0)
    for t in dec.cache.keys + dec.cache.values:
        written = torch.zeros_like(t, dtype=torch.bool)
        for s in where:  # a pass pads its prompts on the right to the longest; the padding's keys are written too
            written[s, :, :max(lengths)] = True
        assert (t[~written] == 7.0).all()
        assert (t[written] != 7.0).all()


@needs_cxx
def test_one_prompt_passes_padded_to_the_captured_lengths_leave_what_the_exact_pass_leaves():
    # on a GPU these lengths are CUDA graphs; here the same compiled pass runs on the same padded
    # buffers, which is what a replay computes: the padding must change no logit, key, value or next step
    from torch._dynamo.utils import counters

    eager, compiled = _eager_and_compiled(compile_step=True)  # as in the engine: one spare position
    compiled.prefill_graph_tokens = 128
    with torch.inference_mode():
        compiled.compile_prefill_pass()
        compiled.capture_prefill_graphs()
        assert compiled.prefill_graph_lengths == [64, 128] and compiled.prefill_graphs
        graphs = counters["stats"]["unique_graphs"]
        for slot, n in enumerate([1, 5, 63, 64, 65, 128]):
            prompt = [(11 * slot + j) % 450 + 20 for j in range(n)]
            torch.testing.assert_close(compiled.prefill([prompt], [slot], 3), eager.prefill([prompt], [slot], 0),
                                       rtol=1e-4, atol=1e-4)
            for layer in range(len(eager.cache.keys)):
                torch.testing.assert_close(compiled.cache.keys[layer][slot, :, :n],
                                           eager.cache.keys[layer][slot, :, :n], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(compiled.cache.values[layer][slot, :, :n],
                                           eager.cache.values[layer][slot, :, :n], rtol=1e-4, atol=1e-4)
        assert compiled.prefill_graph_passes == 6
        # the next decode step attends over the prompts only: the padding behind them is masked, then overwritten
        lengths = torch.tensor([1, 5, 63, 64, 65, 127])  # the 128-token prompt's slot decodes its last position
        for dec in (eager, compiled):
            dec.positions[:6], dec.active[:6], dec.tokens[:6] = lengths, 1, 42
        torch.testing.assert_close(compiled._step(6, 128)[0], eager._step(6, 128)[0], rtol=1e-4, atol=1e-4)
        # past the longest captured length, or several prompts: the uncaptured pass
        compiled.prefill_graph_tokens = 64
        compiled.capture_prefill_graphs()
        assert compiled.prefill_graph_lengths == [64]
        compiled.prefill([[7] * 100], [6], 0)
        compiled.prefill([[7] * 10, [8] * 12], [6, 7], 0)
        assert compiled.prefill_graph_passes == 6
    assert counters["stats"]["unique_graphs"] == graphs  # no length compiled anew
    assert compiled.prefill_eager_passes == 0


@needs_cxx
def test_one_compiled_mixed_pass_does_what_a_decode_step_then_a_prefill_do():
    # the captured mixed passes are this compiled function at each (prompt length, rows, span); here the
    # keys run it directly on the same buffers. The new prompt's slot (3) lies inside the decode rows: its
    # free row writes position 0 in the same pass, and the prompt must win
    from torch._dynamo.utils import counters

    eager, compiled = _eager_and_compiled(compile_step=True)
    compiled.mixed_graph_tokens, compiled.mixed_rows = 128, [4, 8]
    with torch.inference_mode():
        compiled.compile_mixed_pass()
        compiled.capture_mixed_graphs()
        assert compiled.mixed_compile_error is None and compiled.mixed_graphs
        assert len(compiled.mixed_graph_keys) == 2 * 2 * 4  # lengths 64, 128 x rows 4, 8 x spans 32..128
        graphs = counters["stats"]["unique_graphs"]
        running = {0: 7, 1: 12, 2: 3, 4: 20}
        for dec in (eager, compiled):
            for slot, n in running.items():
                dec.prefill([[30 + slot + j for j in range(n)]], [slot], 0)
                dec.positions[slot], dec.active[slot], dec.tokens[slot] = n, 1, 100 + slot
        for step, (n, slot) in enumerate([(23, 3), (70, 5), (2, 6)]):
            prompt = [(50 + 7 * step + j) % 450 + 20 for j in range(n)]
            rows = max(running) + 1
            longest = max(running.values()) + 1
            logits, chosen, lp = (t.clone() for t in eager._step(rows, longest))
            want_prompt = eager.prefill([prompt], [slot], 0)
            key = compiled.mixed_key(n, rows, longest)  # the prompt attends over itself: the span is the rows'
            assert key == (64 if n <= 64 else 128, 8, next(s for s in compiled.spans if s >= longest), False)
            got_prompt, (got_logits, got_chosen, got_lp) = compiled.mixed(key, prompt, slot, 3)
            torch.testing.assert_close(got_prompt, want_prompt, rtol=1e-4, atol=1e-4)
            for r in running:
                torch.testing.assert_close(got_logits[r], logits[r], rtol=1e-4, atol=1e-4)
                assert got_chosen[r] == chosen[r]
                torch.testing.assert_close(got_lp[r], lp[r], rtol=1e-4, atol=1e-4)
            # the free row's token is noise either way (the host overwrites it with the prompt's first token); its
            # position points past the (padded) prompt, where a decode step before the host sets it writes harmlessly
            want_positions = eager.positions.clone()
            want_positions[slot] = key[0]
            assert torch.equal(compiled.positions, want_positions)
            assert all(compiled.tokens[r] == eager.tokens[r] for r in running)
            for r in running:
                running[r] += 1
            for layer in range(len(eager.cache.keys)):
                for s, end in {**running, slot: n}.items():
                    torch.testing.assert_close(compiled.cache.keys[layer][s, :, :end],
                                               eager.cache.keys[layer][s, :, :end], rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(compiled.cache.values[layer][s, :, :end],
                                               eager.cache.values[layer][s, :, :end], rtol=1e-4, atol=1e-4)
            for dec in (eager, compiled):  # the new sequence decodes from the next step on
                dec.positions[slot], dec.active[slot], dec.tokens[slot] = n, 1, 200 + slot
            running[slot] = n
        compiled.mixed((64, 4, 128, False), [5] * 10, 7, 0)  # the other row count, at the full span
        # past the longest captured prompt, the rows or the spans: no mixed pass
        assert compiled.mixed_key(129, 2, 10) is None and compiled.mixed_key(10, 9, 10) is None
        assert compiled.mixed_key(10, 2, 129) is not None  # spans clamp to the longest, as decode's do
    assert counters["stats"]["unique_graphs"] == graphs  # every key reused the one compile
    assert compiled.mixed_graph_passes == 4


@needs_cxx
def test_a_prompt_prefilled_in_chunks_inside_decode_steps_leaves_what_one_prefill_pass_does():
    # chunked prefill: a 100-token prompt goes into slot 5 as chunks of 64 and 36 tokens, each in a mixed pass
    # with the running rows' decode step, and a plain decode step that covers the (still free) slot runs
    # between the two. Against it: the same decode steps, then the whole prompt in one eager prefill pass.
    # The second chunk must attend to the first, the free row's writes must land where a
    # chunk overwrites them, and the rows must decode as if no prompt shared their passes
    from torch._dynamo.utils import counters

    eager, compiled = _eager_and_compiled(compile_step=True)
    compiled.mixed_graph_tokens, compiled.mixed_chunk_tokens, compiled.mixed_rows = 128, 64, [4, 8]
    with torch.inference_mode():
        compiled.compile_mixed_pass()
        compiled.capture_mixed_graphs()
        assert compiled.mixed_compile_error is None and compiled.mixed_graphs
        # from a prompt's first position: lengths 64, 128; later chunks: 64 (the chunk size) x rows 4, 8 x 4 spans
        assert len(compiled.mixed_graph_keys) == (2 + 1) * 2 * 4
        graphs = counters["stats"]["unique_graphs"]
        running = {0: 7, 1: 12, 2: 3, 4: 20}
        for dec in (eager, compiled):
            for t in dec.cache.keys + dec.cache.values:
                t.fill_(3.0)  # a former occupant's keys and values, which no chunk may attend to
            for slot, n in running.items():
                dec.prefill([[30 + slot + j for j in range(n)]], [slot], 0)
                dec.positions[slot], dec.active[slot], dec.tokens[slot] = n, 1, 100 + slot
        slot, prompt = 5, [(13 * j) % 450 + 20 for j in range(100)]

        def rows_match(got, want):
            for r in running:
                torch.testing.assert_close(got[0][r], want[0][r], rtol=1e-4, atol=1e-4)
                assert got[1][r] == want[1][r]

        prompt_logits = None
        for chunk in [(0, 64), None, (64, 100)]:
            longest = max(running.values()) + 1
            if chunk is None:  # a plain decode step over 8 rows, the free slot's among them
                rows_match(compiled._step(8, compiled.spans[-1]), tuple(t.clone() for t in eager._step(8, longest)))
            else:
                start, end = chunk
                want = tuple(t.clone() for t in eager._step(5, longest))
                # a later chunk attends over its slot: its span covers it too
                span = max(longest, end) if start else longest
                key = compiled.mixed_key(end - start, 5, span, resumes=start > 0)
                assert key == (64, 8, next(s for s in compiled.spans if s >= span), start > 0)
                prompt_logits, step = compiled.mixed(key, prompt[start:end], slot, 0, start=start)
                rows_match(step, want)
                assert compiled.positions[slot] == start + 64  # past the chunk, padding included
            for r in running:
                running[r] += 1
        torch.testing.assert_close(prompt_logits, eager.prefill([prompt], [slot], 0), rtol=1e-4, atol=1e-4)
        for layer in range(len(eager.cache.keys)):
            for s, end in {**running, slot: 100}.items():
                torch.testing.assert_close(compiled.cache.keys[layer][s, :, :end], eager.cache.keys[layer][s, :, :end],
                                           rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(compiled.cache.values[layer][s, :, :end],
                                           eager.cache.values[layer][s, :, :end], rtol=1e-4, atol=1e-4)
        # the new sequence decodes from the next step on, over the keys its chunks wrote
        for dec in (eager, compiled):
            dec.positions[slot], dec.active[slot], dec.tokens[slot] = 100, 1, 77
        running[slot] = 100
        longest = max(running.values()) + 1
        got, want = compiled._step(6, longest), eager._step(6, longest)
        torch.testing.assert_close(got[0][slot], want[0][slot], rtol=1e-4, atol=1e-4)
        # a chunk whose keys would run past the buffers, or past the key's span, or a pass of the other form
        # (a later chunk's from position 0, a first one's from another) is refused
        with pytest.raises(ValueError, match="does not fit"):
            compiled.mixed((64, 8, 128, True), [1] * 64, slot, 0, start=100)
        with pytest.raises(ValueError, match="does not fit"):
            compiled.mixed((64, 8, 32, True), [1] * 40, slot, 0, start=64)
        with pytest.raises(ValueError, match="does not fit"):
            compiled.mixed((64, 8, 128, False), [1] * 40, slot, 0, start=64)
        with pytest.raises(ValueError, match="does not fit"):
            compiled.mixed((64, 8, 128, True), [1] * 40, slot, 0, start=0)
    assert counters["stats"]["unique_graphs"] == graphs  # every chunk reused the one compile
    assert compiled.mixed_graph_passes == 2


@needs_cxx
def test_a_prefill_shape_the_warm_up_missed_runs_eagerly_without_compiling():
    from torch._dynamo.utils import counters

    eager, compiled = _eager_and_compiled(compile_step=False)
    with torch.inference_mode():
        compiled.compile_prefill_pass(warm=((1, 19),))  # one prompt only: two are a shape it did not compile
        graphs = counters["stats"]["unique_graphs"]
        prompts = [[9, 10, 11], [12, 13, 14, 15, 16]]
        torch.testing.assert_close(compiled.prefill(prompts, [0, 1], 0), eager.prefill(prompts, [0, 1], 0),
                                   rtol=1e-4, atol=1e-4)
        compiled.prefill([[3] * 30], [2], 0)  # a covered shape still runs compiled
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled.prefill_eager_passes == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled CUDA-graph decode needs a GPU")
@pytest.mark.asyncio
async def test_compiled_cuda_engine_answers_like_the_eager_one(embedded_model_dir):
    from serve_app.engines.base import GenerationRequest, SamplingParams
    from serve_app.engines.registry import create_engine

    outs = []
    for compile_decode in (False, True):
        eng = create_engine("hf", {"device": "cuda", "dtype": "float32", "max_num_seqs": 4, "max_model_len": 512,
                                   "kv_cache": "static", "compile_decode": compile_decode})
        await eng.start()
        ids = eng.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        toks = []
        async for c in eng.generate(GenerationRequest("g", ids, SamplingParams(max_tokens=12, temperature=0))):
            toks += c.token_ids
        outs.append(toks)
        await eng.shutdown()
    assert outs[0] == outs[1]


@needs_cxx
def test_a_failed_compile_leaves_a_working_eager_step():
    import torch._inductor.config as inductor_config

    eager, compiled = _eager_and_compiled(compile_step=True, fuse=False)
    # the node has no usable C compiler (what Triton's launcher needs on a GPU node); patch(), not
    # monkeypatch: undoing a setattr on the config proxy deletes the option for every later test
    with torch.inference_mode(), inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        compiled.compile()
        assert compiled.compile_error is not None
        for dec in (eager, compiled):
            dec.prefill([[7, 8, 9]] * 2, [0, 1], 0)
            dec.positions[:2] = 3
            dec.tokens[:2] = 42
        torch.testing.assert_close(compiled._step(2, 32), eager._step(2, 32))


@needs_cxx
def test_a_failed_prefill_compile_leaves_a_working_eager_pass():
    import torch._inductor.config as inductor_config

    eager, compiled = _eager_and_compiled(compile_step=False, fuse=False)
    with torch.inference_mode(), inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        compiled.compile_prefill_pass()
        assert compiled.prefill_compile_error is not None and not compiled.prefill_compiled
        prompts = [[7, 8, 9], [10, 11]]
        torch.testing.assert_close(compiled.prefill(prompts, [0, 1], 0), eager.prefill(prompts, [0, 1], 0))
    assert compiled.prefill_eager_passes == 0  # eager by choice, not a shape the compile missed


def test_the_decode_probe_reads_the_logits_of_a_real_decode_step():
    # gpu_decode_probe.py runs only on the GPU, where a wrong read costs a device call: run 51's first probe
    # timed both its variants and then lost them to a read written for the step's older, bare-logits output
    from benchmarks.gpu_decode_probe import step_logits

    dec = _decoder(_tiny("qwen2"), compile_step=False)
    with torch.inference_mode():
        dec.positions.fill_(7)
        dec.tokens.fill_(123)
        out = dec._step(2, 32)
    logits = step_logits(out)
    assert logits.shape == (2, 500)
    # the probe's argmax is the step's own greedy pick
    assert logits.argmax(-1).tolist() == out[1][:2].reshape(-1).tolist()


def test_the_decode_probe_profiles_the_compiled_prefill_pass_without_an_eager_miss():
    # --prefill-profile also runs only on the GPU: the same pass, compiled as the engine's warm-up compiles
    # it, here on the CPU (no CUDA kernels to profile), so a stale call in it cannot cost a device call
    from benchmarks.gpu_decode_probe import prefill_profile

    rows = prefill_profile(_tiny("qwen2"), prompts=(1, 2, 3), length=24, device="cpu")
    assert rows[0]["compile_error"] is None and rows[0]["compile_s"] > 0
    assert [(r["prompts"], r["graph"]) for r in rows[1:]] == [(1, False), (2, False), (3, False), (1, True)]
    assert [r["tokens"] for r in rows[1:]] == [24, 48, 72, 24]
    # every shape hit one of the warm-up's two compiles, and the last row ran the captured lengths' path
    assert all(r["eager_passes"] == 0 and r["ms"] > 0 for r in rows[1:])
    assert rows[0]["graphs"] == 1 and rows[0]["graph_error"] is None  # 24 tokens: the 64-token length only
    assert rows[-1]["graph_passes"] > 0 and rows[-2]["graph_passes"] == 0


def test_the_compile_cache_counts_say_whether_a_compile_found_the_disk_cache(monkeypatch, tmp_path):
    # the engine's warm-up reports them (a Ray replica's compiles on an H200 missed a warm cache, gpu_notes run 88);
    # a real torch.compile on the CPU, into a fresh cache directory, then the same graph again from that cache
    from serve_app.engines.slot_kv import compile_cache_counts

    def total(counts: dict, kind: str) -> int:
        return sum(v for k, v in counts.items() if kind in k)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    before = compile_cache_counts()
    torch.compile(lambda x: torch.nn.functional.silu(x) * 3)(torch.randn(8, 8))
    first = compile_cache_counts()
    assert total(first, "cache_miss") > total(before, "cache_miss")
    # the same graph from another function: traced again, and its compiled code found in the cache
    torch.compile(lambda y: torch.nn.functional.silu(y) * 3)(torch.randn(8, 8))
    assert total(compile_cache_counts(), "cache_hit") > total(first, "cache_hit")
