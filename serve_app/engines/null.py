"""The ``null`` backend: no model at all.

It emits ``num_tokens`` copies of ``token_text`` per request at ``tokens_per_s``
and tokenizes by UTF-8 bytes. It exists to measure the serving path alone
(HTTP, Ray Serve, routing, streaming) and to drive autoscaling and overload
tests without model cost. Its answers mean nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from serve_app.errors import ContextLengthExceededError, EngineNotReadyError, OverloadedError

from .base import Engine, EngineChunk, EngineStats, GenerationRequest
from .options import NullEngineOptions

_TOKEN_ID = 42


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
