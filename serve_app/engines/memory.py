"""Whether the KV cache fits, checked before it is allocated.

Why: a KV cache that does not fit fails late and badly. On a GPU it is a CUDA
out-of-memory error deep in the start or, for a cache that grows with the
batch, under load, taking every running request with it. On the CPU the
allocation succeeds lazily and the kernel kills the process once the pages
are touched. vLLM refuses such a configuration at start and names the sizes;
so does this, and it says what would fit.

The budget is vLLM's ``gpu_memory_utilization``, per engine as vLLM counts it:
this engine's weights (already loaded and quantized) and its KV cache may take
that fraction of the GPU's memory, so two replicas sharing a GPU at 0.45 each
both start; and the cache never gets more than the GPU has free, whoever holds
the rest. What the fraction leaves is for activations, CUDA graphs and the
compiler's workspace; unlike vLLM this does not profile a forward pass to
measure them. On the CPU the budget is the host memory the kernel reports
available (``MemAvailable``) at the moment of the check.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.errors import KVCacheTooLargeError

GB = 1e9


@dataclass(frozen=True)
class KVLayout:
    """What one cached token takes: keys and values of every layer, on one rank."""

    num_layers: int
    kv_heads: int
    head_dim: int
    element_bytes: int

    @classmethod
    def of(cls, config, element_bytes: int, tensor_parallel_size: int = 1) -> "KVLayout":
        """The layout of a transformers config; a rank of ``tensor_parallel_size`` holds its share of the
        KV heads (at least one: a rank never holds part of a head)."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, -(-kv_heads // tensor_parallel_size), head_dim, element_bytes)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.element_bytes


@dataclass(frozen=True)
class Budget:
    """Bytes the KV cache may take, and where that figure comes from (for the error message)."""

    bytes: int
    source: str
    knob: str = ""  # the setting that would raise it, if any


def check_static(layout: KVLayout, num_slots: int, tokens_per_slot: int, budget: Budget,
                 spare_tokens: int = 0) -> int:
    """Bytes of a cache of ``num_slots`` x ``tokens_per_slot`` tokens (``spare_tokens`` of each slot being
    the engine's own, never a sequence's); raises KVCacheTooLargeError, naming the max_model_len and the
    max_num_seqs that would fit, if it exceeds the budget."""
    need = layout.bytes_per_token * num_slots * tokens_per_slot
    if need <= budget.bytes:
        return need
    room = max(budget.bytes, 0) // layout.bytes_per_token  # tokens that fit
    max_len = room // num_slots - spare_tokens
    max_slots = room // tokens_per_slot
    fixes = []
    if max_len >= 1:
        fixes.append(f"max_model_len <= {max_len}")
    if max_slots >= 1:
        fixes.append(f"max_num_seqs <= {max_slots}")
    raise KVCacheTooLargeError(_message(
        f"the static KV cache ({num_slots} sequences x {tokens_per_slot} tokens x "
        f"{layout.bytes_per_token / 1024:.1f} KiB = {need / GB:.2f} GB)", budget, fixes))


def check_tokens(layout: KVLayout, tokens: int, budget: Budget) -> int:
    """Bytes of ``tokens`` cached tokens (the dynamic cache's admission bound, max_kv_tokens); raises
    KVCacheTooLargeError, naming the max_kv_tokens that would fit, if they exceed the budget."""
    need = layout.bytes_per_token * tokens
    if need <= budget.bytes:
        return need
    room = max(budget.bytes, 0) // layout.bytes_per_token
    fixes = [f"max_kv_tokens <= {room}"] if room >= 1 else []
    raise KVCacheTooLargeError(_message(
        f"max_kv_tokens' KV cache ({tokens} tokens x {layout.bytes_per_token / 1024:.1f} KiB = "
        f"{need / GB:.2f} GB)", budget, fixes))


def _message(what: str, budget: Budget, fixes: list[str]) -> str:
    if budget.bytes <= 0:
        where = f"nothing is left for it: {budget.source}"
    else:
        where = f"it does not fit the {budget.bytes / GB:.2f} GB {budget.source}"
    if budget.knob:
        fixes.append(f"a higher {budget.knob}")
    todo = f"; set {' or '.join(fixes)}" if fixes else ""
    return f"{what}: {where}{todo}"


def gpu_budget(free_bytes: int, total_bytes: int, own_bytes: int, gpu_memory_utilization: float,
               gpu: str = "the GPU") -> Budget:
    """The KV cache's budget on a GPU of ``total_bytes`` with ``free_bytes`` free, where this engine already
    holds ``own_bytes`` (its weights): its share under gpu_memory_utilization, and no more than is free."""
    share = int(gpu_memory_utilization * total_bytes) - own_bytes
    if free_bytes < share:
        others = total_bytes - free_bytes - own_bytes
        return Budget(free_bytes, f"free on {gpu} ({total_bytes / GB:.1f} GB; {own_bytes / GB:.2f} GB held by this "
                                  f"engine's weights, {others / GB:.2f} GB by the rest: other processes or "
                                  f"engines, the CUDA context)")
    return Budget(share, f"left of gpu_memory_utilization {gpu_memory_utilization:g} x {total_bytes / GB:.1f} GB "
                         f"on {gpu} after this engine's {own_bytes / GB:.2f} GB of weights",
                  knob="gpu_memory_utilization" if gpu_memory_utilization < 1 else "")


def device_budget(device, gpu_memory_utilization: float, own_bytes: int | None = None) -> Budget:
    """The KV cache's budget on ``device`` now (a torch.device), after the weights are in place.
    ``own_bytes``: this engine's weights on it; by default all torch holds there (right for a process that
    holds one engine: a tensor-parallel rank, whose DTensor shards are awkward to count)."""
    if device.type == "cuda":
        import torch

        # blocks torch's allocator keeps from the load (fusing frees the unfused weights, quantizing the bf16
        # ones: 8.5 GB for the 7B) count as used in mem_get_info until they go back to the driver
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        # counted as the engine's own weights, not torch's whole allocation: another engine in the same process
        # (an inline one, a test's) is then what it is, memory taken, not this engine's weights (seen on an H100:
        # 9.21 GB "of weights" for a 4.04-GB model while the last engine was still held)
        own = torch.cuda.memory_allocated(device) if own_bytes is None else own_bytes
        return gpu_budget(free, total, own, gpu_memory_utilization, torch.cuda.get_device_name(device))
    return Budget(host_available_bytes(), "of host memory available")


def host_available_bytes() -> int:
    """MemAvailable (Linux: free memory plus what the page cache would give back), else free pages."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---- planning a config offline (seekserve config memory) ------------------------------------------------------
@dataclass(frozen=True)
class WeightCount:
    """A checkpoint's parameters, and which of them quantization 'fp8' makes e4m3 (as quantize_linears picks
    them: the decoder's 2-D weights with both dimensions multiples of 16; embeddings and the LM head stay)."""

    params: int
    fp8_params: int
    fp8_channels: int  # their output channels: one float32 scale each

    def bytes(self, element_bytes: int, quantization: str = "none") -> int:
        if quantization == "fp8":
            return self.fp8_params + 4 * self.fp8_channels + (self.params - self.fp8_params) * element_bytes
        return self.params * element_bytes


def count_weights(model_dir) -> WeightCount:
    """Counted from the safetensors files' headers (shapes only: nothing is read or loaded)."""
    from pathlib import Path

    from safetensors import safe_open

    from .fp8 import quantizable

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = fp8 = channels = 0
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                params += n
                module = name.rsplit(".", 1)[0]
                # a 2-D weight that is not an embedding's is a linear layer's
                if (len(shape) == 2 and name.endswith(".weight") and "embed" not in module
                        and quantizable(module.rsplit(".", 1)[-1], shape[0], shape[1])):
                    fp8 += n
                    channels += shape[0]
    return WeightCount(params, fp8, channels)


@dataclass(frozen=True)
class MemoryPlan:
    """One hf variant's GPU memory per rank, as its engine would size it (no GPU needed)."""

    weights_bytes: int
    kv_bytes: int
    kv_what: str
    budget_bytes: int  # gpu_memory_utilization x the GPU, for weights and KV cache together
    error: str | None  # the engine's own KVCacheTooLargeError message, if it would refuse to start


def long_context_error(max_model_len: int | None, model_len: int, model: str) -> str | None:
    """Why an engine refuses a max_model_len past the model's max_position_embeddings, or None if it does not
    (the engine's start and `config memory` both ask here)."""
    if not max_model_len or max_model_len <= model_len:
        return None
    return (f"max_model_len {max_model_len} is longer than {model}'s max_position_embeddings ({model_len}): "
            f"positions past it were never trained; set max_model_len <= {model_len}")


def plan_hf(options, config, weights: WeightCount, gpu_bytes: int, tensor_parallel_size: int = 1) -> MemoryPlan:
    """What an hf engine with ``options`` (HFEngineOptions) would hold on each of ``tensor_parallel_size`` GPUs
    of ``gpu_bytes``, and whether its start-up check would pass. The CUDA context (~0.5 GB) and any other
    process on the GPU are not counted; the check at start counts them. Under tensor parallelism the weights
    are taken as split evenly over the ranks (a rank that keeps a whole embedding holds more)."""
    dtype = options.dtype if options.dtype != "auto" else "bfloat16"
    element_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    tp = tensor_parallel_size
    weights_bytes = weights.bytes(element_bytes, options.quantization) // tp
    layout = KVLayout.of(cfg, element_bytes, tp)
    allowed = int(options.gpu_memory_utilization * gpu_bytes)
    budget = gpu_budget(gpu_bytes - weights_bytes, gpu_bytes, weights_bytes, options.gpu_memory_utilization)
    model_len = int(getattr(cfg, "max_position_embeddings", 2048))
    max_len = min(options.max_model_len or model_len, model_len, options.max_kv_tokens)
    error = long_context_error(options.max_model_len, model_len, options.model)
    if error is not None:
        what, kv_bytes = "none: the engine would not start", 0
    elif options.resolved_kv_cache("cuda") == "static":
        spare = 1 if options.cuda_graphs and options.compile_decode else 0
        what = f"static {options.max_num_seqs} x {max_len + spare}"
        kv_bytes = layout.bytes_per_token * options.max_num_seqs * (max_len + spare)
        try:
            check_static(layout, options.max_num_seqs, max_len + spare, budget, spare)
        except KVCacheTooLargeError as e:
            error = str(e)
    else:
        what = f"dynamic <= {options.max_kv_tokens}"
        kv_bytes = layout.bytes_per_token * options.max_kv_tokens
        try:
            check_tokens(layout, options.max_kv_tokens, budget)
        except KVCacheTooLargeError as e:
            error = str(e)
    return MemoryPlan(weights_bytes, kv_bytes, what, allowed, error)


def padded_peak_tokens(rows: list[tuple[int, int]]) -> int:
    """The most tokens a left-padded cache (rows x the longest row, as the dynamic cache holds them) will hold
    from now on, for rows given as (tokens cached now, tokens still to come at most), if each runs to its end.

    Why not rows x the longest reservation: a short answer beside a long one leaves long before the long one
    is long, so that bound keeps short requests waiting for memory they would never take (in
    benchmarks/kv_admission.py, 5x the TTFT of the rows' sum for the same peak). All rows grow one token a
    step, so after s steps the rows still there are those with at least s to come and the cache is as wide
    as the longest of them; the peak is at one of the steps where a row has just its last token left."""
    order = sorted(rows, key=lambda row: -row[1])
    peak = longest = 0
    for k, (cached, to_come) in enumerate(order):
        longest = max(longest, cached)
        # rows 0..k all still run after ``to_come`` steps; a tie is counted once, with the whole group
        if k + 1 == len(order) or order[k + 1][1] < to_come:
            peak = max(peak, (k + 1) * (longest + to_come))
    return peak
