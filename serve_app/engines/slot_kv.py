"""Static-slot KV cache and CUDA-graph decode for the hf engine.

Why: on a GPU the dynamic path (a DynamicCache that is padded, concatenated
and re-sliced every step, plus ~1,000 kernel launches from Python per step)
spends far more time in Python and allocation than in reading weights.
Measured on one H200 with a 7B model: transformers' own continuous batching
reached 411 tok/s (596 with its CUDA graphs) at 64 requests, where the HBM
floor allows ~15k (benchmarks/gpu_options.py, docs/benchmarks.md).

Layout: every running sequence owns one *slot* (a row) of a preallocated
``[slots, kv_heads, max_len, head_dim]`` tensor per layer, for its whole life.
Decode feeds rows ``0..B-1`` at once (B = a captured batch size covering the
highest busy slot); each row writes its new key/value at its own position and
attends over the first ``S`` positions (S = a captured span covering the
longest row), masked per row. Shapes and addresses never change, so one CUDA
graph per (B, S) replays a whole decode step with a single launch.

The model code stays transformers': this module plugs in as the model's
``past_key_values`` (anything with ``update``) and as a registered attention
function, and receives its per-row mask through the 4D-mask pass-through of
``create_causal_mask``.
"""

from __future__ import annotations

import contextlib
import logging
import time

log = logging.getLogger(__name__)

ATTENTION_NAME = "seekserve_slots"


def _grouped_decode_attention(query, key, value, attention_mask, scaling):
    """query [B, H, d] (one token per row); key/value [B, KVH, S, d]; mask [B, 1, 1, S] -> [B, H, d].
    The query heads of each KV head are grouped so K and V are read once (no repeat_kv copy)."""
    import torch

    b, h, d = query.shape
    kvh = key.shape[1]
    qg = query.reshape(b, kvh, h // kvh, d)
    scores = torch.matmul(qg, key.transpose(-1, -2)).float() * scaling
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, h, d)  # [B, KVH, g, d] -> [B, H, d]


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, slot_cache=None,
                   **kwargs):
    """query [B, H, q, d]; key/value [B, KVH, S, d] as returned by SlotKVCache.update. With ``slot_cache``
    (a mixed pass): one batch of a prompt's tokens (the whole prompt, or one chunk of it) followed by one
    decode token per row."""
    import torch
    import torch.nn.functional as F

    b, h, q, d = query.shape
    kvh = key.shape[1]
    if slot_cache is not None:
        n, rows, span = slot_cache.mixed_shape
        layer = module.layer_idx
        if slot_cache.prompt_mask is None:
            # a prompt from its first position: it attends to itself only (causal; its right padding never
            # reaches a real token), a flash kernel over its own fresh keys
            prompt = F.scaled_dot_product_attention(query[:, :, :n], key[:, :, :n], value[:, :, :n], is_causal=True,
                                                    scale=scaling, enable_gqa=h != kvh)
        else:
            # a later chunk: its tokens attend over the slot, which update() has just written them into, so
            # they also see the chunks before it; each sees the positions up to its own (the mask). The
            # query heads of a KV head are stacked so the kernel needs no GQA support and reads K and V once.
            # ~3x the first form's cost at span 768 (H200, docs/gpu_notes.md run 69), so only where needed
            g = h // kvh
            slot_keys = slot_cache.keys[layer].index_select(0, slot_cache.prompt_slot)[:, :, :span]
            slot_values = slot_cache.values[layer].index_select(0, slot_cache.prompt_slot)[:, :, :span]
            stacked = query[:, :, :n].reshape(1, kvh, g * n, d)
            prompt = F.scaled_dot_product_attention(stacked, slot_keys, slot_values,
                                                    attn_mask=slot_cache.prompt_mask, scale=scaling).reshape(1, h, n, d)
        # each decode row attends over its own slot, which update() has just written its new token into
        keys = slot_cache.keys[layer][:rows, :, :span]
        values = slot_cache.values[layer][:rows, :, :span]
        decode = _grouped_decode_attention(query[0, :, n:].transpose(0, 1), keys, values, attention_mask, scaling)
        return torch.cat([prompt.transpose(1, 2), decode.unsqueeze(0)], dim=1), None
    if q > 1:
        # prefill: each prompt attends to itself only (right padding never reaches a real token)
        with prompt_kernels(b):
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                 enable_gqa=h != kvh)
        return out.transpose(1, 2).contiguous(), None
    return _grouped_decode_attention(query.reshape(b, h, d), key, value, attention_mask, scaling).unsqueeze(1), None


PROMPT_ATTENTION_TAG = "seekserve-sdpa-flash"
# prompt_attention 'flash_multi_prompt': the SDPA backends a pass of several prompts may run (all but cuDNN);
# None leaves torch's pick. Set once per process, before anything compiles: compiled code guards on it
_MULTI_PROMPT_BACKENDS: list | None = None


def prompt_kernels(prompts: int):
    """The context a prefill pass of ``prompts`` prompts calls SDPA in (slot_attention): with
    prompt_attention 'flash_multi_prompt', cuDNN left out of the backends for a pass of several prompts
    (torch.nn.attention.sdpa_kernel, which torch.compile traces into the graph, so a compiled pass keeps it;
    Inductor's cache keys on the kernel it lowered to, and AOTAutograd's, which would not, is bypassed for
    that graph, pytorch#194007); otherwise nothing."""
    if prompts > 1 and _MULTI_PROMPT_BACKENDS is not None:
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(_MULTI_PROMPT_BACKENDS)
    return contextlib.nullcontext()


def use_prompt_attention(choice: str, device) -> None:
    """HFEngineOptions.prompt_attention, for this process (on CUDA; the engine is the only SDPA caller in it),
    before anything is compiled. 'flash' turns cuDNN's SDPA off, so every compiled and captured pass lowers
    to flash. Why: cuDNN, torch 2.11's pick on Hopper, builds a plan per new shape (37 ms each on an H100,
    docs/gpu_notes.md run 142), and the compiled pass of several prompts meets new shapes while serving.
    The compile caches do not key on the SDPA backend (pytorch#185449): a graph compiled with cuDNN's
    attention in it would come back from a warm on-disk cache with cuDNN still in, so the choice goes into
    their key through torch.compiler.config.cache_key_tag.

    'flash_multi_prompt' keeps cuDNN for the passes of one prompt and leaves it out of the passes of several
    (prompt_kernels). Why: the one-prompt passes (the captured prefill graphs, and the mixed passes' prompt)
    are all captured before ready, so cuDNN's plans are built then, and on them cuDNN ran faster than flash
    (an H100's mixed pass of 64 rows 17.66 against 17.88 ms, runs 142 and 146); the compiled pass of several
    prompts meets new shapes while serving. A one-prompt pass past the captured lengths (prefill_graph_tokens)
    still pays cuDNN's plan once per new length."""
    import torch

    global _MULTI_PROMPT_BACKENDS
    if choice == "auto" or getattr(device, "type", device) != "cuda":
        return
    if choice == "flash_multi_prompt":
        from torch.nn.attention import SDPBackend

        _MULTI_PROMPT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    tag = torch.compiler.config.cache_key_tag
    if PROMPT_ATTENTION_TAG not in tag:
        torch.compiler.config.cache_key_tag = f"{tag},{PROMPT_ATTENTION_TAG}" if tag else PROMPT_ATTENTION_TAG


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, slot_attention)


class SlotKVCache:
    """Per-layer ``[slots, kv_heads, max_len, head_dim]`` keys and values."""

    def __init__(self, layout, num_slots: int, max_len: int, dtype, device):
        """``layout``: memory.KVLayout, the same one the engine checked against its budget before this
        allocates it, so what is checked is what is allocated."""
        import torch

        shape = (num_slots, layout.kv_heads, max_len, layout.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        self.num_slots, self.max_len = num_slots, max_len
        self.row_ids = torch.arange(num_slots, device=device)
        self._mode = "decode"
        self._slot_ids = None
        self._rows = 0
        self._span = 0
        self._write_pos = None
        self._start = None
        self.prompt_slot = None
        self.prompt_mask = None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def for_prefill(self, slot_ids) -> "SlotKVCache":
        self._mode, self._slot_ids, self._start = "prefill", slot_ids, None
        return self

    def for_decode(self, rows: int, span: int, write_pos) -> "SlotKVCache":
        self._mode, self._rows, self._span, self._write_pos = "decode", rows, span, write_pos
        return self

    def for_mixed(self, slot_ids, prompt_len: int, rows: int, span: int, write_pos, start,
                  prompt_mask) -> "SlotKVCache":
        """``prompt_len`` tokens of one prompt into ``slot_ids`` from position ``start`` on (a device tensor
        [1]), and one decode token for each of rows ``0..rows-1``, in one pass (SlotDecoder.mixed). With
        ``prompt_mask`` [g * prompt_len, span] (a chunk after the first) the tokens attend over the slot where
        it lets them; without (``start`` is 0), over themselves."""
        self._mode, self._slot_ids, self._prompt_len, self._start = "mixed", slot_ids, prompt_len, start
        self._rows, self._span, self._write_pos = rows, span, write_pos
        self.prompt_slot, self.prompt_mask = slot_ids, prompt_mask
        return self

    @property
    def mixed_shape(self) -> tuple[int, int, int]:
        """(prompt tokens, decode rows, span) of the mixed pass being run."""
        return self._prompt_len, self._rows, self._span

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "mixed":
            # the decode rows first: the prompt's own slot may be one of them (free: it writes its position 0
            # harmlessly), and the prompt's write after it must win
            n = self._prompt_len
            self._write_rows(k, v, key_states[0, :, n:].transpose(0, 1), value_states[0, :, n:].transpose(0, 1))
            self._write_prompts(k, v, key_states[:, :, :n], value_states[:, :, :n])
            return key_states, value_states
        if self._mode == "prefill":
            self._write_prompts(k, v, key_states, value_states)
            return key_states, value_states
        self._write_rows(k, v, key_states[:, :, 0], value_states[:, :, 0])
        return k[: self._rows, :, : self._span], v[: self._rows, :, : self._span]

    def _write_prompts(self, k, v, key_states, value_states) -> None:
        """Prompts' keys and values [n, KVH, length, d] into their slots' first positions."""
        import torch

        # one index_put_ on the whole buffer, not index_copy_ on the view k[:, :, :n]: compiled, a write
        # into a view is functionalized into a copy of the view for every slot, the write, and a copy
        # back (~134 MB per layer for K and for V at 64 slots x 512 tokens on the 7B)
        pos = torch.arange(key_states.shape[2], device=k.device)
        if self._start is not None:  # a chunk of a prompt, after the chunks before it
            pos = pos + self._start
        k[self._slot_ids[:, None], :, pos[None, :]] = key_states.transpose(1, 2)
        v[self._slot_ids[:, None], :, pos[None, :]] = value_states.transpose(1, 2)

    def _write_rows(self, k, v, key_rows, value_rows) -> None:
        """One token's keys and values [rows, KVH, d] per row, each at its row's write position."""
        rows = self.row_ids[: self._rows]
        k[rows, :, self._write_pos] = key_rows
        v[rows, :, self._write_pos] = value_rows

    # transformers asks a cache these; the slot cache never drives positions itself
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


# one-prompt prefill graphs are captured every this many tokens: a prompt pads to the next multiple, so
# at most 63 tokens of wasted compute (~1 ms on the 7B) against the ~4 ms of host launches a replay saves
PREFILL_GRAPH_STEP = 64


def prefill_graph_padding(n: int) -> int:
    """The length a one-prompt pass of ``n`` tokens pads to for its graph (at least 2 positions, as the
    compiled pass takes)."""
    return -(-max(n, 2) // PREFILL_GRAPH_STEP) * PREFILL_GRAPH_STEP


def capture_graph(run, pool, stream):
    """Runs ``run`` twice on ``stream`` (lazy inits and cuBLAS workspaces happen outside the capture), then
    captures it into a CUDA graph in ``pool``; returns (graph, run's output). ``stream`` first waits for
    the current stream, so inputs written there before the call are in place. (A first replay costs what
    later ones do: measured on an H200, benchmarks/graph_first_replay.py, so nothing is replayed here.)"""
    import torch

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = run()
    return graph, out


def compile_cache_counts() -> dict[str, int]:
    """This process's hits and misses of torch.compile's on-disk caches so far (Inductor's FX graph cache, AOT
    autograd's): whether a start's minutes of compiling found the cache warm. Why: on an H200 the engine in a Ray
    replica's own process compiled for 407 s on a cache with which a child process's engine had just been ready
    in 127 s, compiles included (docs/gpu_notes.md run 88); the counts say which compiles missed."""
    import sys

    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None:  # nothing compiled in this process, and importing Dynamo takes seconds: no counts
        return {}
    return {k: v for group in ("inductor", "aot_autograd") for k, v in dynamo.counters[group].items()
            if "cache_hit" in k or "cache_miss" in k or "cache_bypass" in k}


def bucket(n: int, sizes: list[int]) -> int:
    for s in sizes:
        if s >= n:
            return s
    return sizes[-1]


class SlotDecoder:
    """Runs prefill and decode steps over a SlotKVCache, with CUDA graphs for decode.

    The decode inputs live in static buffers: ``tokens[row]`` (the token to feed),
    ``positions[row]`` (where it goes = tokens already cached) and ``active[row]``
    (1 while a sequence owns the row). A step reads them, returns logits for rows
    ``0..B-1`` with each row's greedy token and its logprob, and itself writes
    those tokens into ``tokens`` and moves every active row one position on. So a
    greedy step needs nothing from the host, and greedy sampling runs inside the
    compiled graph instead of as ~8 small kernels after it; a caller that samples
    otherwise overwrites ``tokens`` for its rows.
    """

    def __init__(self, model, num_slots: int, max_len: int, dtype, device, use_graphs: bool,
                 batch_sizes: list[int], span_step: int, compile_step: bool = False,
                 compile_prefill: bool = False, prefill_graph_tokens: int = 0, mixed_graph_tokens: int = 0,
                 mixed_chunk_tokens: int = 0):
        import torch

        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        from .memory import KVLayout

        cfg = model.config.get_text_config()
        layout = KVLayout.of(cfg, dtype.itemsize)
        self._heads_per_kv = cfg.num_attention_heads // layout.kv_heads
        # compiled: one spare position, so no span is the buffers' full length, and batches of 2 rows at
        # least, so no batch is 1: Inductor would compile each of those cases apart (measured on the 7B:
        # 4 compiles of ~90 s instead of 1). The spare position is never attended to.
        buffer_len = max_len + 1 if compile_step else max_len
        self.cache = SlotKVCache(layout, num_slots, buffer_len, dtype, device)
        self.device = device
        self.num_slots, self.max_len = num_slots, max_len
        self.tokens = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.active = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.span_ids = torch.arange(buffer_len, device=device)
        self.use_graphs = use_graphs
        self.compile_step = compile_step
        low = 2 if compile_step else 1
        self.batch_sizes = sorted({min(max(b, low), num_slots) for b in batch_sizes} | {num_slots})
        self.graphs: dict[tuple[int, int], tuple[object, object]] = {}
        self._pool = None  # the graphs' shared memory pool, from the first capture on
        self.span_step = span_step
        self.capture_s = 0.0
        self.compile_s = 0.0
        self.compile_error: str | None = None
        self.compile_prefill = compile_prefill
        self.prefill_compile_s = 0.0
        self.prefill_compile_error: str | None = None
        self._prefill_compiled = None
        self.prefill_eager_passes = 0  # passes of a shape the compiled prefill does not cover
        # the compiled prefill is used while this is on (a benchmark turns it off on a live engine to compare)
        self.prefill_compiled = False
        # one-prompt passes up to this many tokens replay a captured graph (capture_prefill_graphs)
        self.prefill_graph_tokens = prefill_graph_tokens
        self._prefill_runs: dict[int, tuple[object, object]] = {}  # padded length -> (graph or None, logits)
        # (ids, slot, last position, start position) on the device, their pinned host staging, and an event
        self._prefill_in: tuple | None = None
        self.prefill_graph_capture_s = 0.0
        self.prefill_graph_reserved_bytes = 0  # what the graphs' memory pool took from the GPU
        self.prefill_graph_error: str | None = None
        self.prefill_graph_passes = 0
        # the captured passes are used while this is on (as prefill_compiled, for a live compare)
        self.prefill_graphs = False
        self._graph_pool = None  # the prefill and mixed graphs' shared memory pool
        # mixed passes (one prompt of up to this many tokens and a decode step of the running rows, in one
        # captured pass): rows pad to these counts
        self.mixed_graph_tokens = mixed_graph_tokens
        self.mixed_rows = sorted({min(max(r, 2), num_slots) for r in (16, 32, 64)} | {num_slots})
        self._mixed_compiled = None
        self.mixed_compile_s = 0.0
        self.mixed_compile_error: str | None = None
        # chunked prefill: the chunks after a prompt's first, up to this many tokens, get mixed passes of their own
        self.mixed_chunk_tokens = mixed_chunk_tokens
        # (prompt, rows, span, resumes: a chunk after the first) -> graph or None
        self._mixed_runs: dict[tuple[int, int, int, bool], object] = {}
        self._mixed_out: tuple | None = None  # static outputs: logits [1 + rows, V], decode tokens and logprobs
        self.mixed_graph_capture_s = 0.0
        self.mixed_graph_reserved_bytes = 0
        self.mixed_graph_error: str | None = None
        self.mixed_graph_passes = 0
        self.mixed_graphs = False  # used while on (a live compare turns it off)

    @property
    def span_step(self) -> int:
        return self._span_step

    @span_step.setter
    def span_step(self, step: int) -> None:
        """Re-buckets the attention spans; once graphs are captured, also captures the (batch, span)
        graphs the new buckets lack (the compiled step serves any span, so no compile). A benchmark
        switches it on a live, idle engine to compare span steps without a second warm-up."""
        import torch

        self._span_step = step
        self.spans = sorted({min(self.max_len, s) for s in range(step, self.max_len + step, step)})
        if self.graphs:
            # the mode the first capture ran in (HFEngine's start): grad mode is one of the compiled step's
            # guards, and a step traced with grad on recompiles for autograd and fails on its in-place writes
            with torch.inference_mode():
                self._capture_missing()

    @property
    def has_compiled_prefill(self) -> bool:
        """The warm-up compiled the prefill pass (whether or not ``prefill_compiled`` uses it now)."""
        return self._prefill_compiled is not None

    # ---- steps -------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], slots: list[int], pad_id: int):
        """Writes the prompts' KV into their slots; returns last-position logits [n, V]. A captured
        pass's logits are the graph's own output: read them before the next prefill."""
        import torch

        if len(prompts) == 1 and self.prefill_graphs:
            padded = self.prefill_graph_length(len(prompts[0]))
            if padded is not None:
                return self._replay_prefill(prompts[0], slots[0], pad_id, padded)
        # compiled: at least 2 positions, as Inductor would compile a prompt of 1 token apart (right
        # padding is never attended to by the real tokens and is overwritten by the first decode writes)
        n, longest = len(prompts), max(len(p) for p in prompts)
        if self.has_compiled_prefill:
            longest = max(longest, 2)
        ids = torch.full((n, longest), pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device, non_blocking=True)
        slot_ids = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        last = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long).to(self.device, non_blocking=True)
        if self.has_compiled_prefill and self.prefill_compiled:
            try:
                # a shape the warm-up did not compile runs eagerly rather than stalling the engine (and every
                # stream on it) for a minute-long compile; dynamo raises before the pass runs
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._prefill_compiled(ids, slot_ids, last)
            except RuntimeError as e:
                if "fail_on_recompile" not in str(e):
                    raise
                self.prefill_eager_passes += 1
                if self.prefill_eager_passes == 1:
                    log.warning("a prefill of shape %s is not covered by the compiled pass; running it (and any "
                                "such) eagerly: %s", tuple(ids.shape), str(e)[:300])
        return self._prefill_pass(ids, slot_ids, last)

    @property
    def prefill_graph_lengths(self) -> list[int]:
        """The one-prompt lengths captured (capture_prefill_graphs), shortest first."""
        return sorted(self._prefill_runs)

    def prefill_graph_length(self, n: int) -> int | None:
        """The captured length a one-prompt pass of ``n`` tokens pads to; None past the longest."""
        padded = prefill_graph_padding(n)
        return padded if padded in self._prefill_runs else None

    def _replay_prefill(self, prompt: list[int], slot: int, pad_id: int, padded: int):
        import torch

        self._stage_prompt(prompt, slot, pad_id, padded)
        ids, slot_ids, last, _ = self._prefill_in[:4]
        graph, out = self._prefill_runs[padded]
        self.prefill_graph_passes += 1
        if graph is None:  # no CUDA (tests): the same pass on the same padded buffers, run directly
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._prefill_graph_fn()(ids[:padded].view(1, padded), slot_ids, last)
        graph.replay()
        return out

    def _alloc_prompt_staging(self) -> None:
        """The captured passes' prompt inputs (ids, slot, last position, and for mixed passes the position the
        ids start at) on the device, and their pinned host staging: allocated once, for the longest prompt a
        buffer holds, as every graph reads these addresses."""
        import torch

        if self._prefill_in is not None:
            return
        top, cuda = self.cache.max_len, self.device.type == "cuda"
        dev = dict(dtype=torch.long, device=self.device)
        host = dict(dtype=torch.long, pin_memory=cuda)
        self._prefill_in = (torch.zeros(top, **dev), torch.zeros(1, **dev), torch.zeros(1, **dev),
                            torch.zeros(1, **dev),
                            torch.zeros(top, **host), torch.zeros(1, **host), torch.zeros(1, **host),
                            torch.zeros(1, **host), torch.cuda.Event() if cuda else None)

    def _stage_prompt(self, prompt: list[int], slot: int, pad_id: int, padded: int, start: int = 0) -> None:
        import torch

        ids, slot_ids, last, first, host_ids, host_slot, host_last, host_first, copied = self._prefill_in
        if copied is not None:
            copied.synchronize()  # the staging buffers are pinned: the last pass's copies must have left them
        n = len(prompt)
        host_ids[:n] = torch.tensor(prompt, dtype=torch.long)
        host_ids[n:padded] = pad_id
        host_slot[0], host_last[0], host_first[0] = slot, n - 1, start
        # from pinned memory and non-blocking: a pageable copy would wait for the decode step in flight
        ids[:padded].copy_(host_ids[:padded], non_blocking=True)
        slot_ids.copy_(host_slot, non_blocking=True)
        last.copy_(host_last, non_blocking=True)
        first.copy_(host_first, non_blocking=True)
        if copied is not None:
            copied.record()

    def _prefill_graph_fn(self):
        return self._prefill_compiled if self.has_compiled_prefill else self._prefill_pass

    def capture_prefill_graphs(self) -> None:
        """Captures the one-prompt prefill pass (compiled if it was) at every multiple of
        PREFILL_GRAPH_STEP up to ``prefill_graph_tokens``, padded on the right as multi-prompt passes are.

        Why: launched from Python, a one-prompt pass of the compiled 7B is host-bound: 486 kernels took
        14.65 ms to launch where the GPU was busy for 10.50 (H200, 512 tokens; from two prompts on the
        GPU is the bound). Without the hold (max_prefill_wait_steps 0) many passes carry one prompt.
        Without CUDA the buckets run the pass directly on the same padded buffers, so CPU tests check
        the padding. A failed capture leaves the uncaptured pass, which is correct.
        """
        import torch

        # shorter than the buffers: a pass of their full length is a shape of its own to Inductor
        top = min(self.prefill_graph_tokens, self.cache.max_len - 1)
        lengths = list(range(PREFILL_GRAPH_STEP, top + 1, PREFILL_GRAPH_STEP))
        if not lengths:
            return
        t0 = time.monotonic()
        cuda = self.device.type == "cuda"
        self._alloc_prompt_staging()
        ids, slot_ids, last, _ = self._prefill_in[:4]
        fn = self._prefill_graph_fn()
        runs: dict[int, tuple[object, object]] = {}
        try:
            if not cuda:
                runs = {length: (None, None) for length in lengths}
            else:
                reserved = torch.cuda.memory_reserved(self.device)
                pool, stream = self._shared_pool(), torch.cuda.Stream()
                # longest first, so the shorter graphs reuse the pool's blocks; the warm-up passes write
                # slot 0's first positions, which no sequence owns yet
                for length in reversed(lengths):
                    args = (ids[:length].view(1, length), slot_ids, last)
                    last.fill_(length - 1)
                    with torch.compiler.set_stance("fail_on_recompile"):
                        runs[length] = capture_graph(lambda a=args: fn(*a), pool, stream)
                torch.cuda.synchronize()
                self.prefill_graph_reserved_bytes = torch.cuda.memory_reserved(self.device) - reserved
        except Exception as e:  # noqa: BLE001 - a failed capture leaves the uncaptured pass, which is correct
            self.prefill_graph_error = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("capturing the one-prompt prefill pass failed, prefilling uncaptured (set "
                        "prefill_graph_tokens: 0 to skip the attempt): %s", self.prefill_graph_error)
            runs = {}
        self._prefill_runs, self.prefill_graphs = runs, bool(runs)
        self.prefill_graph_capture_s = time.monotonic() - t0
        log.info("captured %d one-prompt prefill graphs (up to %d tokens) in %.1fs, %.2f GB", len(runs), top,
                 self.prefill_graph_capture_s, self.prefill_graph_reserved_bytes / 1e9)

    def _shared_pool(self):
        import torch

        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    # ---- mixed passes --------------------------------------------------------
    @property
    def mixed_graph_keys(self) -> list[tuple[int, int, int, bool]]:
        """The (prompt length, rows, span, resumes) mixed passes captured (capture_mixed_graphs)."""
        return sorted(self._mixed_runs)

    def mixed_key(self, prompt_len: int, busy_rows: int, longest: int,
                  resumes: bool = False) -> tuple[int, int, int, bool] | None:
        """The captured mixed pass that covers ``prompt_len`` tokens of one prompt (from its first position,
        or with ``resumes`` a chunk after the first) with a decode step of rows 0..busy_rows-1 whose longest
        sequence (after the step) is ``longest``; None if none does."""
        if not self.mixed_graphs or busy_rows > self.mixed_rows[-1]:
            return None
        key = (prefill_graph_padding(prompt_len), bucket(busy_rows, self.mixed_rows), bucket(longest, self.spans),
               resumes)
        return key if key in self._mixed_runs else None

    def chunks_fit(self, prompt_len: int) -> bool:
        """A prompt of ``prompt_len`` tokens can go into its slot in chunks that are multiples of
        PREFILL_GRAPH_STEP: its last chunk, padded, ends within the buffers."""
        return prefill_graph_padding(prompt_len) <= self.cache.max_len

    def mixed(self, key: tuple[int, int, int, bool], prompt: list[int], slot: int, pad_id: int, start: int = 0):
        """Prefills ``prompt`` into ``slot`` from position ``start`` on and runs a decode step of rows
        0..rows-1 in one captured pass (``key`` from mixed_key, for ``len(prompt)`` tokens, resuming if ``start``
        is not 0, with a span that covers the rows and, resuming, ``start + len(prompt)``). ``prompt`` is a whole prompt (``start``
        0) or one chunk of it, after the chunks before it (chunked prefill): a chunk that is not the last must
        be a multiple of
        PREFILL_GRAPH_STEP long, so it has no padding. The prompt's slot must stay free until its last chunk
        (active 0): its own decode row, if the rows cover it, writes inside the chunk, which the chunk then
        overwrites, and after the pass points past the chunk (so a decode step between two chunks writes
        where the next chunk will). Returns (the last-position logits [1, V] of ``prompt``, (decode logits
        [rows, V], greedy tokens [rows], their logprobs [rows])); the greedy tokens are already the rows' next
        input and their positions moved on, as decode() leaves them. The outputs are shared by every mixed
        pass: read them before the next one.

        Why: a decode step of 64 rows reads all the weights for a little GEMM work, while a 512-token
        prefill pass is bound by its GEMMs; the decode rows ride in the prefill's GEMMs instead of a pass
        of their own. Measured on an H200, 7B: 16.41 ms against 12.36 + 5.80 for the two passes it
        replaces (docs/gpu_notes.md run 61). Chunked prefill in vLLM and TensorRT-LLM's in-flight
        batching mix a step the same way."""
        import torch

        length, rows, span, resumes = key
        # a later chunk attends over its slot up to the span; a prompt from position 0 over its own keys
        if (start + length > self.cache.max_len or resumes != (start > 0)
                or (resumes and start + len(prompt) > span)):
            raise ValueError(f"a mixed pass of {len(prompt)} tokens from position {start} does not fit key {key} "
                             f"(buffers of {self.cache.max_len} positions)")
        self._stage_prompt(prompt, slot, pad_id, length, start)
        ids, slot_ids, last, first = self._prefill_in[:4]
        self.mixed_graph_passes += 1
        graph = self._mixed_runs[key]
        if graph is None:  # no CUDA (tests): the same pass on the same padded buffers, run directly
            with torch.compiler.set_stance("fail_on_recompile"):
                self._mixed_fn()(ids[:length].view(1, length), slot_ids, last, first, rows, span, resumes)
        else:
            graph.replay()
        logits, chosen, lp = self._mixed_out
        return logits[:1], (logits[1: rows + 1], chosen[:rows], lp[:rows])

    def _mixed_fn(self):
        return self._mixed_compiled if self._mixed_compiled is not None else self._mixed_pass

    def _mixed_pass(self, ids, slot_ids, last, start, rows: int, span: int, resumes: bool):
        import torch

        n = ids.shape[1]
        # the prompt's own (free) row writes inside the chunk, which the chunk's write then overwrites
        self.positions.index_copy_(0, slot_ids, start)
        pos = self.positions[:rows]
        mask = self._row_mask(pos, span)
        prompt_pos = start + torch.arange(n, device=ids.device)
        prompt_mask = None
        if resumes:
            # additive, in the activations' dtype, built once for all layers (a boolean one is converted per call)
            seen = (self.span_ids[:span].unsqueeze(0) <= prompt_pos.unsqueeze(1)).repeat(self._heads_per_kv, 1)
            prompt_mask = torch.zeros(seen.shape, dtype=self.lm_head.weight.dtype, device=ids.device).masked_fill(
                ~seen, float("-inf"))
        hidden = self.decoder(
            input_ids=torch.cat([ids, self.tokens[:rows].unsqueeze(0)], dim=1),
            position_ids=torch.cat([prompt_pos, pos]).unsqueeze(0),
            attention_mask=mask,
            past_key_values=self.cache.for_mixed(slot_ids, n, rows, span, pos, start, prompt_mask),
            use_cache=True, slot_cache=self.cache).last_hidden_state
        logits = self.lm_head(torch.cat([hidden[0, last], hidden[0, n:]]))
        chosen, logprob = self._greedy_next(logits[1:], rows)
        # past the chunk: a decode step before the next chunk writes the free row where that chunk will (the
        # host sets a finished prompt's position itself); within the buffers
        self.positions.index_copy_(0, slot_ids, (start + n).clamp(max=self.cache.max_len - 1))
        out_logits, out_chosen, out_lp = self._mixed_out
        out_logits[: rows + 1].copy_(logits)
        out_chosen[:rows].copy_(chosen)
        out_lp[:rows].copy_(logprob)

    def _mark_cache_static(self) -> None:
        import torch

        # the cache buffers never change shape: static, so no prompt length or count gets one symbol with
        # a buffer dimension of the same size at trace time (duck sizing) and is then pinned to it
        for t in self.cache.keys + self.cache.values:
            torch._dynamo.mark_static(t)

    def compile_mixed_pass(self) -> None:
        """torch.compile the mixed pass (dynamic shapes) and run it once, at the most rows and the longest
        span, so the compile happens before ready; every captured (prompt, rows, span) reuses it. With
        chunked prefill (``mixed_chunk_tokens``) also the form for chunks after a prompt's first: a compile
        of its own (Dynamo specialises on the flag)."""
        import torch

        t0 = time.monotonic()
        self._mark_cache_static()
        compiled = torch.compile(self._mixed_pass, dynamic=True)
        self._alloc_mixed_out()
        try:
            # a prompt length no row count or span equals, so none of them is specialised to another
            n = 37
            for resumes in (False, True) if self.mixed_chunk_tokens else (False,):
                compiled(torch.ones((1, n), dtype=torch.long, device=self.device),
                         torch.zeros(1, dtype=torch.long, device=self.device),
                         torch.full((1,), n - 1, dtype=torch.long, device=self.device),
                         torch.zeros(1, dtype=torch.long, device=self.device), self.mixed_rows[-1], self.spans[-1],
                         resumes)
        except Exception as e:  # noqa: BLE001 - without it, mixed passes are captured uncompiled
            self.mixed_compile_error = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("torch.compile of the mixed pass failed, capturing it uncompiled: %s", self.mixed_compile_error)
            torch._dynamo.reset()
        else:
            self._mixed_compiled = compiled
        self.positions.zero_()
        self.mixed_compile_s = time.monotonic() - t0
        log.info("mixed pass compiled in %.1fs", self.mixed_compile_s)

    def _alloc_mixed_out(self) -> None:
        import torch

        if self._mixed_out is None:
            rows = self.mixed_rows[-1]
            self._mixed_out = (torch.zeros(rows + 1, self.lm_head.out_features, dtype=self.lm_head.weight.dtype,
                                           device=self.device),
                               torch.zeros(rows, dtype=torch.long, device=self.device),
                               torch.zeros(rows, dtype=torch.float32, device=self.device))

    def capture_mixed_graphs(self) -> None:
        """Captures the mixed pass for every prompt length up to ``mixed_graph_tokens`` (multiples of
        PREFILL_GRAPH_STEP, as the one-prompt graphs), row count and span, and with chunked prefill the form
        for later chunks at every length up to ``mixed_chunk_tokens``. Without CUDA the keys run the
        pass directly on the same padded buffers, so CPU tests check it. A failed capture leaves separate
        prefill and decode passes, which is correct."""
        import torch

        top = min(self.mixed_graph_tokens, self.cache.max_len - 1)
        lengths = list(range(PREFILL_GRAPH_STEP, top + 1, PREFILL_GRAPH_STEP))
        if not lengths:
            return
        t0 = time.monotonic()
        self._alloc_mixed_out()
        self._alloc_prompt_staging()
        ids, slot_ids, last, first = self._prefill_in[:4]
        fn = self._mixed_fn()
        keys = [(length, rows, span, resumes) for length in lengths for rows in self.mixed_rows for span in self.spans
                for resumes in (False, True) if not resumes or length <= self.mixed_chunk_tokens]
        runs: dict[tuple[int, int, int, bool], object] = {}
        try:
            if self.device.type != "cuda":
                runs = dict.fromkeys(keys)
            else:
                reserved = torch.cuda.memory_reserved(self.device)
                pool, stream = self._shared_pool(), torch.cuda.Stream()
                # largest first, so the smaller graphs reuse the pool's blocks; the warm-up passes write slot
                # 0's first positions and the rows' position 0, which no sequence owns yet
                slot_ids.zero_()
                first.zero_()
                for key in sorted(keys, reverse=True):
                    length, rows, span, resumes = key
                    last.fill_(length - 1)
                    args = (ids[:length].view(1, length), slot_ids, last, first, rows, span, resumes)
                    try:
                        with torch.compiler.set_stance("fail_on_recompile"):
                            runs[key] = capture_graph(lambda a=args: fn(*a), pool, stream)[0]
                    except RuntimeError as e:
                        # a key the compile does not cover (dynamo raises before anything runs): that one runs
                        # as separate passes, the others stay
                        if "fail_on_recompile" not in str(e):
                            raise
                        self.mixed_graph_error = self.mixed_graph_error or f"{key}: {str(e)[:300]}"
                torch.cuda.synchronize()
                self.positions.zero_()
                # the pool is the prefill graphs': what the GPU gave beyond it (0 on the 7B, run 61)
                self.mixed_graph_reserved_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved)
                if self.mixed_graph_error:
                    log.warning("%d of %d mixed passes not captured (a shape the compile does not cover), the "
                                "first: %s", len(keys) - len(runs), len(keys), self.mixed_graph_error)
        except Exception as e:  # noqa: BLE001 - separate passes remain, which is correct
            self.mixed_graph_error = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("capturing the mixed passes failed, prefilling and decoding in separate passes (set "
                        "mixed_graph_tokens: 0 to skip the attempt): %s", self.mixed_graph_error)
            runs = {}
        self._mixed_runs, self.mixed_graphs = runs, bool(runs)
        self.mixed_graph_capture_s = time.monotonic() - t0
        log.info("captured %d mixed passes (prompts up to %d tokens, rows %s) in %.1fs, %.2f GB", len(runs), top,
                 self.mixed_rows, self.mixed_graph_capture_s, self.mixed_graph_reserved_bytes / 1e9)

    def _prefill_pass(self, ids, slot_ids, last):
        import torch

        n, longest = ids.shape
        pos = torch.arange(longest, device=ids.device).unsqueeze(0).expand(n, -1)
        dummy_mask = torch.ones((n, 1, 1, 1), dtype=torch.bool, device=ids.device)  # causal inside attention
        hidden = self.decoder(input_ids=ids, position_ids=pos, attention_mask=dummy_mask,
                              past_key_values=self.cache.for_prefill(slot_ids), use_cache=True).last_hidden_state
        return self.lm_head(hidden[torch.arange(n, device=ids.device), last])

    def _step(self, rows: int, span: int):
        pos = self.positions[:rows]
        hidden = self.decoder(input_ids=self.tokens[:rows].unsqueeze(1), position_ids=pos.unsqueeze(1),
                              attention_mask=self._row_mask(pos, span),
                              past_key_values=self.cache.for_decode(rows, span, pos), use_cache=True).last_hidden_state
        logits = self.lm_head(hidden[:, -1])
        chosen, logprob = self._greedy_next(logits, rows)
        return logits, chosen, logprob

    def _row_mask(self, pos, span: int):
        """[rows, 1, 1, span]: each decode row attends to its positions up to its own."""
        return (self.span_ids[:span].unsqueeze(0) <= pos.unsqueeze(1))[:, None, None, :]

    def _greedy_next(self, logits, rows: int):
        """Rows 0..rows-1's greedy tokens and their logprobs; writes the tokens as the rows' next input and
        moves every active row one position on."""
        import torch

        scores = logits.float()
        chosen = scores.argmax(dim=-1)
        logprob = scores.gather(1, chosen.unsqueeze(1)).squeeze(1) - torch.logsumexp(scores, dim=-1)
        self.tokens[:rows].copy_(chosen)
        # free rows stay where they are (active 0) and write there harmlessly
        self.positions[:rows].add_(self.active[:rows])
        return chosen, logprob

    def decode_key(self, busy_rows: int, longest: int) -> tuple[int, int]:
        """The (rows, span) bucket whose captured step :meth:`decode` runs for these rows."""
        return bucket(busy_rows, self.batch_sizes), bucket(longest, self.spans)

    def decode(self, busy_rows: int, longest: int):
        """One step for rows 0..busy_rows-1 whose longest sequence (after this step) is `longest`.
        Returns (logits, greedy tokens, their logprobs) for a bucket of rows >= busy_rows; the greedy
        tokens are already the next step's input and the positions already moved on."""
        if not self.use_graphs:
            return self._step(busy_rows, longest)
        graph, out = self.graphs[self.decode_key(busy_rows, longest)]
        graph.replay()
        return out

    # ---- graphs ------------------------------------------------------------
    def compile(self) -> None:
        """torch.compile the decode step and run it once, so the compile happens now (before ready).

        Inductor fuses the ~40 small kernels per layer between the GEMMs (norms, rotary, softmax,
        residuals); measured on an H200, 7B, batch 1: replay 6.54 -> 4.59 ms. One dynamic-shape compile
        serves every (batch, span) bucket, given the spare position and the batch floor of 2 set up in
        ``__init__``.
        """
        import torch

        t0 = time.monotonic()
        eager = self._step
        self._step = torch.compile(eager, dynamic=True)
        try:
            self._step(max(self.batch_sizes), self.spans[-1])
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager step, which is correct
            # e.g. no C compiler on the node for Triton's launcher: serve ~40 % slower rather than not at all
            self._step = eager
            self.compile_error = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("torch.compile of the decode step failed, decoding uncompiled (set compile_decode: false "
                        "to skip the attempt): %s", self.compile_error)
            torch._dynamo.reset()
        self.positions.zero_()
        self.compile_s = time.monotonic() - t0

    def compile_prefill_pass(self, warm: tuple[tuple[int, int], ...] = ((1, 19), (2, 37))) -> None:
        """torch.compile the prefill pass and run it for one prompt and for two, so both compiles
        happen now (before ready): Inductor specialises a batch of 1 apart from the rest, and every
        other (prompts, length) shape reuses the second compile.

        Why: eager, a prefill pass of 4 x 512 tokens on the 7B ran at ~560 TFLOP/s of its GEMMs' work
        (47.5 ms on an H200); the ~1,500 kernels between GEMMs (fp32 RMSNorm in six steps, rotary,
        SiLU-and-multiply, residuals) each read and write the whole [tokens, hidden] or [tokens, ffn]
        activation, so they cost ~20 % of the pass, and a single prompt's pass is launch-bound.
        """
        import torch

        t0 = time.monotonic()
        self._mark_cache_static()
        compiled = torch.compile(self._prefill_pass, dynamic=True)
        try:
            for n, length in warm:  # (prompts, tokens each)
                ids = torch.ones((n, length), dtype=torch.long, device=self.device)
                slot_ids = torch.arange(n, dtype=torch.long, device=self.device)
                compiled(ids, slot_ids, torch.full((n,), length - 1, dtype=torch.long, device=self.device))
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager pass, which is correct
            self.prefill_compile_error = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("torch.compile of the prefill pass failed, prefilling uncompiled (set compile_prefill: "
                        "false to skip the attempt): %s", self.prefill_compile_error)
            torch._dynamo.reset()
        else:
            self._prefill_compiled, self.prefill_compiled = compiled, True
        self.prefill_compile_s = time.monotonic() - t0
        log.info("prefill pass compiled in %.1fs", self.prefill_compile_s)

    def capture(self) -> None:
        import torch

        if not self.use_graphs:
            return
        t0 = time.monotonic()
        if self.compile_prefill:
            self.compile_prefill_pass()
        if self.compile_step:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.compile()
            torch.cuda.current_stream().wait_stream(stream)
        self._capture_missing()
        self.capture_prefill_graphs()
        if self.mixed_graph_tokens:
            if self.compile_prefill:
                self.compile_mixed_pass()
            self.capture_mixed_graphs()
        self.capture_s = time.monotonic() - t0
        log.info("captured %d decode graphs (batch %s x span %s) in %.1fs (compile %.1fs)", len(self.graphs),
                 self.batch_sizes, self.spans, self.capture_s, self.compile_s)

    def _capture_missing(self) -> None:
        """Captures a graph for every (batch, span) bucket that has none yet."""
        import torch

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # largest first, so smaller graphs reuse the pool's blocks
        for rows in sorted(self.batch_sizes, reverse=True):
            for span in sorted(self.spans, reverse=True):
                if (rows, span) not in self.graphs:
                    self.graphs[(rows, span)] = capture_graph(lambda r=rows, s=span: self._step(r, s),
                                                              self._pool, stream)
        torch.cuda.synchronize()
        self.positions.zero_()
