"""The replica's stream coalescing and pacing (pure asyncio, no Ray)."""

import asyncio
import time

import pytest

from serve_app.deployments.coalesce import coalesced


async def _ticks(n: int, every_s: float, fail_at: int | None = None):
    for i in range(n):
        await asyncio.sleep(every_s)
        if i == fail_at:
            raise RuntimeError("engine failed")
        yield [i]


def _merge(items):
    return [x for it in items for x in it]


async def _collect(gen):
    out = []
    async for item in gen:
        out.append((time.monotonic(), item))
    return out


def test_pacing_sends_the_first_token_at_once_then_merges_per_interval():
    async def main():
        t0 = time.monotonic()
        out = await _collect(coalesced(_ticks(40, 0.005), _merge, min_interval_s=0.05))
        return t0, out

    t0, out = asyncio.run(main())
    items = [x for _, batch in out for x in batch]
    assert items == list(range(40))  # nothing lost, order kept
    assert out[0][1] == [0] and out[0][0] - t0 < 0.04  # first token not held back
    assert len(out) <= 8, [b for _, b in out]  # 40 tokens over ~0.2 s at most every 50 ms
    # paced sends at least an interval apart; the last goes out when the source ends, which may come sooner
    # (test_the_end_of_the_stream_is_not_held_to_the_interval)
    gaps = [b - a for (a, _), (b, _) in zip(out[1:-1], out[2:-1])]
    assert all(g >= 0.045 for g in gaps), gaps


def test_pacing_starts_at_the_first_visible_item_not_at_a_textless_first_token():
    """A first token that completes no character has no text: the client sees nothing, so the
    first token with text must not wait out an interval behind it."""
    async def source():
        for text in ["", "", "Hel", "lo", " wor", "ld"]:
            await asyncio.sleep(0.005)
            yield [text]

    async def main():
        t0 = time.monotonic()
        out = await _collect(coalesced(source(), _merge, min_interval_s=0.5, visible=lambda b: any(b)))
        return t0, out

    t0, out = asyncio.run(main())
    first_text_at = next(t for t, batch in out if any(batch))
    assert first_text_at - t0 < 0.2, [(round(t - t0, 3), b) for t, b in out]
    assert "".join(x for _, b in out for x in b) == "Hello world"
    assert len(out) <= 4  # after "Hel" the rest is paced and merged


def test_the_end_of_the_stream_is_not_held_to_the_interval():
    """The last tokens and the finish go out when the source ends, not when the pacing interval is up:
    a closed-loop client would otherwise send its next request up to an interval later."""
    async def source():
        for i in range(4):
            yield [i]
            await asyncio.sleep(0.005)

    async def main():
        t0 = time.monotonic()
        out = await _collect(coalesced(source(), _merge, min_interval_s=0.5))
        return t0, out

    t0, out = asyncio.run(main())
    assert [x for _, b in out for x in b] == [0, 1, 2, 3]
    assert out[-1][0] - t0 < 0.2, [(round(t - t0, 3), b) for t, b in out]
    assert len(out) == 2  # the first token alone, the rest merged: still paced while the source ran


def test_textless_items_after_the_first_text_are_still_paced():
    async def source():
        for i in range(40):
            await asyncio.sleep(0.005)
            yield ["x" if i == 0 else ("" if i % 2 else "y")]

    out = asyncio.run(_collect(coalesced(source(), _merge, min_interval_s=0.05, visible=lambda b: any(b))))
    assert len(out) <= 8, [b for _, b in out]
    assert sum(len(b) for _, b in out) == 40


def test_without_pacing_every_token_goes_out_when_the_consumer_keeps_up():
    out = asyncio.run(_collect(coalesced(_ticks(10, 0.005), _merge)))
    assert [b for _, b in out] == [[i] for i in range(10)]


def test_an_error_arrives_after_the_items_before_it():
    async def main():
        got = []
        with pytest.raises(RuntimeError, match="engine failed"):
            async for batch in coalesced(_ticks(10, 0.002, fail_at=5), _merge, min_interval_s=0.01):
                got.extend(batch)
        return got

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_merged_engine_chunks_keep_every_token_and_the_first_queue_time():
    from serve_app.engines.base import EngineChunk, merge_chunks

    def chunk(i, finish=None, queue=None):
        return EngineChunk(request_id="r", token_ids=[i], text=f"t{i}", logprobs=[-0.1 * i],
                           top_logprobs=[{i: -0.1 * i}], finish_reason=finish, num_prompt_tokens=5,
                           num_generated_tokens=i + 1, queue_time_s=queue)

    m = merge_chunks([chunk(0, queue=0.25), chunk(1), chunk(2, finish="length")])
    assert m.token_ids == [0, 1, 2] and m.text == "t0t1t2" and m.logprobs == [0.0, -0.1, -0.2]
    assert m.top_logprobs == [{0: 0.0}, {1: -0.1}, {2: -0.2}]
    assert (m.finish_reason, m.num_generated_tokens, m.queue_time_s) == ("length", 3, 0.25)
    assert merge_chunks([chunk(0), chunk(1)]).queue_time_s is None
