"""The benchmarks' arrival schedule: the engine-alone and full-stack runs must meet the same one. And the
stack's report of raw files, which docs/benchmarks.md's tables come from."""

import json
import random
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_engine import FIRST_WAVE_SPAN_S, first_wave_arrivals


def test_first_wave_is_the_same_whatever_was_drawn_before():
    a = first_wave_arrivals(64)
    random.seed(1)
    random.random()  # other draws (prompts, the module RNG) must not move it
    assert first_wave_arrivals(64) == a
    assert first_wave_arrivals(32) != a[:32]


def test_first_wave_spans_its_window_in_order():
    for conc in (1, 2, 32, 64):
        xs = first_wave_arrivals(conc)
        assert len(xs) == conc and xs[0] == 0.0
        assert all(b >= a for a, b in zip(xs, xs[1:]))
        if conc > 1:
            assert abs(xs[-1] - FIRST_WAVE_SPAN_S) < 1e-9
    gaps = [b - a for a, b in zip(first_wave_arrivals(64), first_wave_arrivals(64)[1:])]
    assert max(gaps) > 3 * min(gaps)  # Poisson-like gaps, not an even spread


def test_each_stream_sends_its_next_request_as_soon_as_its_last_one_ends():
    # the requests after the first wave once waited for its last arrival (2 s), so every stream done
    # before then sent at 2.00 s together: a burst the TTFT tail measured instead of the engine
    import asyncio

    from benchmarks.gpu_engine import concurrent_load

    async def send(k, prompt):
        await asyncio.sleep(0.05)
        return {"ttft_s": 0.01, "ttft_text_s": 0.01, "e2e_s": 0.05, "tokens": len(prompt)}

    conc, rounds = 4, 3
    rng = random.Random(0)
    res = asyncio.run(concurrent_load(send, conc, lambda: [rng.randrange(10) for _ in range(8)], rng, rounds))
    rows = res["per_request"]  # [start s, ttft ms, queue ms] in start order
    assert res["requests"] == res["failed"] + len(rows) == conc * rounds and res["failed"] == 0
    starts = [r[0] for r in rows]
    arrivals = first_wave_arrivals(conc)
    # stream 0 arrives at 0 and runs its three requests back to back, long before the wave's end
    assert starts[:rounds] == sorted(starts[:rounds]) and starts[rounds - 1] < 0.5
    assert all(abs(a - b) < 0.2 for a, b in zip(starts[:rounds], (0.0, 0.05, 0.10)))
    # no more than one request per stream at once: each start is some stream's arrival or another's end
    assert sum(1 for s in starts if s < arrivals[-1] - 0.2) >= rounds + 1
    assert res["full_window"] is None or res["full_window"]["output_tok_s"] > 0


def test_queue_summary_counts_the_requests_that_met_their_pass_boundary():
    from benchmarks.gpu_engine import queue_summary

    assert queue_summary([]) is None
    # in step with the passes: half within 2 ms; the rest waited a decode step or a mixed pass
    q = queue_summary([0.0005, 0.0012, 0.0019, 0.0001, 0.005, 0.006, 0.015, 0.016])
    assert q["under_2ms_share"] == 0.5
    assert 1.0 < q["p50_ms"] < 6.0 and q["p95_ms"] == 16.0
    assert queue_summary([0.003, 0.004])["under_2ms_share"] == 0.0


def test_the_pass_line_names_the_kinds_that_took_the_most_gpu_time():
    from benchmarks.gpu_engine import pass_line

    assert pass_line({}) is None and pass_line({"gpu_pass": {}}) is None  # files before it, the CPU
    load = {"gpu_pass": {"decode_r64": {"passes": 1200, "total_ms": 7020.0, "mean_ms": 5.85},
                         "mixed_512_r64": {"passes": 195, "total_ms": 3262.0, "mean_ms": 16.73},
                         "decode_r8": {"passes": 30, "total_ms": 141.0, "mean_ms": 4.7},
                         "prefill_3p": {"passes": 40, "total_ms": 1400.0, "mean_ms": 35.0}}}
    assert pass_line(load, top=3) == "decode_r64 5.85 ms x 1200, mixed_512_r64 16.73 ms x 195, prefill_3p 35.00 ms x 40"


def test_the_gpu_budget_adds_the_families_the_gaps_and_the_rest_up_to_the_loads_wall_time():
    from benchmarks.gpu_engine import gpu_budget_line

    load = {"wall_s": 14.0, "gpu_gap_total_ms": 300.0,
            "gpu_pass": {"decode_r64": {"passes": 1200, "total_ms": 7020.0, "mean_ms": 5.85},
                         "decode_r8": {"passes": 30, "total_ms": 141.0, "mean_ms": 4.7},
                         "mixed_512_r64": {"passes": 195, "total_ms": 3262.0, "mean_ms": 16.73},
                         "prefill_3p": {"passes": 40, "total_ms": 1400.0, "mean_ms": 35.0}}}
    # decode 7.161 s over 1,230 passes; 14 - 7.161 - 3.262 - 1.4 - 0.3 = 1.877 s with no pass running
    assert gpu_budget_line(load) == ("decode 7.16 s / 1230, mixed 3.26 s / 195, prefill 1.40 s / 40; "
                                     "between passes 0.30 s; the rest 1.88 s of 14.00 s")
    assert gpu_budget_line({"wall_s": 3.0}) is None and gpu_budget_line({"gpu_pass": load["gpu_pass"]}) is None
    # a load busy end to end, its counters' window a little wider than the client's clock (machine AN's stack)
    busy = {**load, "wall_s": 11.9}
    assert gpu_budget_line(busy).endswith(
        "between passes 0.30 s; no rest: the passes and gaps sum 0.22 s over the client's wall time of 11.90 s")


RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
# run 138 (H200, machine AZ): the first-use line's and the loop model's H200 prices' source
AZ_RUN_138 = RESULTS / "gpu_engine-h200-2026-12-06-60bba96-AZ-mixed512-bf16-separate-compare-one-per-pass.json"


def test_the_first_use_line_sets_the_warm_up_loads_multi_prompt_prefills_against_the_later_ones():
    from benchmarks.gpu_engine import first_use_line

    res = json.loads(AZ_RUN_138.read_text())
    warm, later = res["warm_load"]["gpu_pass"], res["concurrency_64_steady"]["gpu_pass"]
    line = first_use_line(res)
    parts = line.split(", ")
    # by prompt count; the one-prompt pass and the mixed ones are captured graphs, not this compiled pass
    assert [p.split()[0] for p in parts] == ["2p", "3p", "4p"]
    assert "prefill_1p" in warm and "mixed_512_r64" in warm and "1p" not in line and "mixed" not in line
    for part in parts:
        kind = "prefill_" + part.split()[0]
        n, mean, later_mean = warm[kind]["passes"], warm[kind]["mean_ms"], later[kind]["mean_ms"]
        assert part == f"{part.split()[0]} {mean:.1f} / {later_mean:.1f} x {n} ({n * (mean - later_mean):+.0f})"
    # run 138's finding: the warm-up's one 3-prompt pass cost ~55 ms over the later ones' mean
    assert warm["prefill_3p"]["passes"] == 1 and warm["prefill_3p"]["mean_ms"] - later["prefill_3p"]["mean_ms"] > 40
    steady = res["concurrency_64_steady"]
    assert first_use_line({"concurrency_64_steady": steady}) is None  # files before the per-pass sums, the CPU
    assert first_use_line({"warm_load": {"gpu_pass": {"prefill_1p": warm["prefill_1p"]}},
                           "concurrency_64_steady": steady}) is None


def stack_report(monkeypatch, capsys, engine_json: str, *stack_files: str, extra: tuple = ()) -> str:
    """What `gpu_stack.py --report` prints for committed raw files against an engine file (no GPU, no Ray),
    with the loads of the runs the docs quote."""
    from benchmarks import gpu_stack

    monkeypatch.setattr(sys, "argv", [
        "gpu_stack.py", "--concurrency", "32", "64", "--steady-rounds", "10",
        "--engine-json", str(RESULTS / engine_json), *extra,
        "--report", *(str(RESULTS / f) for f in stack_files)])
    gpu_stack.main()
    return capsys.readouterr().out


def test_the_stack_report_reads_raw_files_against_the_engine_and_its_compare(monkeypatch, capsys):
    # docs/benchmarks.md's stack tables come from this report of committed raw files
    engine = "gpu_engine-h200-2026-12-03-495d1e9-I.json"
    out = stack_report(monkeypatch, capsys, engine, "gpu_stack-h200-2026-12-03-495d1e9-I-python.json")
    assert "4686      4759  98 % of engine" in out and "+64.4 ms" in out
    out = stack_report(monkeypatch, capsys, engine, "gpu_stack-h200-2026-12-03-495d1e9-I-python-no-prefill-graphs.json",
                       extra=("--engine-compare", "slots.prefill_graphs=false"))
    # the engine column is the engine's loads without the graphs, not its defaults
    assert "4269      4506  95 % of engine" in out and "+116.9 ms" in out


def test_the_stack_report_reads_a_partial_file_cut_before_serve_shut_down(monkeypatch, capsys):
    # run 74's call ran out in Serve's shutdown: its loads are only in the partial file, which lacks the stats
    # read after them (which process the engine ran in)
    out = stack_report(monkeypatch, capsys, "gpu_engine-h200-2026-12-04-221f185-W-mixed512-warm1.json",
                       "gpu_stack-h200-2026-12-04-221f185-X-haproxy-direct-mixed512-partial.json")
    assert "engine in its own process" in out
    assert "5011      5097  98 % of engine" in out and "+29.6 ms" in out


def test_the_stack_report_names_where_the_replica_ran_our_code_and_the_clients_lag(monkeypatch, capsys):
    # run 77's arms differ only in server.user_code_loop; files from before it ran on Serve's thread
    out = stack_report(monkeypatch, capsys, "gpu_engine-h200-2026-12-04-5c93fcf-Y-mixed512-call3-probe.json",
                       "gpu_stack-h200-2026-12-04-5c93fcf-Y-haproxy-direct-shared-mixed512-call2.json",
                       "gpu_stack-h200-2026-12-04-221f185-X-haproxy-direct-mixed512-partial.json")
    shared, old = out.split("\nfull stack")[1:]
    assert "our code on the replica main loop" in shared and "4461      4437  101 % of engine" in shared
    assert "+12.8 ms" in shared and "the client's own loop: late by p50 / p99 / max 0.15 / 2.42 / 8.1 ms" in shared
    assert "our code on Serve user-code thread" in old and "the client's own loop" not in old



def test_the_stack_report_gives_the_ttfts_quartiles_and_the_median_after_the_first_wave(monkeypatch, capsys):
    # the twenty-third session's runs 99-100 (docs/benchmarks.md): the closed loop, then 20-ms pauses, whose
    # stack is paired only with the engine file of the same pause
    engine = "gpu_engine-h200-2026-12-05-6c8a500-AG-mixed512-separate-carriedcache-think{}.json"
    stack = "gpu_stack-h200-2026-12-05-6c8a500-AG-haproxy-direct-shared-mixed512-separate-think{}-warm.json"
    out = stack_report(monkeypatch, capsys, engine.format(0), stack.format(0))
    assert "+2.1 ms" in out and "stack 36.1 / 53.1 / 79.9 / 54.6; engine 38.9 / 51.0 / 95.4 / 51.2" in out
    out = stack_report(monkeypatch, capsys, engine.format(20), stack.format(20), extra=("--think-ms", "20"))
    assert "+12.3 ms" in out and "stack 35.9 / 55.6 / 102.0 / 59.7; engine 28.9 / 43.3 / 83.8 / 44.8" in out
    # a pause of its own against the closed loop's engine: not comparable
    out = stack_report(monkeypatch, capsys, engine.format(0), stack.format(20), extra=("--think-ms", "20"))
    assert "not comparable" in out


def test_the_stack_report_gives_the_mean_ttft_beside_a_median_between_the_humps(monkeypatch, capsys):
    # the thirty-fifth session's run 136 (docs/gpu_notes.md, an H100): at 64 x 10 the median moved +17.2 ms and
    # the mean +7.5
    out = stack_report(monkeypatch, capsys, "gpu_engine-h100-2026-12-06-7a40643-AY-mixed512-bf16-separate-2.json",
                       "gpu_stack-h100-2026-12-06-7a40643-AY-mixed512-bf16-haproxy-direct-shared-think0-bare-3.json",
                       extra=("--think-ms", "0"))
    assert "+17.2 ms (<= 5 ms)" in out
    assert "TTFT mean (ms): stack 91.3, engine 83.8 (+7.5 ms)" in out
    assert "TTFT mean (ms): stack 29.5, engine 27.7 (+1.8 ms)" in out  # at 32


def test_the_stack_report_gives_each_clients_loads_against_one_engine(monkeypatch, capsys):
    # the twenty-sixth session's runs 102-103 (docs/benchmarks.md, on an H100): httpx then the bare client, then
    # the other order, each client's loads against the same engine column
    engine = "gpu_engine-h100-2026-12-05-7c79368-AH-mixed512-separate-cold-think0.json"
    stack = "gpu_stack-h100-2026-12-05-7c79368-AH-haproxy-direct-shared-mixed512-separate-think0-{}.json"
    first, then = stack_report(monkeypatch, capsys, engine, stack.format("httpx-bare")).split(
        "from the bare client, the same deployment, the same engine column:")
    assert "the loads' client: httpx" in first
    assert "+8.3 ms" in first and "+1.9 ms" in first and "+4.7 ms" in first
    assert "-0.7 ms" in then and "-0.1 ms" in then and "+1.0 ms" in then and "+-" not in then
    first, then = stack_report(monkeypatch, capsys, engine, stack.format("bare-httpx")).split(
        "from the httpx client, the same deployment, the same engine column:")
    assert "+0.9 ms" in first and "+0.8 ms" in first and "+1.1 ms" in first
    assert "3440      3856  89 % of engine" in then and "+10.9 ms" in then
    # files from before the client legs and the TCP counters print neither
    assert "the client's legs" not in first + then and "TCP during the load" not in first + then


def test_the_stack_report_pairs_the_launch_lead_runs_with_the_engine_under_its_compare(monkeypatch, capsys):
    # the eighteenth session's table (docs/benchmarks.md, runs 83-85): both stack runs against AC's engine in its
    # own process, once as started (no lead) and once under its launch_lead_ms=2 compare
    engine = "gpu_engine-h200-2026-12-04-e1273e8-AC-mixed512-separate-cold-lead2compare.json"
    stacks = ("gpu_stack-h200-2026-12-04-e1273e8-AC-haproxy-direct-shared-mixed512-nolead-warm.json",
              "gpu_stack-h200-2026-12-04-e1273e8-AC-haproxy-direct-shared-mixed512-lead2-warm.json")
    nolead, lead = stack_report(monkeypatch, capsys, engine, *stacks).split("\nfull stack")[1:]
    assert "TTFT p50 at 32 (ms)                     38.3      32.5  +5.8 ms" in nolead
    assert "TTFT p50 at 64, 10/stream (ms)          65.9      61.3  +4.6 ms" in lead
    nolead, lead = stack_report(monkeypatch, capsys, engine, *stacks,
                                extra=("--engine-compare", "launch_lead_ms=2")).split("\nfull stack")[1:]
    # the engine column is now its loads with the lead: 22.3 ms at 32, 52.0 and 5,099 tok/s at 64 x 10
    assert "TTFT p50 at 32 (ms)                     34.3      22.3  +11.9 ms" in lead
    assert "TTFT p50 at 64, 10/stream (ms)          65.9      52.0  +13.9 ms" in lead
    assert "output tok/s at 64, 10/stream           4971      5099  97 % of engine" in nolead


def test_the_stack_report_pairs_each_live_compare_with_the_engines_same_compare(monkeypatch, capsys):
    # the nineteenth session's lead sweep (docs/benchmarks.md, runs 86-87): one stack file holding the default loads
    # and those under two launch_lead_ms changes made on the live replica, each against the engine's loads under the
    # same change; a change the engine file lacks gets no engine column instead of another setting's
    engine = "gpu_engine-h200-2026-12-04-a553ab2-AD-mixed512-separate-cold-leadsweep.json"
    stack = "gpu_stack-h200-2026-12-04-a553ab2-AD-haproxy-direct-shared-mixed512-separate-leadsweep-warm.json"
    default, lead1, lead05 = stack_report(monkeypatch, capsys, engine, stack).split("\nwith launch_lead_ms=")
    assert "TTFT p50 at 32 (ms)                     33.8      23.1  +10.7 ms" in default
    assert "TTFT p50 at 32 (ms)                     32.2      28.2  +4.0 ms" in lead1
    assert "TTFT p50 at 64, 10/stream (ms)          66.5      58.9  +7.6 ms" in lead05
    assert "GPU between passes, engine: 416.8 ms over 1347 gaps" in lead05
    # the inline stack's lead-1 loads against AC's engine file, which has no launch_lead_ms=1 compare
    inline = "gpu_stack-h200-2026-12-04-a553ab2-AD-haproxy-direct-shared-mixed512-inline-lead1compare-warm.json"
    unpaired = stack_report(monkeypatch, capsys, "gpu_engine-h200-2026-12-04-e1273e8-AC-mixed512-separate-cold-"
                            "lead2compare.json", inline).split("\nwith launch_lead_ms=")[1]
    assert "the engine file has no loads under it: no engine column" in unpaired
    assert "TTFT p50 at 64, 10/stream (ms)          87.8       nan" in unpaired

def test_the_client_lag_counts_a_blocked_loop():
    import asyncio
    import time

    from benchmarks.gpu_stack import ClientLag

    async def load(block_s: float) -> dict:
        with ClientLag() as lag:
            await asyncio.sleep(0.02)
            end = time.perf_counter() + block_s
            while time.perf_counter() < end:  # a client busy parsing: every stream's timestamps wait
                pass
            await asyncio.sleep(0.02)
        return lag.summary

    idle, blocked = asyncio.run(load(0.0)), asyncio.run(load(0.08))
    assert blocked["lag_max_ms"] >= 75 > idle["lag_max_ms"]
    assert blocked["cpu_share"] > idle["cpu_share"]


def test_the_client_lag_freezes_what_came_before_and_counts_its_loads_own_full_collections():
    import asyncio
    import gc

    from benchmarks.gpu_stack import ClientLag

    async def load(collect: bool) -> dict:
        with ClientLag() as lag:
            frozen = gc.get_freeze_count()
            if collect:
                gc.collect()  # what a growing heap sets off in a long load
            await asyncio.sleep(0.01)
        return {**lag.summary, "frozen": frozen}

    held = [[i] for i in range(20_000)]  # an earlier load's records, tracked by the collector
    callbacks, frozen_before = len(gc.callbacks), gc.get_freeze_count()
    try:
        quiet = asyncio.run(load(False))
        collected = asyncio.run(load(True))
    finally:
        gc.unfreeze()
    assert quiet["frozen"] - frozen_before >= len(held)  # entering froze them: a full collection in the load skips them
    assert quiet["gc_collections"][2] == 0
    assert collected["gc_collections"][2] == 1 and collected["gc_pause_max_ms"][2] > 0
    assert len(gc.callbacks) == callbacks  # each load's recorder goes with it


def test_each_stack_arm_names_its_file_and_the_first_runs_keep_their_names():
    from benchmarks.gpu_stack import arm_suffix

    assert arm_suffix("python", "inline", "separate", "separate") == ""
    assert arm_suffix("haproxy", "auto", "direct") == "_haproxy_auto_direct"
    assert arm_suffix("haproxy", "auto", "direct", "shared") == "_haproxy_auto_direct_shared"


def test_the_loop_model_sends_a_thinking_streams_next_request_after_its_pause():
    from benchmarks.gpu_engine import think_times
    from benchmarks.prefill_hold_sim import simulate

    # one stream, two requests: a 10 ms prefill and 1 ms steps, 4 tokens each (13 ms a request); the second
    # request comes back after the stream's pause, so the run ends that much later
    prices = {"step": {1: 1.0, 64: 1.0}, "prefill": {1: 10.0, 4: 10.0, 16: 10.0}}
    common = dict(conc=1, rounds=2, wait_steps=0, output=4, arrivals=[0.0], prices=prices)
    closed = simulate(**common)
    pause_s = think_times(1, 2, 50.0)[0][0]
    thinking = simulate(**common, think_ms=50.0)
    assert round(8 / closed["output_tok_s"], 6) == 0.026
    assert round(8 / thinking["output_tok_s"], 6) == round(0.026 + pause_s, 6)


def test_the_loop_model_puts_one_waiting_prompt_into_the_rows_decode_pass():
    from benchmarks.prefill_hold_sim import simulate

    # stream 0 alone: a 10 ms prefill, then 1 ms steps; stream 1 arrives 0.5 ms in and waits for the loop
    prices = {"step": {1: 1.0, 64: 1.0}, "prefill": {1: 10.0, 4: 10.0, 16: 10.0}}
    with_mixed = {**prices, "mixed": {16: 3.0, 64: 3.0}}
    common = dict(conc=2, rounds=1, wait_steps=0, output=4, arrivals=[0.0, 0.0005])
    apart = simulate(**common, prices=prices)
    mixed = simulate(**common, prices=with_mixed)
    # apart: prefill 0, step, prefill 1 + step, two steps: 10 + 1 + 11 + 1 + 1 = 24 ms for 8 tokens.
    # mixed: prefill 0, step, stream 1's prompt in stream 0's step (3 ms), three steps: 17 ms, as many passes
    assert mixed["forward_passes"] == apart["forward_passes"] == 6
    assert round(apart["output_tok_s"], 1) == round(8 / 0.024, 1)
    assert round(mixed["output_tok_s"], 1) == round(8 / 0.017, 1)
    # stream 1's first token: at 11 + 10 ms apart, at 11 + 3 ms mixed (arrived at 0.5 ms); stream 0's at 10
    assert round(apart["ttft_p95_ms"], 3) == 20.5 and round(mixed["ttft_p95_ms"], 3) == 13.5
    three = {**common, "arrivals": [0.0, 0.0005, 0.0006], "conc": 3}
    one = simulate(**three, prices=with_mixed, one_per_mixed=True)
    both = simulate(**three, prices=with_mixed)
    # two waiting prompts: one prefill pass for both, or (one per pass) two mixed passes
    assert one["prefill_passes"] == both["prefill_passes"] + 1


def test_the_h200_az_prices_are_run_138s_pass_times_pooled_over_its_three_loads():
    from benchmarks.prefill_hold_sim import CARD_PRICES

    res = json.loads(AZ_RUN_138.read_text())
    pooled: dict[str, list[float]] = {}
    for load in ("concurrency_32", "concurrency_64", "concurrency_64_steady"):  # the default arm's, not the compare's
        for kind, v in res[load]["gpu_pass"].items():
            p = pooled.setdefault(kind, [0, 0.0])
            p[0] += v["passes"]
            p[1] += v["total_ms"]
    mean = {kind: total / n for kind, (n, total) in pooled.items()}
    prices = CARD_PRICES["h200-az"]
    assert prices["step"][1] == round(res["single"]["decode_step_ms"], 2)  # one row: the single stream's step
    assert {r: round(mean[f"decode_r{r}"], 2) for r in prices["step"] if r > 1} == {
        r: ms for r, ms in prices["step"].items() if r > 1}
    assert {n: round(mean[f"prefill_{n}p"], 2) for n in prices["prefill"]} == prices["prefill"]
    assert {r: round(mean[f"mixed_512_r{r}"], 2) for r in prices["mixed"]} == prices["mixed"]
    # why the model's sign turned (run 138): per prompt, a four-prompt pass now costs more than a mixed pass's share
    assert prices["prefill"][4] / 4 > prices["mixed"][64] - prices["step"][64]


def test_relay_cpu_reads_one_threads_cpu_from_proc():
    # benchmarks/relay_cpu.py charges the engine process's relay with its main thread's CPU only
    import os
    import threading
    import time

    from benchmarks.relay_cpu import thread_cpu_s

    pid = os.getpid()
    before = thread_cpu_s(pid, pid)
    t_end = time.process_time() + 0.3
    while time.process_time() < t_end:  # busy in this (the main) thread
        pass
    busy = thread_cpu_s(pid, pid) - before
    assert busy >= 0.2
    # another thread's work is not the main thread's
    before = thread_cpu_s(pid, pid)
    worker = threading.Thread(target=lambda: sum(i * i for i in range(3_000_000)))
    worker.start()
    worker.join()
    assert thread_cpu_s(pid, pid) - before < 0.1


def test_the_queue_report_reads_the_engine_queue_from_per_request_records(monkeypatch, capsys):
    # docs/benchmarks.md's seventeenth-session queue figures come from this report of committed raw files
    from benchmarks import gpu_engine

    monkeypatch.setattr(sys, "argv", ["gpu_engine.py", "--queue-report",
                                      str(RESULTS / "gpu_engine-h200-2026-12-04-075255b-AA-mixed512-inline-cold-probe.json"),
                                      str(RESULTS / "gpu_engine-h200-2026-12-04-075255b-AA-mixed512-separate-warm.json"),
                                      str(RESULTS / "gpu_engine-h200-2026-12-04-e1273e8-AC-mixed512-separate-cold-lead2compare.json")])
    gpu_engine.main()
    inline, separate, lead = capsys.readouterr().out.split("(engine ")[1:]
    assert inline.startswith("inline)") and separate.startswith("separate)") and lead.startswith("separate)")
    # TTFT p50, queue p50 / p95, share within 2 ms, the rest after admission: the engine inline, then in its child
    assert "concurrency_64_steady                                44.0       5.6   53.1    36%      34.3" in inline
    assert "concurrency_64_steady                                58.8      15.2   51.3     2%      41.0" in separate
    # the loads under a --compare change follow the defaults' (the eighteenth session's launch lead)
    assert "concurrency_64_steady                                61.3      30.2  106.3     2%      38.4" in lead
    assert "concurrency_64_steady_launch_lead_ms=2               52.0      15.4  103.2     2%      37.2" in lead


def test_think_times_are_the_same_in_both_benchmarks_and_average_their_mean():
    from benchmarks.gpu_engine import think_times

    assert think_times(4, 3, 0.0) == [[0.0, 0.0]] * 4  # the closed loop: no pause
    pauses = think_times(64, 10, 20.0)
    assert pauses == think_times(64, 10, 20.0)  # drawn per stream from a fixed seed
    assert len(pauses) == 64 and all(len(p) == 9 for p in pauses)
    flat = [x for p in pauses for x in p]
    assert 0.016 < sum(flat) / len(flat) < 0.024  # 576 exponential draws of mean 20 ms
    assert len({p[0] for p in pauses}) == 64  # streams pause independently


def test_a_stream_that_thinks_sends_its_next_request_after_its_pause():
    import asyncio

    from benchmarks.gpu_engine import concurrent_load, prompt_draw, think_line, think_times

    async def instant(i, prompt):  # the send: answers at once, so a start time is arrival plus pauses
        return {"ttft_s": 0.001, "ttft_text_s": 0.001, "e2e_s": 0.002, "tokens": 2}

    def starts(think_ms: float) -> dict:
        prompt, rng = prompt_draw(4)
        res = asyncio.run(concurrent_load(instant, 2, prompt, rng, rounds=3, think_ms=think_ms))
        return res, sorted(r[0] for r in res["per_request"])

    closed, closed_starts = starts(0.0)
    thinking, thinking_starts = starts(60.0)
    assert thinking["think_ms"] == 60.0 and closed["think_ms"] == 0.0
    # stream 0 starts at 0 s, stream 1 at 2 s (the first wave's span): stream 0's three requests start
    # before 1 s, its later two each after its pause
    def stream0(xs):
        return [x for x in xs if x < 1.0]

    pause0 = think_times(2, 3, 60.0)[0]
    t = stream0(thinking_starts)
    assert len(t) == 3 and t[1] - t[0] >= pause0[0] and t[2] - t[1] >= pause0[1] and min(pause0) > 0.001
    c = stream0(closed_starts)
    assert c[2] - c[0] < pause0[0]  # the closed loop: back to back
    assert "pause 60 ms" in think_line({"concurrency_2": thinking}) and think_line({"concurrency_2": closed}) == ""


async def _slow_headers_server(headers_delay_s: float):
    """A loopback HTTP/1.1 server that reads each request whole, waits, then streams one SSE chunk (a
    completion's usage) and [DONE], chunked, keeping the connection: what a proxy or a busy replica looks like to
    a client's two legs."""
    import asyncio

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                await asyncio.sleep(headers_delay_s)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for data in (b'data: {"usage": {"completion_tokens": 3}}\n\n', b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_both_clients_split_a_slow_first_byte_into_the_request_written_and_the_headers_after():
    # a first token that waited: in the client (a connection to open, a pooled one to wait for) or behind
    # the proxy and server; the legs say which, from httpx's trace events and from the bare client's own clock
    import asyncio

    import httpx

    from benchmarks.gpu_engine import client_legs_summary
    from benchmarks.gpu_stack import http_one, legs_text, stream_body
    from benchmarks.loadgen import BareClient

    delay_s = 0.08

    async def run() -> dict:
        server = await _slow_headers_server(delay_s)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        async with server:
            async with httpx.AsyncClient() as client:
                via_httpx = [await http_one(client, url, "m", [1, 2], 3) for _ in range(2)]
            bare = BareClient(url)
            via_bare = [await bare.send(0, stream_body("m", [1, 2], 3)) for _ in range(2)]
            bare.close()
        return {"httpx": via_httpx, "bare": via_bare}

    for name, records in asyncio.run(run()).items():
        assert [r["tokens"] for r in records] == [3, 3], name
        # one connection per client, opened by its first request and kept for the second
        assert [r["new_connection"] for r in records] == [True, False], name
        for r in records:
            assert r["headers_s"] >= delay_s * 0.95 and r["sent_s"] < delay_s / 2, (name, r)
            assert r["ttft_s"] >= r["sent_s"] + r["headers_s"] - 1e-6, (name, r)
        legs = client_legs_summary(records)
        assert legs["new_connections"] == 1 and legs["headers_max_ms"] >= 0.95 * 1000 * delay_s > legs["sent_max_ms"]
        assert legs_text(legs).endswith("; 1 connections opened") and f"{legs['headers_max_ms']:.1f} ms" in legs_text(legs)
    assert client_legs_summary([{"ttft_s": 0.01}]) is None  # a sender without legs: the engine alone


def test_the_tcp_counters_see_a_connection_opened():
    import socket

    from benchmarks.loadgen import tcp_counters, tcp_counters_delta

    before = tcp_counters()
    if not before:
        import pytest
        pytest.skip("no /proc/net/snmp here (not Linux)")
    assert {"ListenOverflows", "ListenDrops", "TCPSynRetrans", "ActiveOpens"} <= set(before)
    server = socket.create_server(("127.0.0.1", 0))
    with socket.create_connection(server.getsockname()):
        pass
    server.close()
    delta = tcp_counters_delta(before, tcp_counters())
    assert delta["ActiveOpens"] >= 1 and all(v >= 0 for v in delta.values())  # counters only grow


def test_the_return_delay_report_names_where_each_cards_prices_came_from(tmp_path, capsys):
    from benchmarks.prefill_hold_sim import CARD_PRICES, CARD_SOURCES, return_delay_report

    assert set(CARD_SOURCES) == set(CARD_PRICES)
    for card in CARD_PRICES:
        return_delay_report(tmp_path, [(0.0, 0.0)], [0], mixed=True, steady_rounds=0, card=card)
        first = capsys.readouterr().out.splitlines()[0]
        assert f"mixed passes priced by {CARD_SOURCES[card]}" in first
        tag = "" if card == "h200" else "_" + card.replace("-", "")
        rows = json.loads((tmp_path / f"prefill_hold_sim_return_delay_mixed{tag}.json").read_text())
        assert [r["conc"] for r in rows] == [32, 64]


def test_a_compare_of_an_option_read_at_start_is_refused_before_anything_runs(monkeypatch, capsys):
    # the fortieth session's compare of prompt_attention on a live engine ran the started kernel in both
    # arms under two names (docs/gpu_notes.md run 148): the benchmarks refuse such a change as they parse it
    from benchmarks import burst_path, gpu_engine, gpu_stack

    for script, good, start_only in [(gpu_engine, "launch_lead_ms=2", 'prompt_attention="flash"'),
                                     (gpu_stack, "mixed_one_prompt_per_pass=false", "cuda_graphs=false"),
                                     (burst_path, "first_tokens_first=false", "step_ms=2")]:
        monkeypatch.setattr(sys, "argv", [script.__name__, "--compare", f"{good},{start_only}"])
        with pytest.raises(SystemExit) as e:
            script.main()
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --compare: ['{start_only.split('=')[0]}'] are read when the engine starts" in err
        assert good.split("=")[0] in err.split("while running:")[1]  # the live ones listed
    assert gpu_engine.live_compare()("launch_lead_ms=2,slots.prefill_graphs=false") == {
        "launch_lead_ms": 2, "slots.prefill_graphs": False}
