"""benchmarks/gpu_answers_check.py: its verdicts, and the script itself run on the CPU box (where both engines
take the plain path) with and without a fault put into the path only its fast engine takes."""

import argparse
import asyncio

import pytest

from benchmarks.gpu_answers_check import Answer, compare, run, schedule, truth_verdict


def _ref(tokens, gaps):
    # the reference's pick at each position, a runner-up `gap` nats behind it and a third `gap` + 0.1 behind
    return Answer(tokens, [-1.0] * len(tokens),
                  [[(t, -1.0), (t + 1, -1.0 - g), (t + 2, -1.1 - g)] for t, g in zip(tokens, gaps)])


def test_identical_answers_pass():
    ref = _ref([5, 6, 7], [0.5, 0.5, 0.5])
    v = compare(ref, Answer([5, 6, 7], [-1.0, -1.0005, -1.0], None), tie_nats=1e-3, logprob_nats=1e-3)
    assert v["ok"] and v["shared"] == 3 and v["why"] == "identical"


def test_parting_within_the_bound_to_a_listed_token_passes_and_anywhere_else_fails():
    ref = _ref([5, 6, 7, 8], [0.5, 0.0004, 0.5, 0.5])
    tie = compare(ref, Answer([5, 7, 1, 1], [-1.0] * 4, None), tie_nats=1e-3, logprob_nats=1e-3)
    assert tie["ok"] and tie["shared"] == 1 and tie["parted_at_gap"] == pytest.approx(0.0004)
    assert tie["parted_at_rank"] == 2
    # the same place, but to a token the reference did not list among its likeliest
    unlisted = compare(ref, Answer([5, 9, 1, 1], [-1.0] * 4, None), 1e-3, 1e-3)
    assert not unlisted["ok"] and "not among the reference's top 3" in unlisted["why"]
    # the runner-up, but where the reference was sure
    sure = compare(ref, Answer([5, 6, 8, 1], [-1.0] * 4, None), 1e-3, 1e-3)
    assert not sure["ok"] and "0.5 nats ahead" in sure["why"]


def test_a_pick_below_the_runner_up_passes_when_within_the_bound():
    # bf16 on run 127: the engine took the reference's third, 0.06 nats behind its pick
    ref = _ref([5, 6], [0.02, 0.5])
    third = compare(ref, Answer([7, 1], [-1.0] * 2, None), tie_nats=0.5, logprob_nats=0.5)
    assert third["ok"] and third["parted_at_rank"] == 3 and third["parted_at_gap"] == pytest.approx(0.12)
    assert not compare(ref, Answer([7, 1], [-1.0] * 2, None), tie_nats=0.1, logprob_nats=0.5)["ok"]


def test_an_exact_tie_is_judged_from_the_reference_pick_not_the_listing_order():
    # equal logprobs: the listing may put either first; the pick (argmax: the lower id) is what the engine took
    ref = Answer([39377], [-2.0], [[(39957, -2.0), (39377, -2.0)]])
    assert compare(ref, Answer([39957], [-2.0], None), 0.25, 0.25)["ok"]


def test_a_drift_in_shared_tokens_or_a_short_answer_fails():
    ref = _ref([5, 6, 7], [0.5, 0.5, 0.5])
    drift = compare(ref, Answer([5, 6, 7], [-1.0, -1.01, -1.0], None), 1e-3, 1e-3)
    assert not drift["ok"] and drift["max_dlogprob"] == pytest.approx(0.01)
    assert not compare(ref, Answer([5, 6], [-1.0, -1.0], None), 1e-3, 1e-3)["ok"]


def test_the_load_bursts_then_trickles_with_lengths_scaled_to_the_context():
    load = schedule(200, known=1000)
    assert [t for t, _ in load[:8]] == [0.0] * 8 and load[8][0] == 0.3 and len(load) == 56  # > 32 slots
    assert max(len(ids) for _, ids in load) == 200 and min(len(ids) for _, ids in load) >= 1
    assert all(100 <= i < 1000 for _, ids in load for i in ids)
    assert schedule(200, 1000) == load  # seeded: both engines get the same prompts


def _args(tmp_path, embedded_model_dir, cases):
    # SmolLM2's directory as the tokenizer: the script reads its tokenizer.json and copies only its tokenizer files
    return argparse.Namespace(tokenizer=str(embedded_model_dir), work=str(tmp_path), device="cpu",
                              model_config="tiny", max_model_len=256, cases=cases, out=str(tmp_path / "out"))


def _fault_in_the_fast_path(monkeypatch, factor):
    """One layer's MLP output scaled by ``factor`` in a path only the fast engine takes (it fuses projections,
    the reference does not)."""
    import serve_app.engines.fused as fused

    real = fused.fuse_projections

    def faulty(model):
        out = real(model)
        model.model.layers[1].mlp.down_proj.weight.data.mul_(factor)
        return out

    monkeypatch.setattr(fused, "fuse_projections", faulty)


def test_the_script_passes_engines_that_agree_and_fails_a_fast_path_that_computes_otherwise(
        tmp_path, embedded_model_dir, monkeypatch):
    args = _args(tmp_path, embedded_model_dir, ["float32"])
    rows = asyncio.run(run(args))
    assert rows[0]["ok"] and rows[0]["identical"] == rows[0]["requests"] == 56, rows[0]["failures"]
    assert rows[0]["distinct_tokens_per_answer_median"] > 8  # the random model's answers depend on the context

    _fault_in_the_fast_path(monkeypatch, 1.01)
    rows = asyncio.run(run(args))
    assert not rows[0]["ok"] and rows[0]["failed"] > 0
    assert any("logprob differs" in f["why"] or "parted at token" in f["why"] for f in rows[0]["failures"])


def test_bf16_is_judged_against_the_float32_truth_and_fails_a_gross_fault(tmp_path, embedded_model_dir,
                                                                          monkeypatch):
    args = _args(tmp_path, embedded_model_dir, ["bf16"])
    row = asyncio.run(run(args))[0]
    assert row["ok"], row["against_truth"]
    # bf16 keeps the truth's tokens a while, but not all of them (or the check would see nothing)
    assert 5 < row["against_truth"]["eager"]["shared_mean"] < 48

    _fault_in_the_fast_path(monkeypatch, 1.5)
    row = asyncio.run(run(args))[0]
    assert not row["ok"] and "fewer of the truth's tokens" in row["against_truth"]["why"]


def _close(shared, outside=None, length_ok=True):
    outside = outside or [False] * len(shared)
    return [{"shared": s, "outside": o, "max_dlogprob": 0.1, "length_ok": length_ok} for s, o in zip(shared, outside)]


def test_against_the_truth_the_fast_engine_fails_only_when_significantly_farther_than_eager():
    eager = _close([10, 12, 8, 11] * 10)
    assert truth_verdict(eager, _close([11, 11, 8, 10] * 10))["ok"]  # as close, give or take
    worse = truth_verdict(eager, _close([5, 6, 4, 5] * 10))
    assert not worse["ok"] and "fewer of the truth's tokens" in worse["why"]
    # noisy requests: a mean one token lower is within three standard errors
    noisy_eager = _close([0, 40, 2, 30] * 10)
    assert truth_verdict(noisy_eager, _close([40, 0, 30, 0] * 10))["ok"]
    outside = truth_verdict(eager, _close([10, 12, 8, 11] * 10, [True, True, False, False] * 10))
    assert not outside["ok"] and "outside the truth's top 5" in outside["why"]
    assert not truth_verdict(eager, _close([10, 12, 8, 11] * 10, length_ok=False))["ok"]


@pytest.mark.parametrize("case", ["float32", "bf16", "fp8", "float32-chunks"])
def test_every_case_s_engines_are_valid_gpu_configurations(case):
    # a configuration the engine refuses would cost a device call to find out
    from pathlib import Path

    from serve_app.engines.options import HFEngineOptions
    from benchmarks.gpu_answers_check import CASES, engine_options

    dtype, quant, _, _, chunked = CASES[case]
    ref = HFEngineOptions(**engine_options(Path("m"), "cuda", dtype, quant, False, 2048, chunked))
    fast = HFEngineOptions(**engine_options(Path("m"), "cuda", dtype, quant, True, 2048, chunked))
    assert not ref.cuda_graphs and not ref.compile_decode and not ref.fuse_projections and ref.mixed_graph_tokens == 0
    assert fast.cuda_graphs and fast.compile_decode and fast.compile_prefill and fast.fuse_projections
    assert fast.mixed_graph_tokens == 512 and fast.prefill_graph_tokens > 0
    assert fast.mixed_chunk_tokens == (256 if chunked else 0)
    assert (ref.quantization, fast.quantization, ref.dtype, fast.dtype) == (quant, quant, dtype, dtype)
