"""PyTorch + transformers backend with continuous batching.

One background thread owns the model. Each iteration it (1) admits waiting
requests while the batch has room and their prompt + max_tokens fit in the
KV-token budget, (2) prefills the admitted prompts together in one forward
pass (left-padded), merges them into the running batch, and (3) runs one
decode step for every running sequence at once. Finished rows are dropped
from the batch (and the cache) right away, so new requests join on the next
iteration instead of waiting for the whole batch to drain — the
continuous-batching scheme of Orca / TGI, on transformers' ``DynamicCache``.

Sampling is per request (temperature, top_p, seed) on the batch's logits.
Logprobs are of the model's unmodified distribution.

The forward passes of the dynamic cache go through a runner
(:mod:`serve_app.engines.hf_batch`): the model in this process, or with
tensor_parallel_size > 1 one shard per rank worker (:mod:`serve_app.engines.hf_tp`);
scheduling, sampling and detokenizing stay here either way.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from serve_app.errors import (
    ContextLengthExceededError,
    EngineError,
    EngineNotReadyError,
    InvalidRequestError,
    OverloadedError,
)

from .base import Engine, EngineChunk, EngineStats, GenerationRequest, ends_stream, handout_order
from .hf_batch import LocalRunner, resolve_device_dtype
from .launch_timing import GapMeter, PassTimer, PassTimes, launch_wait_s, pass_label
from .memory import KVLayout, check_static, check_tokens, device_budget, long_context_error, padded_peak_tokens
from .options import HFEngineOptions
from .prefill_policy import PrefillContext, hold_prefill
from .textproc import IncrementalDetokenizer, StopStringFilter

log = logging.getLogger(__name__)

_ABORT = "abort"


@dataclass(eq=False)
class _Seq:
    req: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detok: IncrementalDetokenizer
    stops: StopStringFilter
    generator: object | None
    reserved_tokens: int
    n_generated: int = 0
    finished: bool = False
    pend_ids: list = field(default_factory=list)
    pend_lps: list = field(default_factory=list)
    pend_top: list = field(default_factory=list)
    submitted_s: float = field(default_factory=time.monotonic)
    queue_time_s: float | None = None
    queued_pass: int = 0  # the engine's forward-pass count when the request joined the waiting queue
    slot: int = -1  # static cache: the KV row this sequence owns
    pos: int = 0  # static cache: tokens of this sequence in its slot
    prefilling: bool = False  # static cache: its prompt is going into its slot chunk by chunk (not decoding yet)

    @property
    def fast_sampling(self) -> bool:
        """Sampled on the GPU without a host round trip (greedy, or plain temperature)."""
        sp = self.req.sampling
        return sp.top_logprobs == 0 and (sp.temperature == 0 or (sp.top_p >= 1.0 and sp.seed is None))


@dataclass
class _InFlight:
    """A pass queued on the GPU whose tokens the host has not read yet (static cache)."""
    snapshot: list  # (row in the host buffers, sequence) for every token the pass makes
    host_tok: object
    host_lp: object
    event: object | None  # recorded after the copies to the host; None without CUDA
    n: int  # rows of the host buffers to read
    kind: tuple  # the captured graph's key: passes of one kind take the same GPU time (launch_timing)
    launched_s: float
    started_s: float | None = None  # when the GPU started it, as far as the host can tell
    started_exact: bool = False  # the pass before it ended while the host waited for it: started_s is exact
    index: int = -1  # forward_passes once it was launched: consecutive passes are one apart (GapMeter)
    start_event: object | None = None  # recorded before its kernels; None without CUDA


def _gumbel_perturbed(scaled):
    """``scaled`` (logits / T) plus standard Gumbel noise: its argmax is a draw from softmax(scaled) (the
    Gumbel-max trick), on the device, with no host sync, for the decode rows and a mixed pass's first token."""
    import torch

    return scaled + -torch.empty_like(scaled).exponential_().log()


def _deliver_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


def _generation_config(model_dir):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:  # no generation_config.json: the tokenizer's EOS is enough
        return None


class HFTokenization:
    """The chat template, tokenizing and token text of an hf model: the engine's, and alone (without
    the model) the replica's when the engine runs in a process of its own."""

    tokenizer = None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja errors for roles the template refuses, etc.
            raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from e
        if not isinstance(out, list):
            out = out["input_ids"]
        if out and isinstance(out[0], list):
            out = out[0]
        return [int(t) for t in out]

    def encode_text(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class HFFrontend(HFTokenization):
    def __init__(self, options: HFEngineOptions):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        from .model_store import resolve_model_dir

        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(options.model), local_files_only=True)


class HFEngine(HFTokenization, Engine):
    name = "hf"
    options_model = HFEngineOptions
    max_tensor_parallel_size = 64
    supports_submit = True

    def __init__(self, options: HFEngineOptions, parallel=None):
        super().__init__(options, parallel)
        self.options: HFEngineOptions = options
        self._cv = threading.Condition()
        self._inbox: collections.deque[_Seq] = collections.deque()
        self._aborts: set[str] = set()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._runner = None  # dynamic cache: steps the batch (LocalRunner or TensorParallelRunner)
        self._next = None  # dynamic cache: [B, 1] sampled tokens, not yet in the cache
        self._slots = None  # SlotDecoder when the static cache is on
        self._free: list[int] = []
        self._inflight: _InFlight | None = None  # the launched, not yet read pass (static, cuda)
        self._pass_timer = PassTimer()  # the GPU time of recent passes, for launch_lead_ms
        self._gaps = GapMeter()  # the GPU's time between passes, while there is work
        self._pass_times = PassTimes()  # the GPU time of each pass, by kind
        self._gpu_free_s: float | None = None  # when the last pass read had ended, if the host saw it end
        self._chunked: _Seq | None = None  # static: the prompt being prefilled in chunks (mixed_chunk_tokens)
        self._outbox: list[tuple[_Seq, object]] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._fatal: BaseException | None = None
        self._ready = False
        self._stats = EngineStats()
        self.load_time_s: float | None = None
        self.kv_cache_bytes = 0  # what the KV cache may take (static: takes), checked against memory at load
        self.weights_bytes = 0  # parameters and buffers on the device (one rank's engine)
        self.load_peak_bytes: int | None = None  # GPU: the most torch held while loading, before the KV cache

    @classmethod
    def frontend(cls, options: HFEngineOptions) -> HFFrontend:
        return HFFrontend(options)

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        try:
            await asyncio.to_thread(self._load)
        except BaseException:
            # whoever holds the error holds this engine through its traceback's frames (a caller that keeps or
            # logs it; the event loop's wake-up handle until the loop turns), and with it what it had loaded: a
            # 7B's weights on the GPU when the KV check refuses (run 119). They go now; a retry in this process
            # with a smaller max_model_len then finds the memory free
            self.model = self._slots = self._runner = None
            raise
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()
        self._ready = True

    def _load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .model_store import resolve_model_dir

        t0 = time.monotonic()
        opts = self.options
        if opts.num_threads:
            torch.set_num_threads(opts.num_threads)
        elif opts.device != "cuda":
            # Ray sets OMP_NUM_THREADS=num_cpus (often 1) in workers; the engine
            # thread is the only heavy compute in this process, so use the cores.
            torch.set_num_threads(os.cpu_count() or 1)
        model_dir = resolve_model_dir(opts.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        model_len = int(getattr(cfg, "max_position_embeddings", 2048))
        # refused as vLLM refuses it, before minutes of loading: a silent cut to model_len would leave a replica
        # refusing the prompts it was set up for
        too_long = long_context_error(opts.max_model_len, model_len, opts.model)
        if too_long:
            raise EngineNotReadyError(too_long)
        tp = self.parallel.tensor_parallel_size
        if tp > 1:
            # the shards live in the rank workers; this process schedules and samples
            gen_cfg = _generation_config(model_dir)
            device, dtype_name = f"{tp} ranks", opts.dtype
            self.device = torch.device("cpu")
        else:
            device, dtype_name = resolve_device_dtype(opts)
            self.device = torch.device(device)
            self.dtype = getattr(torch, dtype_name)
            if opts.quantization == "fp8":
                self._check_fp8()  # in a second, not after minutes of loading
            # loaded on the CPU; fp8 moves it to the device layer by layer as it quantizes (_quantize), so the
            # GPU never holds the whole model in dtype: a model whose bf16 weights exceed it loads all the same
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir,
                dtype=self.dtype,
                attn_implementation=opts.attn_implementation,
                local_files_only=True,
            )
            if opts.quantization == "none":
                self.model.to(self.device)
            self.model.eval()
            cfg, gen_cfg = self.model.config, self.model.generation_config
        self._max_model_len = min(opts.max_model_len or model_len, model_len, opts.max_kv_tokens)
        eos = set()
        gen_eos = getattr(gen_cfg, "eos_token_id", None)
        for e in (gen_eos if isinstance(gen_eos, list) else [gen_eos]):
            if e is not None:
                eos.add(int(e))
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self._eos_ids = eos
        self._pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos or {0}))
        self._backend_tokenizer = self.tokenizer.backend_tokenizer
        self._rng = torch.Generator(device="cpu")
        self._rng.seed()
        if tp > 1:
            from .hf_tp import TensorParallelRunner

            self._runner = TensorParallelRunner(self.parallel, str(model_dir), opts, self._pad_id)
        elif opts.resolved_kv_cache(device) == "static":
            self._setup_static(device)
        else:
            self._quantize()
            # the dynamic cache grows with the batch up to what max_kv_tokens admits (rows x the longest): that
            # must fit, or a busy moment runs out of memory with every running request in it
            self.kv_cache_bytes = check_tokens(self._kv_layout(), opts.max_kv_tokens, self._kv_budget())
            self._runner = LocalRunner(self.model, self.device, self._pad_id)
        self._warm_up()
        self.load_time_s = time.monotonic() - t0
        log.info("hf engine ready: %s on %s/%s in %.1fs", opts.model, device, dtype_name, self.load_time_s)

    def _check_fp8(self) -> None:
        from .fp8 import FP8UnsupportedError, check_device

        try:
            check_device(self.device, self.dtype, self.options.fp8_scales)
        except FP8UnsupportedError as e:
            raise EngineNotReadyError(str(e)) from e

    def _quantize(self) -> None:
        """quantization 'fp8': the decoder's linear layers to e4m3 on the device, one at a time, then the rest
        of the model to the device (after any fusing, before graphs are captured, so every captured pass runs
        them)."""
        if self.options.quantization != "fp8":
            return
        from .fp8 import quantize_linears

        n = quantize_linears(self.model, self.dtype, self.options.fp8_scales, device=self.device)
        self.model.to(self.device)
        log.info("fp8: %d linear layers quantized (e4m3, row-wise scales applied in the %s; the LM head kept in %s)",
                 n, self.options.fp8_scales, self.dtype)

    def _kv_layout(self):
        return KVLayout.of(self.model.config, self.dtype.itemsize)

    def _kv_budget(self):
        """The KV cache's budget, once the weights are in place; records what they take (and, on a GPU, the
        load's peak: with fp8 it shows the bf16 model never sat on the GPU whole) for the warm-up report."""
        import torch

        held = {t.data_ptr(): t.numel() * t.element_size()
                for t in list(self.model.parameters()) + list(self.model.buffers())}
        self.weights_bytes = sum(held.values())
        if self.device.type == "cuda":
            self.load_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        return device_budget(self.device, self.options.gpu_memory_utilization, self.weights_bytes)

    def _setup_static(self, device: str) -> None:
        import heapq

        from .slot_kv import ATTENTION_NAME, SlotDecoder, register_attention, use_prompt_attention

        opts = self.options
        register_attention()
        use_prompt_attention(opts.prompt_attention, self.device)
        self.model.set_attn_implementation(ATTENTION_NAME)
        if opts.fuse_projections:
            from .fused import fuse_projections

            fuse_projections(self.model)
        self._quantize()
        use_graphs = device == "cuda" and opts.cuda_graphs
        spare = 1 if use_graphs and opts.compile_decode else 0  # SlotDecoder's spare position
        self.kv_cache_bytes = check_static(self._kv_layout(), opts.max_num_seqs, self._max_model_len + spare,
                                           self._kv_budget(), spare_tokens=spare)
        sizes = opts.cuda_graph_batch_sizes or (
            [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(96, opts.max_num_seqs + 1, 32)))
        self._slots = SlotDecoder(
            self.model, opts.max_num_seqs, self._max_model_len, self.dtype, self.device,
            use_graphs=use_graphs, compile_step=use_graphs and opts.compile_decode,
            compile_prefill=use_graphs and opts.compile_prefill,
            prefill_graph_tokens=opts.prefill_graph_tokens if use_graphs else 0,
            mixed_graph_tokens=opts.mixed_graph_tokens if use_graphs else 0,
            mixed_chunk_tokens=opts.mixed_chunk_tokens if use_graphs else 0,
            batch_sizes=[b for b in sizes if b <= opts.max_num_seqs], span_step=opts.cuda_graph_span_step)
        self._free = list(range(opts.max_num_seqs))
        heapq.heapify(self._free)
        if self._slots.device.type == "cuda":
            import torch

            # two sets of pinned host buffers: one step's ids in flight while the previous one is read
            # (one row more: the first token of the prompt a mixed pass finishes)
            self._host = [(torch.empty(opts.max_num_seqs + 1, dtype=torch.long, pin_memory=True),
                           torch.empty(opts.max_num_seqs + 1, dtype=torch.float32, pin_memory=True))
                          for _ in range(2)]
            self._host_turn = 0
        log.info("static KV cache: %d slots x %d tokens, %.2f GB", opts.max_num_seqs, self._max_model_len,
                 self._slots.cache.bytes / 1e9)

    def _warm_up(self) -> None:
        import torch

        if self._slots is not None:
            with torch.inference_mode():
                ids = self.encode_text("Hello")
                self._slots.prefill([ids], [0], self._pad_id)
                self._slots.capture()
            self._stats.forward_passes = 0
            return
        with torch.inference_mode():
            logits = self._runner.prefill([self.encode_text("Hello")])
            self._runner.decode(logits.argmax(-1, keepdim=True))
            self._runner.clear()

    async def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self._ready = False

    async def check_health(self) -> None:
        if not self._ready:
            raise EngineNotReadyError("engine is not started")
        if self._fatal is not None or (self._thread is not None and not self._thread.is_alive()):
            raise EngineNotReadyError(f"engine loop died: {self._fatal!r}")
        if self._runner is not None:
            await self._runner.check()
            if self._runner.broken is not None:
                raise EngineNotReadyError(f"engine cannot step its batch: {self._runner.broken}")

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    # ---- request path (event loop side) ---------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineChunk]:
        seq = self._submit(request)
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if ends_stream(item):
                    return
        finally:
            if not seq.finished:
                self._request_abort(request.request_id)

    def submit(self, request: GenerationRequest, sink) -> None:
        self._submit(request, sink)

    def _submit(self, request: GenerationRequest, queue=None) -> _Seq:
        import torch

        if not self._ready or self._stopping:
            raise EngineNotReadyError("engine is not ready")
        sp = request.sampling
        n_prompt = len(request.prompt_token_ids)
        if n_prompt == 0:
            raise InvalidRequestError("the prompt is empty after tokenization", param="prompt")
        if n_prompt + sp.max_tokens > self._max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self._max_model_len} tokens. However, you "
                f"requested {n_prompt + sp.max_tokens} tokens ({n_prompt} in the messages, "
                f"{sp.max_tokens} in the completion). Please reduce the length of the messages or completion.",
                param="messages",
            )
        gen = None
        if sp.seed is not None and sp.temperature > 0:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(int(sp.seed))
        seq = _Seq(
            req=request,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue() if queue is None else queue,
            detok=IncrementalDetokenizer(self._backend_tokenizer),
            stops=StopStringFilter(sp.stop),
            generator=gen,
            reserved_tokens=n_prompt + sp.max_tokens,
        )
        with self._cv:
            # requests the batch can take right away are not "waiting"
            free_slots = max(0, self.options.max_num_seqs - len(self._running))
            if len(self._inbox) + len(self._waiting) >= self.options.max_waiting_requests + free_slots:
                raise OverloadedError(
                    f"the engine's waiting queue is full ({self.options.max_waiting_requests} requests)"
                )
            if request.request_id in self._by_id:
                raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
            self._by_id[request.request_id] = seq
            self._inbox.append(seq)
            self._cv.notify()
        return seq

    def _request_abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    async def abort(self, request_id: str) -> None:
        self._request_abort(request_id)

    @property
    def warm_up(self) -> dict:
        """What the start did before ready (on a GPU: minutes of compiling), and whether serving has met a
        prefill shape the compiled pass does not cover; the replica reports it with its stats."""
        out: dict = {"load_s": self.load_time_s, "kv_cache": "static" if self._slots is not None else "dynamic",
                     "kv_cache_gb": self.kv_cache_bytes / 1e9, "weights_gb": self.weights_bytes / 1e9,
                     "load_peak_gb": None if self.load_peak_bytes is None else self.load_peak_bytes / 1e9}
        slots = self._slots
        if slots is not None:
            from .slot_kv import compile_cache_counts

            out.update(cuda_graphs=len(slots.graphs), graph_capture_s=slots.capture_s,
                       decode_compile_s=slots.compile_s, decode_compile_error=slots.compile_error,
                       prefill_compiled=slots.has_compiled_prefill,
                       prefill_compile_s=slots.prefill_compile_s, prefill_compile_error=slots.prefill_compile_error,
                       prefill_eager_passes=slots.prefill_eager_passes,
                       prefill_graphs=len(slots.prefill_graph_lengths), prefill_graph_capture_s=slots.prefill_graph_capture_s,
                       prefill_graph_gb=slots.prefill_graph_reserved_bytes / 1e9,
                       prefill_graph_error=slots.prefill_graph_error,
                       mixed_graphs=len(slots.mixed_graph_keys), mixed_compile_s=slots.mixed_compile_s,
                       mixed_compile_error=slots.mixed_compile_error,
                       mixed_graph_capture_s=slots.mixed_graph_capture_s,
                       mixed_graph_gb=slots.mixed_graph_reserved_bytes / 1e9, mixed_graph_error=slots.mixed_graph_error,
                       compile_cache=compile_cache_counts())
        return out

    @property
    def _kv_capacity_tokens(self) -> int:
        """Tokens the KV cache may hold: the static slots', all allocated, or max_kv_tokens for the dynamic one."""
        if self._slots is not None:
            return self._slots.num_slots * self._slots.max_len
        return self.options.max_kv_tokens

    def stats(self) -> EngineStats:
        s = self._stats
        running = list(self._running)
        if self._slots is not None:
            used = sum(seq.pos for seq in running)
        else:
            # what the left-padded cache holds: every row as long as the longest
            used = len(running) * max((cached for cached, _ in self._kv_rows(running)), default=0)
        return EngineStats(
            num_waiting=len(self._inbox) + len(self._waiting),
            num_running=len(self._running),
            kv_cache_usage=min(1.0, used / self._kv_capacity_tokens),
            forward_passes=s.forward_passes,
            prefill_passes=s.prefill_passes,
            prefill_graph_passes=self._slots.prefill_graph_passes if self._slots is not None else 0,
            prefill_eager_passes=self._slots.prefill_eager_passes if self._slots is not None else 0,
            mixed_passes=self._slots.mixed_graph_passes if self._slots is not None else 0,
            prompt_tokens=s.prompt_tokens,
            generated_tokens=s.generated_tokens,
            aborted_requests=s.aborted_requests,
            gpu_gaps_measured=self._gaps.measured,
            gpu_gap_total_ms=self._gaps.total_ms,
            gpu_gaps_late=self._gaps.late,
            gpu_pass_ms=self._pass_times.snapshot(),
            healthy=self._fatal is None,
        )

    # ---- engine thread ---------------------------------------------------
    def _run(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                with self._cv:
                    idle = False
                    while (
                        not self._stopping
                        and not self._inbox
                        and not self._aborts
                        and not self._waiting
                        and not self._running
                        and self._inflight is None
                    ):
                        idle = True
                        self._cv.wait()
                    if idle:  # the GPU then waited for requests, not for the host
                        self._gaps.restart()
                    if self._stopping:
                        break
                    # launch_lead_ms: requests that arrive meanwhile still make the next pass
                    wait_s = self._launch_wait_s()
                    while wait_s > 0 and not self._stopping:
                        self._cv.wait(wait_s)
                        wait_s = self._launch_wait_s()
                    if self._stopping:
                        break
                    for seq in self._inbox:
                        seq.queued_pass = self._stats.forward_passes
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                    aborts, self._aborts = self._aborts, set()
                try:
                    if aborts:
                        self._apply_aborts(aborts)
                    self._iteration()
                except Exception as e:  # a failed step fails the batch, not the engine
                    log.exception("engine step failed")
                    self._fail_running(EngineError(f"generation failed: {e}"))
                self._flush()
        self._fail_all(EngineNotReadyError("engine is shutting down"))
        self._flush()

    def _launch_wait_s(self) -> float:
        lead_ms = self.options.launch_lead_ms
        p = self._inflight
        if lead_ms is None or p is None or p.started_s is None:
            return 0.0
        return launch_wait_s(time.monotonic(), p.started_s, self._pass_timer.predicted_s(p.kind), lead_ms / 1000)

    def _flush(self) -> None:
        """One cross-thread wake-up per event loop per step, not one per token; in base.handout_order."""
        if not self._outbox:
            return
        by_loop: dict = {}
        for seq, item in handout_order(self._outbox):
            by_loop.setdefault(seq.loop, []).append((seq.queue, item))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    def _apply_aborts(self, ids: set[str]) -> None:
        for rid in ids:
            seq = self._by_id.get(rid)
            if seq is None or seq.finished:
                continue
            self._finish(seq, _ABORT)
            self._stats.aborted_requests += 1
        self._waiting = collections.deque(s for s in self._waiting if not s.finished)
        self._drop_finished()

    def _hold_prefill(self) -> bool:
        opts = self.options
        wait_steps = opts.max_prefill_wait_steps
        if not self._waiting or wait_steps <= 0:
            return False
        tokens = 0
        for seq in self._waiting:  # only up to a full pass's worth: the queue may be long
            tokens += len(seq.req.prompt_token_ids)
            if tokens >= opts.max_prefill_tokens:
                break
        held, _ = hold_prefill(PrefillContext(
            running=len(self._running), free_rows=opts.max_num_seqs - len(self._running),
            waiting=len(self._waiting), waiting_tokens=tokens,
            oldest_waited_steps=self._stats.forward_passes - self._waiting[0].queued_pass,
            max_prefill_tokens=opts.max_prefill_tokens, max_wait_steps=wait_steps,
            max_rows=opts.max_num_seqs, min_running=opts.prefill_hold_min_running))
        return held

    def _admit(self, limit: int | None = None) -> list[_Seq]:
        """The waiting prompts for the next prefill, in arrival order: all that fit one pass
        (max_prefill_tokens) and the free rows, or at most ``limit``."""
        new: list[_Seq] = []
        if self._hold_prefill():
            return new
        rows = self._kv_rows(self._running) if self._slots is None else None
        longest = 0
        opts = self.options
        while self._waiting and self._room_for(self._waiting[0], len(self._running) + len(new), rows):
            if limit is not None and len(new) >= limit:
                break
            seq = self._waiting[0]
            n = len(seq.req.prompt_token_ids)
            if new and (len(new) + 1) * max(longest, n) > opts.max_prefill_tokens:
                break
            self._waiting.popleft()
            new.append(seq)
            if rows is not None:
                rows += self._kv_rows([seq])
            longest = max(longest, n)
        return new

    @staticmethod
    def _kv_rows(seqs) -> list[tuple[int, int]]:
        """(tokens cached, tokens still to come at most) of each sequence's row in the dynamic cache."""
        out = []
        for s in seqs:
            cached = len(s.req.prompt_token_ids) + s.n_generated
            out.append((cached, max(0, s.reserved_tokens - cached)))
        return out

    def _room_for(self, seq: _Seq, running: int, rows: list[tuple[int, int]] | None = None) -> bool:
        """A row and KV room for ``seq`` beside ``running`` sequences; ``rows``: the dynamic cache's rows, as
        _kv_rows gives them (None for the static slots)."""
        if running >= self.options.max_num_seqs:
            return False
        if rows is not None:
            # the dynamic cache's rows are left-padded to the longest, so it holds rows x the longest row, which
            # can exceed the rows' sum several times (short rows joining a long one late); the peak it can reach
            # keeps it within max_kv_tokens, the figure checked against memory at start
            return padded_peak_tokens(rows + self._kv_rows([seq])) <= self.options.max_kv_tokens
        # a static slot holds max_model_len tokens, allocated and checked at start, and the request was refused
        # unless its prompt + max_tokens fit one: a free row is all it needs
        return True

    def _iteration(self) -> None:
        if self._slots is not None:
            return self._iteration_static()
        new = self._admit()
        if new:
            self._prefill(new)
        if self._running:
            self._decode()

    # ---- static slots ------------------------------------------------------
    def _decoding(self) -> list[_Seq]:
        return [s for s in self._running if not s.finished and not s.prefilling]

    def _iteration_static(self) -> None:
        if self._chunked is not None and self._chunked.finished:  # aborted between two chunks
            self._chunked = None
        if self._chunked is not None or self._start_chunked():
            return self._chunk_static()
        new = self._admit(limit=1 if self._one_prompt_mixed() else None)
        if new and self._mixed_static(new):
            return
        if new:
            # this pass makes the host wait (its first tokens are read at once): the pass in flight is handed
            # out first, or its tokens, a mixed pass's first token among them, would wait for this one too
            self._read_inflight()
            self._flush()
            self._prefill_static(new)
        busy = self._decoding()
        if busy and all(s.fast_sampling for s in busy):
            self._hand_over(self._launch_fast(busy))
            return
        self._read_inflight()
        busy = self._decoding()
        if busy:
            self._decode_static_sync(busy)

    def _start_static(self, new: list[_Seq]) -> None:
        """Gives the admitted sequences their slots; they run from now on: if their pass fails, they fail with
        the batch and their slots are freed."""
        now = time.monotonic()
        for s in new:
            self._give_slot(s, now)
            s.pos = len(s.req.prompt_token_ids)
        self._running.extend(new)
        self._stats.forward_passes += 1
        self._stats.prefill_passes += 1
        self._stats.prompt_tokens += sum(s.pos for s in new)

    def _give_slot(self, seq: _Seq, now: float) -> None:
        import heapq

        seq.queue_time_s = now - seq.submitted_s
        seq.slot = heapq.heappop(self._free)

    def _start_chunked(self) -> bool:
        """Takes the first waiting prompt for chunked prefill (mixed_chunk_tokens), if it is longer than a
        chunk, its chunks fit the buffers, and rows decode that the mixed passes can carry (greedy or plain
        temperature); the limits are _admit's, and the hold (max_prefill_wait_steps) does not apply: a chunk
        shares its pass with the rows already. A prompt longer than mixed_graph_tokens is chunked too: its
        whole-prompt pass would stall every decoding row (a 4 x 512-token pass of the 7B takes ~40 ms on an
        H200, docs/gpu_notes.md run 30)."""
        chunk = self.options.mixed_chunk_tokens
        if not chunk or not self._waiting or not self._slots.mixed_graphs:
            return False
        seq = self._waiting[0]
        n = len(seq.req.prompt_token_ids)
        busy = self._decoding()
        if n <= chunk or not busy or not all(s.fast_sampling for s in busy):
            return False
        if not self._room_for(seq, len(self._running)):
            return False
        rows, longest = self._rows_and_span(busy)
        # the first chunk's pass and the later chunks' (captured for the chunk size the engine started with)
        if (not self._slots.chunks_fit(n) or self._slots.mixed_key(chunk, rows, longest) is None
                or self._slots.mixed_key(min(chunk, n - chunk), rows, max(longest, n), resumes=True) is None):
            return False
        self._waiting.popleft()
        self._give_slot(seq, time.monotonic())
        seq.pos, seq.prefilling = 0, True
        # running from now on: if a pass fails, it fails with the batch and its slot is freed
        self._running.append(seq)
        self._chunked = seq
        return True

    def _chunk_static(self) -> None:
        """The next chunk of the prompt in chunked prefill, in one mixed pass with the decode step of the rows
        decoding (none left is fine: the pass's rows are then all free); after the last chunk the sequence
        decodes like any other.

        Why: a long prompt's pass stalls every decoding row for its whole length; in chunks each row waits
        one chunk's pass at most (CPU box: 650 -> 197-352 ms for a 480-token prompt, benchmarks/chunk_stall.py),
        and the prompt's own first token comes later. For throughput it was the last scheduling lever and
        measured none on an H200 (5,043 against 5,077 tok/s at 64 x 10 against whole-prompt mixed passes): a
        mixed pass costs ~6.5 ms plus ~1.2 ms per 64 prompt tokens, so the rows do not ride free
        (docs/gpu_notes.md runs 67-69)."""
        seq = self._chunked
        prompt = seq.req.prompt_token_ids
        start = seq.pos
        chunk = prompt[start: start + self.options.mixed_chunk_tokens]
        end = start + len(chunk)
        busy = self._decoding()
        rows, longest = self._rows_and_span(busy) if busy else (0, 0)
        # a later chunk attends over its slot: its span covers the chunk too
        key = self._slots.mixed_key(len(chunk), rows, max(longest, end) if start else longest, resumes=start > 0)
        if key is None:  # mixed passes switched off on a live engine (a benchmark's compare)
            raise EngineError("chunked prefill lost its mixed passes")
        began = self._timed_event()
        prompt_logits, step = self._slots.mixed(key, chunk, seq.slot, self._pad_id, start=start)
        self._stats.forward_passes += 1
        self._stats.prefill_passes += 1
        self._stats.prompt_tokens += len(chunk)
        seq.pos = end
        if end == len(prompt):
            self._chunked = None
            seq.prefilling = False
        self._after_mixed(key, busy, rows, step, prompt_logits, [seq] if end == len(prompt) else [], began)

    def _mixed_key_for(self, seq: _Seq, busy: list[_Seq]):
        """(the captured mixed pass that takes ``seq``'s whole prompt with the decode step of ``busy``, the rows it
        steps), or None (no rows decode, one samples on the host, or no pass covers them)."""
        if not busy or not all(s.fast_sampling for s in busy):
            return None
        rows, span = self._rows_and_span(busy)
        key = self._slots.mixed_key(len(seq.req.prompt_token_ids), rows, span)
        return None if key is None else (key, rows)

    def _one_prompt_mixed(self) -> bool:
        """mixed_one_prompt_per_pass: whether only the first waiting prompt is admitted, into a mixed pass with
        the rows' decode step, while others wait for the next passes. Why: a pass of several prompts stalls every
        decoding row for its whole length, and a prompt's first token waits for all of it; one prompt per mixed
        pass keeps the rows stepping (docs/gpu_notes.md, the loop model of runs 75 and 137)."""
        if not self.options.resolved_one_prompt_per_pass or len(self._waiting) < 2:
            return False
        return self._mixed_key_for(self._waiting[0], self._decoding()) is not None

    def _mixed_static(self, new: list[_Seq]) -> bool:
        """One new prompt and the running rows' decode step in one captured pass (SlotDecoder.mixed), if one
        covers them; False leaves both to the separate passes."""
        busy = self._decoding()
        if len(new) != 1:
            return False
        seq = new[0]
        found = self._mixed_key_for(seq, busy)
        if found is None:
            return False
        key, rows = found
        self._start_static(new)
        began = self._timed_event()
        prompt_logits, step = self._slots.mixed(key, seq.req.prompt_token_ids, seq.slot, self._pad_id)
        self._after_mixed(key, busy, rows, step, prompt_logits, new, began)
        return True

    def _after_mixed(self, key, busy: list[_Seq], rows: int, step, prompt_logits, prompted: list[_Seq],
                     began) -> None:
        """After a mixed pass (``key``) is queued: its rows' tokens in flight while the previous step's are
        read, and the first token of ``prompted`` (the sequence whose prompt the pass finished, if it did), which
        overwrites what the pass left in the (then free) slot's row: on the GPU with the rows' tokens, or, for
        sampling that needs the host, read at once, which waits for the pass."""
        # a prompt sampled on the GPU gets its first token with the rows': reading it now would make the host
        # wait for this pass, the GPU idle until the next launch, and hold the previous step's tokens back
        first = prompted[0] if prompted and prompted[0].fast_sampling else None
        launched = self._after_launch(busy, rows, *(t[:rows] for t in step), kind=("mixed", key), start=began,
                                      first=(first, prompt_logits) if first is not None else None)
        host_first = (lambda: self._first_tokens(prompted, prompt_logits)) if prompted and first is None else None
        self._hand_over(launched, then=host_first)

    def _prefill_static(self, new: list[_Seq]) -> None:
        self._start_static(new)
        start = self._timed_event()
        logits = self._slots.prefill([s.req.prompt_token_ids for s in new], [s.slot for s in new], self._pad_id)
        queued = self._timed_event()  # after the pass's last kernel: its own span, without the sampling's
        self._first_tokens(new, logits)
        self._waited_for(start)
        if queued is not None:  # complete: the host waited for a later event
            self._pass_times.add(pass_label(("prefill", None), len(new)), start.elapsed_time(queued))

    def _waited_for(self, start) -> None:
        """A pass the host has just waited for (its tokens read at once), started at ``start``: the GapMeter's
        too, so the time the host takes around it shows."""
        if start is None:
            return
        end = self._timed_event()
        end.synchronize()  # at once: the host read the pass's tokens already
        self._gaps.on_read(self._stats.forward_passes, start, end)

    def _first_tokens(self, new: list[_Seq], logits) -> None:
        import torch

        chosen = self._sample(logits, new).view(-1)
        slots = torch.tensor([s.slot for s in new], dtype=torch.long).to(self.device)
        self._slots.tokens.index_copy_(0, slots, chosen)
        self._slots.positions.index_copy_(0, slots, torch.tensor([s.pos for s in new]).to(self.device))
        self._slots.active.index_fill_(0, slots, 1)
        self._drop_finished()

    def _rows_and_span(self, busy: list[_Seq]) -> tuple[int, int]:
        return max(s.slot for s in busy) + 1, max(s.pos for s in busy) + 1

    def _launch_fast(self, busy: list[_Seq]) -> _InFlight:
        """Queue one decode step and its sampling on the GPU; the next step's inputs are
        written on the device, so nothing waits for the host."""
        rows, span = self._rows_and_span(busy)
        self._stats.forward_passes += 1
        start = self._timed_event()
        # greedy, inside the step
        return self._after_launch(busy, rows, *(t[:rows] for t in self._slots.decode(rows, span)),
                                  kind=("decode", self._slots.decode_key(rows, span)), start=start)

    def _hand_over(self, launched: _InFlight, then: Callable[[], None] | None = None) -> None:
        """The pass just launched becomes the one in flight once the previous one is read (its tokens handed
        out while this one runs); without CUDA it is read at once. ``then`` runs in between (a prompt's
        first token sampled on the host, which waits for the pass)."""
        self._read_inflight()
        # the GPU starts a pass when the one before it ends, or when it is launched onto an idle GPU
        free = self._gpu_free_s
        launched.started_s = max(launched.launched_s, free) if free is not None else launched.launched_s
        launched.started_exact = free is not None and free >= launched.launched_s
        self._inflight = launched
        if then is not None:
            then()
        if self._slots.device.type != "cuda":
            self._read_inflight()

    def _after_launch(self, busy: list[_Seq], rows: int, logits, chosen, lp, *, kind: tuple, start,
                      first: tuple | None = None) -> _InFlight:
        """Sampling other than greedy for the rows of a step just queued (a pass of ``kind``), ``first``'s
        first token (the sequence whose prompt the pass finished, and the prompt's logits) drawn on the GPU,
        and the copy of the tokens to the host; returns what _read_inflight reads once the step is done."""
        import torch

        hot = [s for s in busy if s.req.sampling.temperature > 0]
        if hot:
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            # pinned and non-blocking: a copy from pageable memory would make the host wait for the
            # step in flight, and sampled requests would lose the host/GPU overlap
            pin = self._slots.device.type == "cuda"
            temps = torch.ones(rows, dtype=torch.float32, pin_memory=pin)
            greedy = torch.ones(rows, dtype=torch.bool, pin_memory=pin)
            for s in hot:
                temps[s.slot] = s.req.sampling.temperature
                greedy[s.slot] = False
            temps = temps.to(self.device, non_blocking=True).unsqueeze(1)
            greedy = greedy.to(self.device, non_blocking=True).unsqueeze(1)
            chosen = torch.where(greedy, logits, _gumbel_perturbed(logits / temps)).argmax(dim=-1)
            lp = logits.gather(1, chosen.unsqueeze(1)).squeeze(1) - lse
            self._slots.tokens[:rows].copy_(chosen)
        for s in busy:
            s.pos += 1
        snapshot = [(s.slot, s) for s in busy]
        n = rows
        if first is not None:
            seq, prompt_logits = first
            first_tok, first_lp = self._first_token_on_device(seq, prompt_logits)
            # its row in the host buffers: after the step's rows (handed out before them: _flush's order)
            snapshot.append((rows, seq))
            n = rows + 1
        if self._slots.device.type == "cuda":
            host_tok, host_lp = self._host[self._host_turn]
            self._host_turn ^= 1
            # one per pass, timed: the GapMeter reads the last pass's end after the next pass is launched
            event = torch.cuda.Event(enable_timing=True)
            host_tok[:rows].copy_(chosen, non_blocking=True)
            host_lp[:rows].copy_(lp, non_blocking=True)
            if first is not None:
                host_tok[rows:n].copy_(first_tok, non_blocking=True)
                host_lp[rows:n].copy_(first_lp, non_blocking=True)
            event.record()
        else:
            host_tok, host_lp, event = chosen, lp, None
            if first is not None:
                host_tok, host_lp = torch.cat([chosen, first_tok]), torch.cat([lp, first_lp])
        return _InFlight(snapshot, host_tok, host_lp, event, n, kind, time.monotonic(),
                         index=self._stats.forward_passes, start_event=start)

    def _timed_event(self):
        """A timed event recorded now on the GPU's stream: before a pass's kernels, or after them (GapMeter,
        PassTimes); None without CUDA."""
        if self._slots.device.type != "cuda":
            return None
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _first_token_on_device(self, seq: _Seq, logits):
        """The first token of ``seq`` (greedy or plain temperature) from its prompt's last logits [1, V],
        drawn on the GPU and made its row's next input, as _first_tokens does on the host; returns (token [1],
        logprob [1]) on the device."""
        import torch

        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1)
        temperature = seq.req.sampling.temperature
        if temperature > 0:  # as for the decode rows
            chosen = _gumbel_perturbed(logits / temperature).argmax(dim=-1)
        else:
            chosen = logits.argmax(dim=-1)
        lp = logits.gather(1, chosen.unsqueeze(1)).squeeze(1) - lse
        # integer indexing and fill_ run on the device: an index tensor from pageable memory would wait
        self._slots.tokens[seq.slot: seq.slot + 1].copy_(chosen)
        self._slots.positions[seq.slot] = seq.pos
        self._slots.active[seq.slot] = 1
        return chosen, lp

    def _read_inflight(self) -> None:
        p = self._inflight
        if p is None:
            return
        self._inflight = None
        if p.event is not None:
            ended_before = p.event.query()
            p.event.synchronize()
            now = time.monotonic()
            # seen to end only if the host was waiting for it; otherwise it ended at some unknown time
            self._gpu_free_s = None if ended_before else now
            if not ended_before and p.started_exact:
                self._pass_timer.observe(p.kind, now - p.started_s)
            self._gaps.on_read(p.index, p.start_event, p.event)
            if p.start_event is not None:
                self._pass_times.add(pass_label(p.kind), p.start_event.elapsed_time(p.event))
        toks, lps = p.host_tok[:p.n].tolist(), p.host_lp[:p.n].tolist()
        for row, seq in p.snapshot:
            if not seq.finished:  # finished a step earlier, or aborted: its extra token is dropped
                self._on_token(seq, toks[row], lps[row], None)
        self._drop_finished()

    def _decode_static_sync(self, busy: list[_Seq]) -> None:
        """Sampling that needs the host (seeded, top_p, top_logprobs): one step, then wait."""
        import torch

        rows, span = self._rows_and_span(busy)
        start = self._timed_event()
        logits = self._slots.decode(rows, span)[0][:rows]  # the step moved the positions on already
        self._stats.forward_passes += 1
        slots = torch.tensor([s.slot for s in busy], dtype=torch.long).to(self.device)
        chosen = self._sample(logits.index_select(0, slots), busy).view(-1)
        self._slots.tokens.index_copy_(0, slots, chosen)
        for s in busy:
            s.pos += 1
        self._drop_finished()
        self._waited_for(start)

    def _release(self, seqs: list[_Seq]) -> None:
        import heapq

        freed = [s.slot for s in seqs if s.slot >= 0]
        if not freed:
            return
        # slot by slot, on the device: an index tensor copied from pageable memory makes the host wait for the
        # pass in flight, so a step that finishes a sequence would leave the GPU idle until the next launch
        # and hold the step's tokens (that sequence's end among them) back by a pass
        for slot in freed:
            self._slots.active[slot] = 0
            self._slots.positions[slot] = 0
        for s in seqs:
            if s.slot >= 0:
                heapq.heappush(self._free, s.slot)
                s.slot = -1

    def _prefill(self, new: list[_Seq]) -> None:
        import torch

        now = time.monotonic()
        for s in new:
            s.queue_time_s = now - s.submitted_s
        # running before the forward pass: if it fails, they fail with the batch
        # (and hear why) instead of being lost between the queue and the batch
        self._running.extend(new)
        logits = self._runner.prefill([s.req.prompt_token_ids for s in new])
        self._stats.forward_passes += 1
        self._stats.prefill_passes += 1
        self._stats.prompt_tokens += sum(len(s.req.prompt_token_ids) for s in new)
        chosen = self._sample(logits, new)
        self._next = chosen if self._next is None else torch.cat([self._next, chosen], dim=0)
        self._drop_finished()

    def _decode(self) -> None:
        logits = self._runner.decode(self._next)
        self._stats.forward_passes += 1
        self._next = self._sample(logits, self._running)
        self._drop_finished()

    def _sample(self, logits, seqs: list[_Seq]):
        import torch

        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logits.argmax(dim=-1)
        for i, seq in enumerate(seqs):
            sp = seq.req.sampling
            if sp.temperature > 0:
                row = logits[i] / sp.temperature
                probs = torch.softmax(row, dim=-1)
                if sp.top_p < 1.0:
                    sorted_p, order = probs.sort(descending=True)
                    # keep the smallest prefix whose mass reaches top_p (always >= 1 token)
                    drop = (sorted_p.cumsum(0) - sorted_p) >= sp.top_p
                    sorted_p[drop] = 0.0
                    probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
                gen = seq.generator if seq.generator is not None else self._rng
                chosen[i] = torch.multinomial(probs.cpu(), 1, generator=gen).to(chosen.device)[0]
        chosen_cpu = chosen.tolist()
        lps = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        want_top = max((s.req.sampling.top_logprobs for s in seqs), default=0)
        top_vals = top_ids = None
        if want_top > 0:
            top_vals, top_ids = logprobs.topk(want_top, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for i, seq in enumerate(seqs):
            if seq.finished:
                continue
            top = None
            k = seq.req.sampling.top_logprobs
            if k > 0:
                top = {int(t): float(v) for t, v in zip(top_ids[i][:k], top_vals[i][:k])}
            self._on_token(seq, chosen_cpu[i], lps[i], top)
        return chosen.unsqueeze(1)

    def _on_token(self, seq: _Seq, token: int, logprob: float, top: dict | None) -> None:
        sp = seq.req.sampling
        seq.n_generated += 1
        self._stats.generated_tokens += 1
        seq.pend_ids.append(token)
        seq.pend_lps.append(logprob)
        if top is not None:
            seq.pend_top.append(top)
        is_eos = token in self._eos_ids and not sp.ignore_eos
        text, stopped = ("", False) if is_eos else seq.stops.push(seq.detok.push(token))
        finish = None
        if stopped or is_eos:
            finish = "stop"
        elif seq.n_generated >= sp.max_tokens:
            finish = "length"
        if finish is not None and not stopped:
            text += seq.stops.flush()
        # every token goes out, text or not (a held-back or partial character still
        # counts for TTFT and logprobs); the replica coalesces chunks under load
        self._emit(seq, text, finish)
        if finish is not None:
            seq.finished = True
            self._by_id.pop(seq.req.request_id, None)

    def _emit(self, seq: _Seq, text: str, finish: str | None) -> None:
        self._outbox.append((seq,
            EngineChunk(
                request_id=seq.req.request_id,
                token_ids=seq.pend_ids,
                text=text,
                logprobs=seq.pend_lps,
                top_logprobs=seq.pend_top if seq.req.sampling.top_logprobs > 0 else None,
                finish_reason=finish,
                num_prompt_tokens=len(seq.req.prompt_token_ids),
                num_generated_tokens=seq.n_generated,
                queue_time_s=seq.queue_time_s,
            )
        ))
        seq.queue_time_s = None  # reported once
        seq.pend_ids, seq.pend_lps, seq.pend_top = [], [], []

    def _finish(self, seq: _Seq, reason: str) -> None:
        self._emit(seq, "", reason)
        seq.finished = True
        self._by_id.pop(seq.req.request_id, None)

    def _drop_finished(self) -> None:
        if not any(s.finished for s in self._running):
            return
        if self._slots is not None:
            self._release([s for s in self._running if s.finished])
            self._running = [s for s in self._running if not s.finished]
            return
        keep = [i for i, s in enumerate(self._running) if not s.finished]
        self._running = [self._running[i] for i in keep]
        self._runner.keep(keep)
        self._next = self._next[keep] if keep else None

    def _fail_running(self, err: BaseException) -> None:
        for seq in self._running:
            if not seq.finished:
                seq.finished = True
                self._by_id.pop(seq.req.request_id, None)
                self._outbox.append((seq, err))
        if self._slots is not None:
            self._inflight = None
            self._chunked = None
            self._release(self._running)
        self._running = []
        self._next = None
        if self._runner is not None:
            self._runner.clear()

    def _fail_all(self, err: BaseException) -> None:
        self._fail_running(err)
        with self._cv:
            pending = list(self._waiting) + list(self._inbox)
            self._waiting.clear()
            self._inbox.clear()
        for seq in pending:
            seq.finished = True
            self._outbox.append((seq, err))
