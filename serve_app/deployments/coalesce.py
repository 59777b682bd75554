"""Coalesce a stream: whatever the producer made while the consumer was busy
goes out as one item.

Every item a Serve replica yields costs a Ray message (about a millisecond of
CPU on a small box). Under load the engine produces tokens faster than the
replica can ship them one by one, so shipping what has accumulated keeps the
number of messages bounded by the consumer's pace, not the token rate. At low
load nothing accumulates and every token goes out on its own (no added latency).

``min_interval_s`` also paces the stream (vLLM's ``stream_interval``, Ray Serve
LLM's stream batching): items go out at once until one the client can see has
gone out (``visible``: a token that completes no character, or a stop-string
prefix held back, has no text), later ones at most once per interval, merged.
Pacing from a textless first token would hold the first visible text back by
a whole interval (the test shows it with a 0.5 s interval). Nor does the end
wait: when the source ends during a pacing wait, what it made goes out at
once, so the last token and the finish are not held up to an interval (a
closed-loop client would send its next request that much later, jittered).
On a GPU each of 64 streams makes ~100 tokens/s; one message per token through replica ->
ingress -> proxy costs more CPU than the serving processes have (measured:
the stack delivered 43 % of the engine's tokens at 64 streams without it;
docs/benchmarks.md).

Two ways in, one pacing: :func:`coalesced` over any async iterator (a task
pumps it), and :func:`pushed` over an engine's ``submit``, which puts each
chunk straight into the stream's buffer. The pump task wakes once per engine
step for every stream (64 wake-ups a step at 64 streams, each through the
engine's generator), while a paced consumer wakes only to send; pushed, a
step costs each stream a list append (benchmarks/burst_path.py).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from serve_app.engines.base import ends_stream, merge_chunks

T = TypeVar("T")
_DONE = object()


class _Pacer:
    """One stream's items between its producer and its consumer: a buffer, how the stream ended (``_DONE``
    or an exception), and the consumer's wait. Pushed from the consumer's event loop's thread."""

    __slots__ = ("items", "end", "is_last", "closed", "_waiter", "_any_item_wakes")

    def __init__(self, is_last: Callable[[object], bool]):
        self.items: list = []
        self.end: object = None
        self.is_last = is_last
        self.closed = False  # the consumer left: what still comes (an abort's last chunk) is dropped
        self._waiter: asyncio.Future | None = None
        self._any_item_wakes = True

    def put_nowait(self, item) -> None:
        if self.closed or self.end is not None:
            return
        if isinstance(item, BaseException):
            self.end = item
        else:
            self.items.append(item)
            if self.is_last(item):
                self.end = _DONE
        self._wake()

    def finish(self) -> None:
        if self.end is None:
            self.end = _DONE
            self._wake()

    def _wake(self) -> None:
        # during a pacing wait only the end wakes the consumer: the rest joins the next message
        w = self._waiter
        if w is not None and not w.done() and (self._any_item_wakes or self.end is not None):
            w.set_result(None)

    async def wait(self, any_item: bool, timeout_s: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._any_item_wakes = any_item
        self._waiter = fut = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, _set_done, fut)
        try:
            await fut
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _paced(pacer: _Pacer, merge: Callable[[list[T]], T], min_interval_s: float,
                 visible: Callable[[T], bool], start: Callable[[], None],
                 on_close: Callable[[], Awaitable[None]]) -> AsyncIterator[T]:
    start()  # at the first __anext__, as a generator's first step; what it raises ends the stream
    loop = asyncio.get_running_loop()
    last_out = float("-inf")
    try:
        while True:
            if not pacer.items and pacer.end is None:
                await pacer.wait(any_item=True)
            wait_s = last_out + min_interval_s - loop.time()
            if wait_s > 0 and pacer.end is None:
                # let more tokens join this message, until the interval is up or the source ends
                await pacer.wait(any_item=False, timeout_s=wait_s)
            items, pacer.items = pacer.items, []
            if items:
                merged = merge(items)
                yield merged
                # once something visible went out, everything is paced (a textless token too: under
                # load they are common, and unpaced they would multiply the messages again)
                if last_out > float("-inf") or visible(merged):
                    last_out = loop.time()
            if pacer.end is not None and not pacer.items:
                if isinstance(pacer.end, BaseException):
                    raise pacer.end
                return
    finally:
        pacer.closed = True
        await on_close()


def coalesced(source: AsyncIterator[T], merge: Callable[[list[T]], T], min_interval_s: float = 0.0,
              visible: Callable[[T], bool] = lambda item: True) -> AsyncIterator[T]:
    """``source`` paced; closing the result (finished, cancelled, disconnected) cancels the task reading
    ``source``, whose own cleanup aborts the generation."""
    pacer = _Pacer(lambda item: False)

    async def pump() -> None:
        try:
            async for item in source:
                pacer.put_nowait(item)
            pacer.finish()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # delivered to the consumer, after what came before it
            pacer.put_nowait(e)

    task: asyncio.Task | None = None

    def start_pump() -> None:  # at the stream's first read: a stream never read reads nothing
        nonlocal task
        task = asyncio.get_running_loop().create_task(pump())

    async def stop_pump() -> None:  # only after start_pump: _paced's cleanup runs once it has started
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    return _paced(pacer, merge, min_interval_s, visible, start_pump, stop_pump)


def pushed(engine, request, merge: Callable[[list[T]], T], min_interval_s: float = 0.0,
           visible: Callable[[T], bool] = lambda item: True) -> AsyncIterator[T]:
    """A request's chunks from ``engine.submit`` (a backend with ``supports_submit``), paced as
    :func:`coalesced` paces them; an admission error raises from the first ``__anext__``, as from
    ``generate``. Closing it before the last chunk aborts the request."""
    pacer = _Pacer(ends_stream)

    async def abort_unless_ended() -> None:
        if pacer.end is None:
            await engine.abort(request.request_id)

    return _paced(pacer, merge, min_interval_s, visible, lambda: engine.submit(request, pacer), abort_unless_ended)


def _has_text(chunk) -> bool:
    return bool(chunk.text)


def engine_chunks(engine, request, min_interval_s: float = 0.0, push: bool | None = None) -> AsyncIterator:
    """A request's engine chunks paced for its stream, merged while the consumer waits; pacing starts at the
    first chunk with text. Through ``submit`` where the engine has it (``push`` None), else its generator;
    ``push`` forces one way (benchmarks/burst_path.py compares them)."""
    if engine.supports_submit if push is None else push:
        return pushed(engine, request, merge_chunks, min_interval_s, _has_text)
    return coalesced(engine.generate(request), merge_chunks, min_interval_s, _has_text)
