"""The attention probe's variants compute the engine's decode attention (CPU, small shapes).

The probe's GPU timings are only worth reading if each variant attends as the engine does: each query head
to its own KV head, each row only up to its own position.
"""

import pytest

torch = pytest.importorskip("torch")

from benchmarks.gpu_attention_probe import make_inputs, run_variant  # noqa: E402


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(torch, rows=3, span=48, max_len=64, layers=1, slots=3, device=torch.device("cpu"))


@pytest.mark.parametrize("variant", ["engine", "engine_reduce", "sdpa_default", "flex_block"])
def test_variant_matches_the_float64_reference(inputs, variant):
    res = run_variant(torch, variant, 3, 48, inputs, reps=1)
    assert res["max_abs_err"] < 2e-2, res


def test_the_reference_tells_an_unmasked_kernel_apart(inputs):
    # flash_unmasked lets rows see past their length: the check above would catch a variant that does
    res = run_variant(torch, "flash_unmasked", 3, 48, inputs, reps=1)
    assert res["max_abs_err"] > 0.1, res
