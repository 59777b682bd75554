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
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, TypeVar

T = TypeVar("T")
_DONE = object()


async def coalesced(source: AsyncIterator[T], merge: Callable[[list[T]], T],
                    min_interval_s: float = 0.0,
                    visible: Callable[[T], bool] = lambda item: True) -> AsyncIterator[T]:
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    last_out = float("-inf")
    ended = False
    wake: asyncio.Future | None = None  # the consumer's pacing wait, which the source's end cuts short

    def source_ended(last) -> None:
        nonlocal ended
        queue.put_nowait(last)
        ended = True
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def pump():
        try:
            async for item in source:
                queue.put_nowait(item)
            source_ended(_DONE)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # delivered to the consumer, in order
            source_ended(e)

    task = loop.create_task(pump())
    try:
        while True:
            batch = [await queue.get()]
            wait_s = last_out + min_interval_s - loop.time()
            if wait_s > 0 and not ended and batch[0] is not _DONE and not isinstance(batch[0], BaseException):
                # let more tokens join this message, until the interval is up or the source ends
                wake = loop.create_future()
                timer = loop.call_later(wait_s, lambda f=wake: f.done() or f.set_result(None))
                try:
                    await wake
                finally:
                    timer.cancel()
                    wake = None
            while not queue.empty():
                batch.append(queue.get_nowait())
            end = next((i for i, x in enumerate(batch) if x is _DONE or isinstance(x, BaseException)), None)
            items = batch if end is None else batch[:end]
            if items:
                merged = merge(items)
                yield merged
                # once something visible went out, everything is paced (a textless token too: under
                # load they are common, and unpaced they would multiply the messages again)
                if last_out > float("-inf") or visible(merged):
                    last_out = loop.time()
            if end is not None:
                if isinstance(batch[end], BaseException):
                    raise batch[end]
                return
    finally:
        # consumer gone (finished, cancelled, disconnected): stop the producer,
        # whose own cleanup aborts the generation
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
