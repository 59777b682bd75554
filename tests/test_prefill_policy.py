"""The prefill-holding rule (serve_app/engines/prefill_policy.py), as a pure function."""

import pytest

from serve_app.engines.prefill_policy import PrefillContext, hold_prefill


def ctx(**kw):
    base = dict(running=40, free_rows=24, waiting=2, waiting_tokens=1024, oldest_waited_steps=3,
                max_prefill_tokens=2048, max_wait_steps=8, max_rows=64, min_running=0.5)
    return PrefillContext(**{**base, **kw})


def test_a_partial_pass_is_held_while_others_decode():
    held, why = hold_prefill(ctx())
    assert held and "fuller pass" in why


@pytest.mark.parametrize("change, reason", [
    (dict(waiting=0, waiting_tokens=0), "nothing waiting"),
    (dict(max_wait_steps=0), "off"),
    (dict(running=0), "nothing decoding"),
    (dict(running=31), "few rows decoding"),
    (dict(running=20, min_running=0.4), "few rows decoding"),
    (dict(waiting_tokens=2048), "full pass"),
    (dict(waiting=24), "every free row"),
    (dict(free_rows=2), "every free row"),
    (dict(oldest_waited_steps=8), "its limit"),
])
def test_each_reason_to_go_now(change, reason):
    held, why = hold_prefill(ctx(**change))
    assert not held and reason in why


def test_holding_starts_at_the_running_fraction():
    assert hold_prefill(ctx(running=32))[0]
    assert hold_prefill(ctx(running=1, min_running=0.0))[0]
    assert not hold_prefill(ctx(running=63, min_running=1.0))[0]


def test_the_wait_limit_counts_passes_from_zero():
    assert hold_prefill(ctx(oldest_waited_steps=0))[0]
    assert hold_prefill(ctx(oldest_waited_steps=7))[0]
    assert not hold_prefill(ctx(oldest_waited_steps=9))[0]


def test_the_engine_option_holds_only_when_set():
    from serve_app.engines.options import HFEngineOptions

    assert HFEngineOptions().max_prefill_wait_steps == 0
    assert HFEngineOptions(max_prefill_wait_steps=3).max_prefill_wait_steps == 3
    with pytest.raises(ValueError, match="max_prefill_wait_steps"):
        HFEngineOptions(max_prefill_wait_steps=-1)


def test_one_prompt_per_mixed_pass_needs_mixed_passes():
    from serve_app.engines.options import HFEngineOptions

    # the default follows mixed passes: on with them, off (and no error) without
    assert HFEngineOptions().resolved_one_prompt_per_pass is False
    assert HFEngineOptions(mixed_graph_tokens=512).resolved_one_prompt_per_pass is True
    off = HFEngineOptions(mixed_graph_tokens=512, mixed_one_prompt_per_pass=False)
    assert off.resolved_one_prompt_per_pass is False
    with pytest.raises(ValueError, match="set mixed_graph_tokens"):
        HFEngineOptions(mixed_one_prompt_per_pass=True)
    opts = HFEngineOptions(mixed_graph_tokens=512, mixed_one_prompt_per_pass=True)
    with pytest.raises(ValueError, match="set mixed_graph_tokens"):  # and nothing is left half-applied
        opts.mixed_graph_tokens = 0
    assert opts.mixed_graph_tokens == 512


def test_chunked_prefill_needs_whole_captured_lengths_and_mixed_passes_that_long():
    from serve_app.engines.options import HFEngineOptions

    assert HFEngineOptions().mixed_chunk_tokens == 0
    assert HFEngineOptions(mixed_graph_tokens=512, mixed_chunk_tokens=448).mixed_chunk_tokens == 448
    with pytest.raises(ValueError, match="multiple of 64"):
        HFEngineOptions(mixed_graph_tokens=512, mixed_chunk_tokens=100)
    with pytest.raises(ValueError, match="mixed_graph_tokens is 256"):
        HFEngineOptions(mixed_graph_tokens=256, mixed_chunk_tokens=448)
    opts = HFEngineOptions(mixed_graph_tokens=512, mixed_chunk_tokens=448)
    with pytest.raises(ValueError, match="mixed_graph_tokens is 0"):  # and nothing is left half-applied
        opts.mixed_graph_tokens = 0
    assert opts.mixed_graph_tokens == 512
