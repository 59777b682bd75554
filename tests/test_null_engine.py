"""The null engine's stepped mode (step_ms): a batched engine's timing without a model, so that benchmarks of the
serving path meet the bursts a GPU engine's passes make."""

import asyncio

import pytest

from serve_app.engines.base import GenerationRequest, SamplingParams
from serve_app.engines.options import NullEngineOptions
from serve_app.errors import EngineNotReadyError, OverloadedError
from tests.conftest import started_engine


class Turns:
    """Records what each consumer gets, grouped by event-loop turn: a step's tokens, handed out together, land in
    one turn (each consumer's wake-up is queued by the hand-out, in its order)."""

    def __init__(self):
        self.turns: list[list[tuple[str, int]]] = []
        self._open = False

    def add(self, rid: str, n_gen: int) -> None:
        if not self._open:
            self._open = True
            self.turns.append([])
            # the hand-out queued every consumer's wake-up already: this runs after all of them
            asyncio.get_running_loop().call_soon(self._close)
        self.turns[-1].append((rid, n_gen))

    def _close(self) -> None:
        self._open = False


async def consume(eng, rid, turns: Turns, max_tokens=100):
    async for c in eng.generate(GenerationRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))):
        if c.token_ids:
            turns.add(rid, c.num_generated_tokens)
    return c


async def test_an_abort_is_counted_in_either_timing():
    for options in ({"num_tokens": 100, "tokens_per_s": 50}, {"num_tokens": 100, "step_ms": 20}):
        async with started_engine("null", options) as eng:
            gen = eng.generate(GenerationRequest("a", [1, 2, 3], SamplingParams(max_tokens=100)))
            await gen.__anext__()
            await eng.abort("a")
            assert [c.finish_reason async for c in gen][-1] == "abort"
            assert eng.stats().aborted_requests == 1 and eng.stats().num_running == 0, options


def test_one_timing_at_a_time():
    with pytest.raises(ValueError, match="set one of them"):
        NullEngineOptions(step_ms=5, tokens_per_s=100)
    assert NullEngineOptions(step_ms=5).first_tokens_first


@pytest.mark.parametrize("first_tokens_first", [True, False])
async def test_a_step_hands_out_every_row_together_and_the_new_ones_in_the_order_asked(first_tokens_first):
    options = {"num_tokens": 6, "step_ms": 20, "first_tokens_first": first_tokens_first}
    async with started_engine("null", options) as eng:
        turns = Turns()
        rows = [asyncio.create_task(consume(eng, f"row{i}", turns)) for i in range(3)]
        while len(turns.turns) < 2:
            await asyncio.sleep(0.001)
        late = asyncio.create_task(consume(eng, "late", turns))
        ends = await asyncio.gather(*rows, late)
        assert [e.finish_reason for e in ends] == ["length"] * 4 and ends[-1].num_generated_tokens == 6
        # every step one turn: the rows in step with each other, each once per step
        for k, turn in enumerate(turns.turns[:6]):
            assert sorted(x for x in turn if x[0] != "late") == [(f"row{i}", k + 1) for i in range(3)], turns.turns
        joined = next(t for t in turns.turns if ("late", 1) in t)
        assert len(joined) == 4
        assert joined.index(("late", 1)) == (0 if first_tokens_first else 3), joined
        stats = eng.stats()
        assert stats.generated_tokens == 24 and stats.num_running == 0 and stats.num_waiting == 0
        assert stats.forward_passes == len(turns.turns)


@pytest.mark.parametrize("finishing_first", [True, False])
async def test_a_step_hands_out_the_tokens_that_end_requests_before_the_other_rows(finishing_first):
    async with started_engine("null", {"num_tokens": 6, "step_ms": 10, "finishing_first": finishing_first}) as eng:
        turns = Turns()
        await asyncio.gather(consume(eng, "row0", turns), consume(eng, "row1", turns),
                             consume(eng, "short", turns, max_tokens=3))
        ending = next(t for t in turns.turns if ("short", 3) in t)
        assert ending == ([("short", 3), ("row0", 3), ("row1", 3)] if finishing_first
                          else [("row0", 3), ("row1", 3), ("short", 3)])


async def test_with_a_lead_a_request_after_the_pick_waits_a_step_more():
    # hf picks a pass's prompts launch_lead_ms before the pass in flight ends; the stepped null engine does the
    # same, so a reply slower than the window left misses a step here as on a GPU
    with pytest.raises(ValueError, match="must be under step_ms"):
        NullEngineOptions(step_ms=5, launch_lead_ms=5)
    async with started_engine("null", {"num_tokens": 1000, "step_ms": 200, "launch_lead_ms": 100}) as eng:
        turns = Turns()
        row = asyncio.create_task(consume(eng, "row", turns, max_tokens=1000))

        async def next_handout() -> int:
            """Waits for the next hand-out; returns the index of the step that then runs."""
            n = len(turns.turns)
            while len(turns.turns) == n:
                await asyncio.sleep(0.001)
            return n + 1

        # right after a hand-out (the step that follows it is already picked): before this step's pick, 100 ms
        # on, so the step after this one; turns[n] is this step's hand-out
        n = await next_handout()
        await consume(eng, "early", turns, max_tokens=1)
        assert ("early", 1) in turns.turns[n + 1], turns.turns
        # 150 ms into a step: after its pick, so one step later
        n = await next_handout()
        await asyncio.sleep(0.15)
        await consume(eng, "late", turns, max_tokens=1)
        assert ("late", 1) in turns.turns[n + 2], turns.turns
        assert eng.stats().forward_passes == len(turns.turns)
        await eng.abort("row")
        assert (await row).finish_reason == "abort"


async def test_stepped_requests_abort_leave_and_meet_the_bounds():
    options = {"num_tokens": 1000, "step_ms": 5, "max_num_seqs": 1, "max_waiting_requests": 1}
    async with started_engine("null", options) as eng:
        turns = Turns()
        running = asyncio.create_task(consume(eng, "running", turns, max_tokens=1000))
        while eng.stats().num_running == 0:
            await asyncio.sleep(0.001)
        waiting = asyncio.create_task(consume(eng, "waiting", turns, max_tokens=1000))
        while eng.stats().num_waiting == 0:
            await asyncio.sleep(0.001)
        # one running, one waiting: the third is refused, with nothing left behind
        with pytest.raises(OverloadedError):
            await consume(eng, "third", turns)
        await eng.abort("running")
        assert (await running).finish_reason == "abort"
        while eng.stats().num_running == 0:  # the waiting one takes the freed row
            await asyncio.sleep(0.001)
        waiting.cancel()  # its consumer leaves, as a disconnected client's does
        with pytest.raises(asyncio.CancelledError):
            await waiting
        while eng.stats().num_running:
            await asyncio.sleep(0.001)
        assert eng.stats().aborted_requests == 2 and eng.stats().num_waiting == 0
        # shut down under load: the request ends with the engine's error, not a hang
        stuck = asyncio.create_task(consume(eng, "stuck", turns, max_tokens=1000))
        while eng.stats().num_running == 0:
            await asyncio.sleep(0.001)
    with pytest.raises(EngineNotReadyError):
        await asyncio.wait_for(stuck, 5)
