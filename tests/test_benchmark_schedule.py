"""The benchmarks' arrival schedule: the engine-alone and full-stack runs must meet the same one. And the
stack's report of raw files, which docs/benchmarks.md's tables come from."""

import random

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


def test_the_stack_report_reads_raw_files_against_the_engine_and_its_compare(monkeypatch, capsys):
    # docs/benchmarks.md's stack tables come from this report of committed raw files (no GPU, no Ray)
    import sys

    from benchmarks import gpu_stack

    from pathlib import Path

    r = f"{Path(__file__).resolve().parent.parent / 'docs' / 'results'}/"
    base = ["gpu_stack.py", "--concurrency", "32", "64", "--steady-rounds", "10",
            "--engine-json", r + "gpu_engine-h200-2026-12-03-495d1e9-I.json"]
    monkeypatch.setattr(sys, "argv", base + ["--report", r + "gpu_stack-h200-2026-12-03-495d1e9-I-python.json"])
    gpu_stack.main()
    out = capsys.readouterr().out
    assert "4686      4759  98 % of engine" in out and "+64.4 ms" in out
    monkeypatch.setattr(sys, "argv", base + ["--engine-compare", "slots.prefill_graphs=false", "--report",
                                             r + "gpu_stack-h200-2026-12-03-495d1e9-I-python-no-prefill-graphs.json"])
    gpu_stack.main()
    out = capsys.readouterr().out
    # the engine column is the engine's loads without the graphs, not its defaults
    assert "4269      4506  95 % of engine" in out and "+116.9 ms" in out
