"""Predict what holding prompts for fuller prefill passes does to the GPU engine's
throughput and TTFT, before spending device time on it.

    python benchmarks/prefill_hold_sim.py [--waits 0,4,8,16] [--out DIR]

A discrete-event model of the hf engine's loop (admit -> one prefill pass if
anything was admitted -> one decode step of every running row), fed by the
load of benchmarks/gpu_engine.py (closed loop, first arrivals Poisson over
2 s, 512-token prompts, 128 output tokens) and priced with the pass times
measured on the H200 7B (docs/benchmarks.md section 3, 2026-12-03 compiled
prefill run): decode step by batch (graph replay 4.74 / 4.87 / 5.52 / 6.04 ms
at 1 / 8 / 32 / 64 rows) and prefill pass by prompts (13.9 / 41.7 / 157.2 ms
at 1 / 4 / 16 prompts), interpolated linearly. The admission rule is the
engine's own (`serve_app.engines.prefill_policy.hold_prefill`). The host is
free and arrivals land between passes: a model, not a measurement; it prints
its 0-wait row next to what the device measured so the two can be compared.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import sys
from bisect import bisect_left
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import percentile, print_table, save_json  # noqa: E402
from serve_app.engines.prefill_policy import PrefillContext, hold_prefill  # noqa: E402

STEP_MS = {1: 4.74, 8: 4.87, 32: 5.52, 64: 6.04}  # decode graph replay by rows, span 768
PREFILL_MS = {1: 13.9, 4: 41.7, 16: 157.2}  # compiled prefill pass by 512-token prompts
# 2026-12-04 (docs/gpu_notes.md), the engine with mixed_graph_tokens=512: decode steps, the one-prompt prefill
# graph and the mixed passes replayed alone at span 768 in run 71 (machine U); the compiled 4- and 16-prompt
# prefill passes of run 73 (machine W; U's: 39.12, 152.60). One waiting prompt and decoding rows share one
# captured mixed pass (by rows); more prompts go into one prefill pass, as the engine admits them (hf.py,
# _mixed_static)
MIXED_PRICES = {"step": {1: 4.69, 8: 4.80, 16: 5.04, 32: 5.39, 64: 5.85},
                "prefill": {1: 12.59, 4: 39.32, 16: 153.39},
                "mixed": {16: 13.29, 32: 15.81, 64: 16.73}}

# 2026-12-06 (docs/gpu_notes.md runs 132-136), an H100 (machine AY): the engine's own pass times under run 132's
# loads (gpu_pass_ms, means over each kind), the four-prompt pass dearer per prompt (44.43 / 4 = 11.1 ms) than a
# prompt's share of a mixed pass (17.59 - 7.50 = 10.1), where on the H200 above it is the cheaper (9.8 against 10.9).
# Only what AY measured: passes of more than four prompts (max_prefill_tokens past 2,048) extrapolate from 3-4
H100_PRICES = {"step": {1: 5.81, 2: 5.78, 8: 6.07, 16: 6.25, 32: 6.67, 48: 7.28, 64: 7.50},
               "prefill": {1: 11.21, 2: 24.07, 3: 34.00, 4: 44.43},
               "mixed": {16: 13.76, 32: 14.66, 64: 17.59}}
# 2026-12-06 (docs/gpu_notes.md run 138), an H200 (machine AZ), measured as AY's above (the default arm's 32, 64 x 3
# and 64 x 10 loads, counts pooled): its four-prompt pass under load 45.21 ms, not the 39.32 that W's passes
# replayed alone gave MIXED_PRICES, so per prompt (11.3) it costs more than a prompt's share of a mixed pass
# (16.22 - 5.94 = 10.3), as on the H100
H200_AZ_PRICES = {"step": {1: 4.72, 2: 4.69, 8: 4.85, 16: 5.02, 32: 5.43, 48: 5.79, 64: 5.94},
                  "prefill": {1: 11.21, 2: 24.63, 3: 34.57, 4: 45.21},
                  "mixed": {16: 13.12, 32: 15.84, 64: 16.22}}
CARD_PRICES = {"h200": MIXED_PRICES, "h100": H100_PRICES, "h200-az": H200_AZ_PRICES}
# what each card's prices came from, for the report's first line: beside CARD_PRICES so a new card names its runs
CARD_SOURCES = {"h200": "runs 71 and 73 (H200)", "h100": "run 132 (H100)", "h200-az": "run 138 (H200, machine AZ)"}


def interp(table: dict[int, float], x: int) -> float:
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    i = min(bisect_left(xs, x), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return table[x0] + (table[x1] - table[x0]) * (x - x0) / (x1 - x0)


def _old_wave(rng: random.Random, conc: int) -> list[float]:
    """A first wave as gpu_engine.concurrent_load drew it before it had an RNG of its own: Poisson gaps
    at conc / 2 s, `conc - 1` draws from `rng`."""
    arrivals, t = [0.0], 0.0
    for _ in range(conc - 1):
        t += rng.expovariate(conc / 2.0)
        arrivals.append(t)
    return arrivals


def simulate(conc: int, rounds: int, wait_steps: int, prompt: int = 512, output: int = 128,
             max_prefill_tokens: int = 2048, seed: int = 0, rows: int = 64, min_running: float = 0.5,
             arrivals: list[float] | None = None, return_delay_s: tuple[float, float] = (0.0, 0.0),
             release_at_wave_end: bool = False, prices: dict | None = None,
             one_per_mixed: bool = False, think_ms: float = 0.0) -> dict:
    """`return_delay_s`: a stream's next request arrives this long (uniform in the range) after its last
    one finished: the round trip through a client and the serving stack, which the engine alone lacks.
    `release_at_wave_end`: no next request before the first wave's last arrival, as the benchmarks'
    load sent them until 2026-12-03 (after run 43; docs/gpu_notes.md, "The TTFT tail at 32").
    `prices`: pass times (ms) by rows or prompts, {"step", "prefill"[, "mixed"]}; with "mixed", one admitted
    prompt and the running rows' decode step are one pass (MIXED_PRICES). Default: STEP_MS and PREFILL_MS.
    `one_per_mixed`: with mixed prices, admit one prompt per pass while rows decode (a variant of the loop
    the engine has as mixed_one_prompt_per_pass, off by default: else a pass takes every waiting prompt up to
    max_prefill_tokens).
    `think_ms`: each stream also pauses before each request after its first, as gpu_engine.py's --think-ms
    (the same pauses, benchmarks.gpu_engine.think_times)."""
    from benchmarks.gpu_engine import think_times

    step_ms = (prices or {}).get("step", STEP_MS)
    prefill_ms = (prices or {}).get("prefill", PREFILL_MS)
    mixed_ms = (prices or {}).get("mixed")
    delay_rng = random.Random(1)
    pauses = think_times(conc, rounds, think_ms)
    if arrivals is None:
        # the hold figures in docs/gpu_notes.md runs 32 and 36 came from this wave
        arrivals = _old_wave(random.Random(seed), conc)
    pending = [(a, i) for i, a in enumerate(arrivals)]  # (arrival time s, stream)
    heapq.heapify(pending)
    left = {i: rounds for i in range(conc)}
    waiting: list[tuple[float, int, int]] = []  # (arrived s, stream, pass count at arrival)
    running: dict[int, list] = {}  # stream -> [arrived s, first token s, tokens]
    done: list[dict] = []
    now, passes, prefills = 0.0, 0, 0
    held_to_wave_end = 0  # with release_at_wave_end: next requests that had to wait for the wave's end
    while pending or waiting or running:
        while pending and pending[0][0] <= now:
            a, i = heapq.heappop(pending)
            waiting.append((a, i, passes))
        if not waiting and not running:
            now = pending[0][0]
            continue
        held = hold_prefill(PrefillContext(
            running=len(running), free_rows=rows - len(running), waiting=len(waiting),
            waiting_tokens=min(len(waiting) * prompt, max_prefill_tokens),
            oldest_waited_steps=passes - waiting[0][2] if waiting else 0,
            max_prefill_tokens=max_prefill_tokens, max_wait_steps=wait_steps, max_rows=rows,
            min_running=min_running))[0]
        decoding, stepped = list(running), False  # stepped: the rows' decode step rode in a mixed pass
        if waiting and not held:
            take = waiting[: 1 if mixed_ms and one_per_mixed and decoding else max(1, max_prefill_tokens // prompt)]
            del waiting[: len(take)]
            prefills += 1
            passes += 1
            if mixed_ms and len(take) == 1 and decoding:
                now += interp(mixed_ms, len(decoding)) / 1000
                stepped = True
            else:
                now += interp(prefill_ms, len(take)) / 1000
            for a, i, _ in take:
                running[i] = [a, now, 1]
        if not stepped:
            decoding = list(running)  # the new prompts too: their prefill pass is apart from this step
            if decoding:
                now += interp(step_ms, len(decoding)) / 1000
                passes += 1
        for i in decoding:
            r = running[i]
            r[2] += 1
            if r[2] >= output:
                done.append({"start_s": r[0], "ttft_s": r[1] - r[0], "e2e_s": now - r[0], "tokens": r[2]})
                del running[i]
                left[i] -= 1
                if left[i]:
                    nxt = now + delay_rng.uniform(*return_delay_s) + pauses[i][rounds - left[i] - 1]
                    if release_at_wave_end and nxt < arrivals[-1]:
                        held_to_wave_end += 1
                        nxt = arrivals[-1]
                    heapq.heappush(pending, (nxt, i))
    from benchmarks.gpu_engine import full_window

    ttft = [d["ttft_s"] for d in done]
    window = full_window(done, conc)
    return {"conc": conc, "rounds": rounds, "wait_steps": wait_steps, "min_running": min_running, "output_tok_s": sum(d["tokens"] for d in done) / now,
            "full_window_tok_s": window["output_tok_s"] if window else None,
            "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p95_ms": 1000 * percentile(ttft, 95),
            "forward_passes": passes, "prefill_passes": prefills,
            **({"sent_at_wave_end": held_to_wave_end} if release_at_wave_end else {})}


def old_first_waves(prompts_before: int, prompt: int = 512) -> dict[int, list[float]]:
    """The first waves gpu_engine.py / gpu_stack.py met before 2026-12-03's fix: drawn from the prompts'
    RNG (Random(0)) after `prompts_before` prompts (gpu_engine 6, gpu_stack 5), 32 then 64 x 3."""
    from benchmarks.gpu_engine import prompt_draw

    draw, rng = prompt_draw(prompt)
    for _ in range(prompts_before):
        draw()
    waves = {}
    for conc in (32, 64):
        waves[conc] = _old_wave(rng, conc)
        for _ in range(conc * 3):
            draw()
    return waves


def return_delay_report(out: Path, delays_ms: list[tuple[float, float]], waits: list[int],
                        mixed: bool = False, steady_rounds: int = 10, one_per_mixed: bool = False,
                        think_ms: list[float] = (0.0,), card: str = "h200") -> None:
    """What holding prompts does to TTFT when the next requests come back through a stack (jittered).
    `mixed`: priced as the engine with mixed passes on `card` (CARD_PRICES), with a `steady_rounds` load too."""
    from benchmarks.gpu_engine import first_wave_arrivals

    loads = [(32, 3), (64, 3)] + ([(64, steady_rounds)] if mixed and steady_rounds else [])
    rows = []
    for think in think_ms:
        for lo, hi in delays_ms:
            for conc, rounds in loads:
                for w in waits:
                    r = simulate(conc, rounds, w, arrivals=first_wave_arrivals(conc),
                                 return_delay_s=(lo / 1000, hi / 1000), prices=CARD_PRICES[card] if mixed else None,
                                 one_per_mixed=one_per_mixed, think_ms=think)
                    rows.append({"return_delay_ms": [lo, hi], "think_ms": think, **r})
    card_tag = f"_{card.replace('-', '')}" if mixed and card != "h200" else ""
    name = ("prefill_hold_sim_return_delay" + ("_mixed" if mixed else "") + card_tag
            + ("_one_per_pass" if one_per_mixed else "") + ("_think" if any(think_ms) else "") + ".json")
    (out / name).write_text(json.dumps(rows, indent=2))
    print(f"model (not a measurement), min running 0.5, today's first wave, "
          f"{'mixed passes priced by ' + CARD_SOURCES[card] if mixed else 'no mixed passes'}"
          f"{', one prompt per mixed pass' if one_per_mixed else ''}")
    print(f"{'think ms':>8}  {'return delay ms':<16}{'load':>8}{'wait':>5}{'tok/s':>8}{'in flight':>10}"
          f"{'TTFT p50':>10}{'p95':>7}{'prefill':>8}")
    for r in rows:
        lo, hi = r["return_delay_ms"]
        fw = f"{r['full_window_tok_s']:.0f}" if r["full_window_tok_s"] else "-"
        load = f"{r['conc']}x{r['rounds']}"
        print(f"{r['think_ms']:>8g}  {f'{lo:g}-{hi:g}':<16}{load:>8}{r['wait_steps']:>5}{r['output_tok_s']:>8.0f}"
              f"{fw:>10}{r['ttft_p50_ms']:>10.0f}{r['ttft_p95_ms']:>7.0f}{r['prefill_passes']:>8}")


def mixed_holds_report(out: Path, waits: list[int], min_running: list[float], max_prefill_tokens: list[int],
                       steady_rounds: int) -> None:
    """How far the hold and the prefill pass's size move the engine with mixed passes (MIXED_PRICES) at
    64 x steady_rounds, today's first wave: whether scheduling alone could reach 6,000 tok/s."""
    from benchmarks.gpu_engine import first_wave_arrivals

    rows = [simulate(64, steady_rounds, w, max_prefill_tokens=mpt, min_running=m, arrivals=first_wave_arrivals(64),
                     prices=MIXED_PRICES) | {"max_prefill_tokens": mpt}
            for mpt in max_prefill_tokens for w in waits for m in min_running
            if w or m == min_running[0]]  # nothing is held at wait 0: that row once
    save_json(out / "prefill_hold_sim_mixed_holds.json", rows)
    print(f"model (not a measurement), mixed passes priced by runs 71 and 73, 64 x {steady_rounds}, today's first wave")
    print_table(rows, ["max_prefill_tokens", "wait_steps", "min_running", "output_tok_s", "full_window_tok_s",
                       "ttft_p50_ms", "ttft_p95_ms", "prefill_passes"])


def release_report(out: Path) -> None:
    """The benchmarks' load before and after each stream sent its next request at once (hold 0)."""
    from benchmarks.gpu_engine import first_wave_arrivals

    rows = []
    for conc in (32, 64):
        for old in (True, False):
            r = simulate(conc, 3, 0, arrivals=first_wave_arrivals(conc), release_at_wave_end=old)
            rows.append({"next_request": "at the wave's end (old)" if old else "at once (now)", **r})
    save_json(out / "prefill_hold_sim_release.json", rows)
    print("model (not a measurement), hold 0, 3 requests per stream, today's first wave")
    print_table(rows, ["next_request", "conc", "sent_at_wave_end", "output_tok_s", "ttft_p50_ms", "ttft_p95_ms",
                       "prefill_passes"])


def schedules_report(out: Path) -> None:
    """How much the two benchmarks' different first waves alone move tok/s, in the model (hold 8)."""
    from benchmarks.gpu_engine import first_wave_arrivals

    rows = []
    for label, waves in (("gpu_engine (old)", old_first_waves(6)), ("gpu_stack (old)", old_first_waves(5)),
                         ("both (now)", {c: first_wave_arrivals(c) for c in (32, 64)})):
        for conc in (32, 64):
            r = simulate(conc, 3, 8, arrivals=waves[conc])
            rows.append({"schedule": label, "first_wave_last_arrival_s": round(waves[conc][-1], 3), **r})
    (out / "prefill_hold_sim_schedules.json").write_text(json.dumps(rows, indent=2))
    print("model (not a measurement), hold 8 and min running 0.5, 3 requests per stream")
    print(f"{'schedule':<18}{'conc':>5}{'wave ends s':>12}{'tok/s':>8}{'in flight':>10}{'TTFT p50':>10}{'p95':>7}")
    for r in rows:
        print(f"{r['schedule']:<18}{r['conc']:>5}{r['first_wave_last_arrival_s']:>12.2f}{r['output_tok_s']:>8.0f}"
              f"{r['full_window_tok_s']:>10.0f}{r['ttft_p50_ms']:>10.0f}{r['ttft_p95_ms']:>7.0f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--schedules", action="store_true",
                   help="only model the arrival schedules the engine and stack benchmarks met (and meet now)")
    p.add_argument("--release", action="store_true",
                   help="only model the load with each stream's next request held to the first wave's end (as "
                        "the benchmarks sent them before 2026-12-03's fix) against sent at once")
    p.add_argument("--waits", default="0,4,8,16,32")
    p.add_argument("--min-running", default="0.5,0", help="the engine's prefill_hold_min_running values to model")
    p.add_argument("--steady-rounds", type=int, default=10, help="as gpu_engine.py's --steady-rounds")
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    p.add_argument("--return-delay-ms", nargs="+", metavar="LO,HI",
                   help="only model TTFT and tok/s at waits --waits when each stream's next request comes back "
                        "LO-HI ms after its last finished (e.g. 0,0 10,40 20,80)")
    p.add_argument("--mixed", action="store_true",
                   help="price the passes as the engine with mixed passes (MIXED_PRICES): with --return-delay-ms, "
                        "that report; alone, 64 x --steady-rounds over --waits, --min-running and "
                        "--max-prefill-tokens")
    p.add_argument("--max-prefill-tokens", default="2048",
                   help="with --mixed alone: the engine's max_prefill_tokens values to model (comma-separated)")
    p.add_argument("--think-ms", default="0",
                   help="with --return-delay-ms: each stream's mean pause before each request after its first, "
                        "as gpu_engine.py's --think-ms (comma-separated values, each a set of rows)")
    p.add_argument("--one-per-mixed", action="store_true",
                   help="with --mixed: model a loop that admits one prompt per pass while rows decode (the "
                        "engine's mixed_one_prompt_per_pass)")
    p.add_argument("--card", choices=sorted(CARD_PRICES), default="h200",
                   help="with --mixed and --return-delay-ms: whose measured pass times price the passes")
    args = p.parse_args()
    if args.one_per_mixed and not args.mixed:
        p.error("--one-per-mixed models mixed passes: it needs --mixed")
    if args.card != "h200" and not (args.mixed and args.return_delay_ms):
        p.error("--card prices the mixed passes of the return-delay report: it needs --mixed and --return-delay-ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.schedules:
        schedules_report(out)
        return
    if args.release:
        release_report(out)
        return
    if args.return_delay_ms:
        return_delay_report(out, [tuple(float(x) for x in d.split(",")) for d in args.return_delay_ms],
                            [int(x) for x in args.waits.split(",")], mixed=args.mixed,
                            steady_rounds=args.steady_rounds, one_per_mixed=args.one_per_mixed,
                            think_ms=[float(x) for x in args.think_ms.split(",")], card=args.card)
        return
    if args.mixed:
        mixed_holds_report(out, [int(x) for x in args.waits.split(",")],
                           [float(x) for x in args.min_running.split(",")],
                           [int(x) for x in args.max_prefill_tokens.split(",")], args.steady_rounds)
        return
    rows = [simulate(conc, rounds, w, min_running=m) for conc, rounds in ((32, 3), (64, 3), (64, args.steady_rounds))
            for m in (float(x) for x in args.min_running.split(","))
            # nothing is held at wait 0, whatever the fraction: that row once
            for w in (int(x) for x in args.waits.split(",")) if w or m == float(args.min_running.split(",")[0])]
    (out / "prefill_hold_sim.json").write_text(json.dumps(rows, indent=2))
    print("model (not a measurement); the device measured at wait 0: 64x3 3,946 tok/s, 691 passes; "
          "64x10 4,278 tok/s, 1,917 passes; 32x3 TTFT p95/p50 178/46 ms")
    print(f"{'conc x rounds':<14}{'wait':>5}{'min run':>8}{'tok/s':>8}{'in flight':>10}{'TTFT p50':>10}{'p95':>7}"
          f"{'passes':>8}{'prefill':>8}")
    for r in rows:
        fw = f"{r['full_window_tok_s']:.0f}" if r["full_window_tok_s"] else "-"
        print(f"{r['conc']:>3} x {r['rounds']:<8}{r['wait_steps']:>5}{r['min_running']:>8g}{r['output_tok_s']:>8.0f}{fw:>10}"
              f"{r['ttft_p50_ms']:>10.0f}{r['ttft_p95_ms']:>7.0f}{r['forward_passes']:>8}{r['prefill_passes']:>8}")


if __name__ == "__main__":
    main()
