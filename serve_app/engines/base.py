"""The engine contract every backend implements.

Streaming chunks
    ``generate(request)`` is an async iterator of :class:`EngineChunk`. Each chunk
    carries the token ids sampled since the previous chunk, the text those tokens
    released (always whole UTF-8 characters; text that might still turn into a
    stop string is held back), and one logprob per token id. Exactly one chunk
    has ``finish_reason`` set, and it is the last: ``"stop"`` (EOS or a stop
    string), ``"length"`` (``max_tokens`` reached) or ``"abort"`` (aborted by
    :meth:`Engine.abort` or because the consumer went away). ``num_generated_tokens``
    is cumulative, so the final chunk carries the usage.

Errors
    Admission errors are raised by the first ``__anext__`` before any chunk:
    :class:`~serve_app.errors.OverloadedError` (waiting queue full),
    :class:`~serve_app.errors.EngineNotReadyError` (not started / stopped),
    :class:`~serve_app.errors.ContextLengthExceededError` (prompt plus
    ``max_tokens`` exceeds ``max_model_len``). A failure while generating is raised
    as :class:`~serve_app.errors.EngineError` from the iterator; other requests
    in the batch keep going where the backend can isolate the fault.

Stats
    :meth:`Engine.stats` is cheap and thread-safe: requests waiting (admitted to
    the engine's queue, not yet scheduled), running (in the batch), KV-cache usage
    as a fraction of the configured budget, and monotone counters (forward passes,
    prompt and generated tokens, aborted requests).

Closing the iterator early (``aclose()``, task cancellation, a client that
disconnects) aborts the request: the engine frees its slot and cache.

Pushed chunks (optional, ``supports_submit``)
    ``submit(request, sink)`` delivers the same chunks, in the same order, by
    ``sink.put_nowait(chunk)`` on the caller's event loop; a failure while
    generating arrives as the exception instead of the last chunk. Admission
    errors raise from ``submit`` itself. There is no iterator to close, so
    only :meth:`Engine.abort` stops the request. The engine process's relay
    uses it to forward a whole engine step as one message, and the replica
    (:func:`serve_app.deployments.coalesce.pushed`) to buffer each stream's
    chunks without a task that wakes for every one.
"""

from __future__ import annotations

import abc
import operator
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, ClassVar, Protocol

from pydantic import BaseModel

from serve_app.errors import InvalidRequestError

from .options import live_options


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int = 0
    # Benchmarks want fixed output lengths: generate exactly max_tokens.
    ignore_eos: bool = False


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # LoRA adapter name, for backends that serve adapters (trtllm)
    adapter: str | None = None


@dataclass
class EngineChunk:
    request_id: str
    token_ids: list[int]
    text: str
    # logprob of each sampled token under the model's unmodified distribution
    # (before temperature / top_p), one per entry of token_ids.
    logprobs: list[float]
    # when top_logprobs > 0: one {token_id: logprob} dict per entry of token_ids
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    # on the first chunk, where the backend knows it: seconds spent waiting to be scheduled
    queue_time_s: float | None = None

    def __reduce__(self):
        # pickled as its fields in order: the engine process sends a step's chunks as one message, which the
        # replica loads every engine step. 64 one-token chunks load in 34 us this way, 65 by a dataclass's
        # default pickle (the object, then a dict of its fields) on the CPU box (benchmarks/chunk_pickle.py)
        return (EngineChunk, _chunk_fields(self))


_chunk_fields = operator.attrgetter(*(f.name for f in fields(EngineChunk)))


def merge_chunks(chunks: list[EngineChunk]) -> EngineChunk:
    """Consecutive chunks of one request as one (what a consumer that fell behind takes at once)."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return EngineChunk(
        request_id=last.request_id,
        token_ids=[t for c in chunks for t in c.token_ids],
        text="".join(c.text for c in chunks),
        logprobs=[x for c in chunks for x in c.logprobs],
        top_logprobs=(None if any(c.top_logprobs is None for c in chunks)
                      else [d for c in chunks for d in c.top_logprobs]),
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_generated_tokens=last.num_generated_tokens,
        queue_time_s=next((c.queue_time_s for c in chunks if c.queue_time_s is not None), None),
    )


def ends_stream(item) -> bool:
    """Whether ``item`` (a chunk, or the exception a failed request ends with) is its request's last: the chunk
    with a ``finish_reason`` or the exception. A pushed request's consumer and the engine process's relay stop
    routing its items there; a step's hand-out ranks its stream as ending."""
    return isinstance(item, BaseException) or item.finish_reason is not None


def handout_order(outbox: list, first_tokens_first: bool = True, finishing_first: bool = True) -> list:
    """One step's ``(stream, chunk or exception)`` pairs in the order a backend hands them out: the streams that
    start (their first chunk) first, then those that end (a finish or an error), then the rest; a stream's own
    chunks keep their order. Every hop out to the client (the engine process's relay, the replica's dispatch
    to its streams, their SSE writes, the client) takes them in this order: a first token behind 63 rows
    waits for all of their work at each hop, and so does a last token, which a closed-loop client waits for
    before it sends its next request (in time for the next pass or not: benchmarks/burst_path.py). hf uses
    the defaults; the null engine's options turn either part off (starting streams then go last), to measure
    what it is worth."""

    def rank(item) -> int:
        if ends_stream(item):
            return 1 if finishing_first else 2
        if item.num_generated_tokens == len(item.token_ids):
            return 0 if first_tokens_first else 3
        return 2

    ranks: dict[int, int] = {}
    for stream, item in outbox:
        ranks[id(stream)] = min(ranks.get(id(stream), 3), rank(item))
    return sorted(outbox, key=lambda x: ranks[id(x[0])])  # stable: a stream's chunks keep their order


@dataclass
class EngineStats:
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    forward_passes: int = 0
    prefill_passes: int = 0  # of forward_passes, those that prefilled prompts
    prefill_graph_passes: int = 0  # of prefill_passes, one-prompt passes replayed from a captured CUDA graph
    prefill_eager_passes: int = 0  # of prefill_passes, shapes the compiled prefill did not cover, run eagerly
    mixed_passes: int = 0  # of prefill_passes, one prompt prefilled in the same captured pass as a decode step
    prompt_tokens: int = 0
    generated_tokens: int = 0
    aborted_requests: int = 0
    # the GPU's time between consecutive passes while there was work (hf static cache on CUDA; launch_timing.GapMeter)
    gpu_gaps_measured: int = 0
    gpu_gap_total_ms: float = 0.0
    gpu_gaps_late: int = 0  # of gpu_gaps_measured, over 0.1 ms: the pass launched after the GPU ran dry
    # the GPU time of the passes by kind, label -> [passes, total ms] (hf static cache on CUDA; launch_timing.PassTimes)
    gpu_pass_ms: dict[str, list[float]] = field(default_factory=dict)
    healthy: bool = True

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ParallelConfig:
    """How the replica's engine spans GPUs. ``bundle_indices`` are this replica's
    placement-group bundles, one per rank; ``env`` (NCCL) goes to every rank."""

    tensor_parallel_size: int = 1
    bundle_indices: list[int] = field(default_factory=lambda: [0])
    env: dict[str, str] = field(default_factory=dict)
    #: Ray actor handles of the rank workers the replica started, one per bundle
    #: (empty for backends that place their own workers)
    rank_workers: list = field(default_factory=list)


class Tokenization(Protocol):
    """What a replica needs of a backend to turn requests into token ids (and ids into text for
    logprob listings) without the model: see :meth:`Engine.frontend`."""

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def encode_text(self, prompt: str) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...


class Engine(abc.ABC):
    """A model backend, registered by name in :mod:`serve_app.engines.registry`."""

    name: ClassVar[str]
    #: pydantic model of this backend's ``engine.options``
    options_model: ClassVar[type[BaseModel]]
    #: largest tensor_parallel_size the backend can run
    max_tensor_parallel_size: ClassVar[int] = 1
    #: the backend places its own rank workers in the replica's placement group
    places_own_workers: ClassVar[bool] = False
    #: the backend implements :meth:`submit` (chunks pushed to a sink, no generator per request)
    supports_submit: ClassVar[bool] = False

    def __init__(self, options: BaseModel, parallel: ParallelConfig | None = None):
        self.options = options
        self.parallel = parallel or ParallelConfig()

    @classmethod
    def frontend(cls, options: BaseModel) -> Tokenization:
        """Tokenization alone, loaded without the model: the replica's side when the engine runs in
        a process of its own (``engine.process: separate``). Backends that cannot split raise."""
        raise NotImplementedError(f"the {cls.name!r} backend cannot run its engine in a separate process")

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights and warm up; returns when the engine can serve."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Prompt plus generated tokens one sequence may hold."""

    @abc.abstractmethod
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Apply the model's chat template and tokenize."""

    @abc.abstractmethod
    def encode_text(self, prompt: str) -> list[int]:
        """Tokenize a raw completion prompt."""

    @abc.abstractmethod
    def token_text(self, token_id: int) -> str:
        """Readable text of one token (for logprob listings)."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineChunk]:
        """Stream chunks for one request (see the module docstring)."""

    def submit(self, request: GenerationRequest, sink) -> None:
        """What :meth:`generate` streams, pushed instead: ``sink.put_nowait(item)`` on the calling event loop's
        thread for every chunk, then once for the finish (a chunk with ``finish_reason``) or an exception
        instead. Errors found before the request is queued raise here. Nothing aborts the request but
        :meth:`abort`. For a relay that forwards every chunk anyway (the engine's own process): a generator per
        request costs it a task wake-up per chunk. Backends with ``supports_submit`` implement it."""
        raise NotImplementedError(f"the {self.name!r} backend streams through generate() only")

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with ``finish_reason="abort"``."""

    def update_options(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Changes options on the live engine, validated with the rest first. Only options the backend reads
        while it runs may change (those its options model marks LIVE, e.g. hf's ``launch_lead_ms``,
        ``mixed_one_prompt_per_pass``). A change to one read at start (graphs, cache sizes, kernels), an
        unknown key or a bad value raises :class:`~serve_app.errors.InvalidRequestError` and changes
        nothing. Returns the values as set. For a benchmark's compare on one live deployment."""
        try:
            checked = type(self.options).model_validate({**self.options.model_dump(), **changes})
        except ValueError as e:
            raise InvalidRequestError(f"bad engine options {changes}: {e}") from e
        live = live_options(type(self.options))
        fixed = sorted(set(changes) - live)
        if fixed:
            raise InvalidRequestError(
                f"engine options {fixed} are read when the {self.name!r} engine starts, so a running one cannot "
                f"change them: start one with them instead; options it reads while running: {sorted(live)}")
        for key in changes:
            setattr(self.options, key, getattr(checked, key))
        return {key: getattr(checked, key) for key in changes}

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        ...

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Raise :class:`~serve_app.errors.EngineNotReadyError` if the engine cannot serve."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        ...
