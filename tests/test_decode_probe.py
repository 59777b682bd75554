"""gpu_decode_probe.py reads a decode step's output as the engine's step returns it (CPU, tiny model).

The probe runs only on the GPU, where a wrong read costs a device call: run 51's first probe timed both of
its variants and then lost them to a read of the logits written for an older step.
"""

import pytest

torch = pytest.importorskip("torch")

from benchmarks.gpu_decode_probe import step_logits  # noqa: E402
from serve_app.engines.slot_kv import ATTENTION_NAME, SlotDecoder, register_attention  # noqa: E402


def test_step_logits_reads_the_logits_of_a_real_decode_step():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=500,
                                         max_position_embeddings=256)).eval()
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    dec = SlotDecoder(model, num_slots=2, max_len=64, dtype=torch.float32, device=torch.device("cpu"),
                      use_graphs=False, batch_sizes=[1, 2], span_step=32)
    with torch.inference_mode():
        dec.positions.fill_(7)
        dec.tokens.fill_(123)
        out = dec._step(2, 32)
    logits = step_logits(out)
    assert logits.shape == (2, 500)
    # the probe's argmax is the step's own greedy pick
    assert logits.argmax(-1).tolist() == out[1][:2].reshape(-1).tolist()
