"""When the hf engine runs a prefill pass: at once, or after a few more decode steps.

Why: every prefill pass stalls all running streams, and a pass of one prompt
costs far more per prompt than a pass of four (H200, 7B, compiled: 13.9 ms for
one 512-token prompt, 41.7 ms for four). Under a steady closed-loop load the
streams finish at staggered times, so admitting each prompt the moment it
arrives runs mostly one-prompt passes. Holding a prompt for a few decode steps
lets others join its pass; the held stream loses only those steps.

This is the rule text-generation-inference applies with `max_waiting_tokens`
(how many decode steps a waiting request may be held; 20 by default there)
and `waiting_served_ratio`; here with the pass's token budget as the "enough
to go" mark, and only while enough rows decode for fewer passes to matter:
the gain grows with the streams a pass stalls, while a held prompt waits the
same either way (the H200 runs are in docs/benchmarks.md, section 3). A pure
function, so it is tested without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillContext:
    running: int  # sequences decoding now
    free_rows: int  # sequences the batch can still take
    waiting: int  # requests queued for a prefill
    waiting_tokens: int  # their prompt tokens
    oldest_waited_steps: int  # decode steps the oldest of them has waited so far
    max_prefill_tokens: int  # one pass's budget
    max_wait_steps: int  # 0: never hold
    max_rows: int  # rows the batch has in all (max_num_seqs)
    min_running: float  # hold only while at least this fraction of max_rows decodes


def hold_prefill(ctx: PrefillContext) -> tuple[bool, str]:
    """(hold the waiting prompts for another decode step, why)."""
    if ctx.waiting == 0:
        return False, "nothing waiting"
    if ctx.max_wait_steps <= 0:
        return False, "holding is off"
    if ctx.running == 0:
        return False, "nothing decoding: a held prompt would leave the GPU idle"
    if ctx.running < ctx.min_running * ctx.max_rows:
        # a pass stalls every running stream: with few of them, merging passes saves little
        return False, "few rows decoding: a fuller pass would gain little"
    if ctx.waiting_tokens >= ctx.max_prefill_tokens:
        return False, "a full pass is waiting"
    if ctx.waiting >= ctx.free_rows:
        return False, "the waiting prompts fill every free row"
    if ctx.oldest_waited_steps >= ctx.max_wait_steps:
        return False, "the oldest prompt waited its limit"
    return True, "gathering prompts for a fuller pass"
