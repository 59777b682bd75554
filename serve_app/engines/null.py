"""The ``null`` backend: no model at all.

It emits ``num_tokens`` copies of ``token_text`` per request at ``tokens_per_s``
and tokenizes by UTF-8 bytes. It exists to measure the serving path alone
(HTTP, Ray Serve, routing, streaming) and to drive autoscaling and overload
tests without model cost. Its answers mean nothing.

With ``step_ms`` it keeps a batched engine's time instead: one step gives every
running request a token and hands the step's tokens out together, so the path
meets the bursts a GPU engine's passes make (64 chunks at once at 64 streams),
which per-request timers spread out.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import AsyncIterator

from serve_app.errors import ContextLengthExceededError, EngineNotReadyError, OverloadedError

from .base import Engine, EngineChunk, EngineStats, GenerationRequest, ends_stream, handout_order
from .options import NullEngineOptions

_TOKEN_ID = 42


class _Row:
    """A request in the stepped mode (step_ms)."""

    __slots__ = ("request", "queue", "n", "n_gen", "arrived_s", "queue_time_s", "gone")

    def __init__(self, request: GenerationRequest, n: int):
        self.request, self.n, self.n_gen = request, n, 0
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrived_s = time.monotonic()
        self.queue_time_s = 0.0
        self.gone = False  # its consumer left: dropped at the next step


class NullEngine(Engine):
    name = "null"
    options_model = NullEngineOptions
    # with tensor_parallel_size > 1 the LLMServer places idle rank workers for
    # it, so placement can be exercised without a model
    max_tensor_parallel_size = 64

    def __init__(self, options: NullEngineOptions, parallel=None):
        super().__init__(options, parallel)
        self.options: NullEngineOptions = options
        self._ready = False
        self._slots: asyncio.Semaphore | None = None
        self._waiting = 0
        self._running = 0
        self._aborted: set[str] = set()
        self._stats = EngineStats()
        self.load_time_s = 0.0
        # step_ms: requests not yet admitted, the running rows (in admission order), the loop that steps them
        self._pending: collections.deque[_Row] = collections.deque()
        self._rows: list[_Row] = []
        self._picked: list[_Row] = []  # taken for the next step
        self._wake = asyncio.Event()
        self._stepper: asyncio.Task | None = None

    @classmethod
    def frontend(cls, options: NullEngineOptions) -> "NullEngine":
        return cls(options)  # its tokenizing needs nothing started

    async def start(self) -> None:
        self._slots = asyncio.Semaphore(self.options.max_num_seqs)
        self._ready = True

    @property
    def max_model_len(self) -> int:
        return self.options.max_model_len

    def encode_chat(self, messages):
        text = "".join(f"{m.get('role', '')}: {m.get('content', '')}\n" for m in messages)
        return self.encode_text(text)

    def encode_text(self, prompt: str):
        return list(prompt.encode("utf-8"))

    def token_text(self, token_id: int) -> str:
        return self.options.token_text

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineChunk]:
        if not self._ready:
            raise EngineNotReadyError("engine is not ready")
        n_prompt = len(request.prompt_token_ids)
        sp = request.sampling
        if n_prompt + sp.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n_prompt + sp.max_tokens} tokens.",
                param="messages",
            )
        if self.options.step_ms > 0:
            if (len(self._rows) >= self.options.max_num_seqs
                    and len(self._pending) >= self.options.max_waiting_requests):
                raise OverloadedError(
                    f"the engine's waiting queue is full ({self.options.max_waiting_requests} requests)")
            async for chunk in self._stepped(request, min(self.options.num_tokens, sp.max_tokens)):
                yield chunk
            return
        if self._slots.locked() and self._waiting >= self.options.max_waiting_requests:
            raise OverloadedError(
                f"the engine's waiting queue is full ({self.options.max_waiting_requests} requests)"
            )
        n = min(self.options.num_tokens, sp.max_tokens)
        delay = 1.0 / self.options.tokens_per_s if self.options.tokens_per_s > 0 else 0.0
        self._waiting += 1
        t0 = time.monotonic()
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        queue_time_s = time.monotonic() - t0
        self._running += 1
        self._stats.prompt_tokens += n_prompt
        done = False
        try:
            for i in range(1, n + 1):
                if delay:
                    await asyncio.sleep(delay)
                if request.request_id in self._aborted:
                    self._aborted.discard(request.request_id)
                    done = True
                    self._stats.aborted_requests += 1
                    yield self._chunk(request, [], "", "abort", i - 1)
                    return
                self._stats.generated_tokens += 1
                self._stats.forward_passes += 1
                finish = "length" if i == n else None
                done = finish is not None
                chunk = self._chunk(request, [_TOKEN_ID], self.options.token_text, finish, i)
                if i == 1:
                    chunk.queue_time_s = queue_time_s
                yield chunk
        finally:
            if not done:
                self._stats.aborted_requests += 1
            self._running -= 1
            self._slots.release()

    async def _stepped(self, request: GenerationRequest, n: int) -> AsyncIterator[EngineChunk]:
        row = _Row(request, n)
        self._pending.append(row)
        self._waiting += 1
        self._stats.prompt_tokens += len(request.prompt_token_ids)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._step_loop())
        self._wake.set()
        done = False
        try:
            while True:
                item = await row.queue.get()
                done = ends_stream(item)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if done:
                    return
        finally:
            if not done:
                row.gone = True

    async def _step_loop(self) -> None:
        """Steps while anything runs or waits: a step gives every running row a token after step_ms (its pass)
        and the next one starts at once, as a GPU engine's next pass does. Its new requests are picked
        launch_lead_ms before the step in flight ends (at its end with no lead), as hf picks a pass's prompts:
        a request that arrives after that waits a step more; onto an idle engine they are picked at once."""
        loop = asyncio.get_running_loop()
        try:
            while self._ready:
                if not self._rows and not self._pending and not self._picked:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                started = loop.time()
                if not self._rows:  # an idle engine launches at once
                    self._picked += self._pick(started, 0)
                admitted, self._picked = self._picked, []
                running = self._rows
                self._rows = running + admitted
                self._running = len(self._rows)
                end = started + self.options.step_ms / 1000
                lead_s = self.options.launch_lead_ms / 1000
                if lead_s > 0:
                    await asyncio.sleep(max(0.0, end - lead_s - loop.time()))
                    ending = sum(1 for r in self._rows if r.n_gen + 1 >= r.n or r.gone)
                    self._picked = self._pick(loop.time(), len(self._rows) - ending)
                await asyncio.sleep(max(0.0, end - loop.time()))
                made = [(row, c) for row in admitted + running if (c := self._step_chunk(row)) is not None]
                for row, chunk in handout_order(made, self.options.first_tokens_first, self.options.finishing_first):
                    row.queue.put_nowait(chunk)
                self._rows = [r for r in self._rows if r.n_gen < r.n and not r.gone]
                self._running = len(self._rows)
                self._stats.forward_passes += 1
                if lead_s <= 0:
                    self._picked = self._pick(loop.time(), len(self._rows))
        finally:
            # shut down (or the loop ended): nobody steps them any more
            err = EngineNotReadyError("engine is shutting down")
            for row in (*self._rows, *self._picked, *self._pending):
                row.queue.put_nowait(err)
            self._rows, self._picked, self._running = [], [], 0
            self._waiting -= len(self._pending)
            self._pending.clear()

    def _pick(self, now: float, running: int) -> list[_Row]:
        """The waiting requests the next step takes, up to max_num_seqs with ``running`` rows staying."""
        picked = []
        while self._pending and running + len(picked) < self.options.max_num_seqs:
            row = self._pending.popleft()
            self._waiting -= 1
            if row.gone:
                self._stats.aborted_requests += 1
                continue
            row.queue_time_s = now - row.arrived_s
            picked.append(row)
        return picked

    def _step_chunk(self, row: _Row) -> EngineChunk | None:
        """What a step makes for ``row``: its next token, its abort, or nothing (its consumer left)."""
        rid = row.request.request_id
        if row.gone:
            self._stats.aborted_requests += 1
            return None
        if rid in self._aborted:
            self._aborted.discard(rid)
            row.gone = True  # its abort chunk ends it
            self._stats.aborted_requests += 1
            return self._chunk(row.request, [], "", "abort", row.n_gen)
        row.n_gen += 1
        self._stats.generated_tokens += 1
        chunk = self._chunk(row.request, [_TOKEN_ID], self.options.token_text,
                            "length" if row.n_gen == row.n else None, row.n_gen)
        if row.n_gen == 1:
            chunk.queue_time_s = row.queue_time_s
        return chunk

    @staticmethod
    def _chunk(request, ids, text, finish, n_gen) -> EngineChunk:
        return EngineChunk(
            request_id=request.request_id,
            token_ids=ids,
            text=text,
            logprobs=[0.0] * len(ids),
            top_logprobs=[{_TOKEN_ID: 0.0}] * len(ids) if request.sampling.top_logprobs else None,
            finish_reason=finish,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=n_gen,
        )

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=self._waiting,
            num_running=self._running,
            kv_cache_usage=0.0,
            forward_passes=self._stats.forward_passes,
            prompt_tokens=self._stats.prompt_tokens,
            generated_tokens=self._stats.generated_tokens,
            aborted_requests=self._stats.aborted_requests,
            healthy=self._ready,
        )

    async def check_health(self) -> None:
        if not self._ready:
            raise EngineNotReadyError("engine is not started")

    async def shutdown(self) -> None:
        self._ready = False
        if self._stepper is not None and not self._stepper.done():
            self._stepper.cancel()
            await asyncio.gather(self._stepper, return_exceptions=True)
