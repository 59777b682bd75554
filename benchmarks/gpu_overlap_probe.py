"""Prefill passes and decode steps side by side on one GPU: do their times add, or overlap?

    python benchmarks/gpu_overlap_probe.py [--prefills 8] [--steps 16] [--carveouts 16,32] [--green-prefill 100]
                                           [--green-decode 32,64] [--out DIR]

Why: at 64 x 10 the engine keeps the GPU ~98 % busy with passes run one after another (docs/gpu_notes.md), so
what stands between ~5,100 tok/s and the 6,000 target is the passes' own cost. But the two kinds are bound by
different parts of the chip: a one-prompt prefill pass (512 tokens) by its GEMMs' tensor work (~650 TFLOP/s),
a batch-64 decode step by HBM (15 GB of weights and ~2 GB of keys and values a step). One after the other their
times add (~10.6 + ~5.8 ms); side by side, on two streams, the decode step's reads could run under the prefill's
GEMMs (NanoFlow's intra-device overlap; SGLang's prefill-decode multiplexing on green contexts). The engine's
mixed pass gets some of this by sharing the weight reads (16.4-16.7 ms for both) but not the rows' attention
and elementwise work. This measures, before any engine change, how much of the shorter kind two streams hide.

The engine's own pieces: gpu_engine's 7B-class model (random bf16 weights, projections fused), one SlotDecoder
with the compiled decode step captured at 64 rows over a 768 span and the compiled one-prompt prefill pass
captured at 512 tokens, each in its own graph memory pool (as the engine keeps them), so replays on two streams
do not share scratch memory. Each arm queues ``--prefills`` prefill replays and ``--steps`` decode replays
(steps at twice the prompts, as a stream's cycle has 127 steps per 64 prompts) behind a GPU sleep, so
everything is queued before the GPU starts, and times them with CUDA events (median of ``--reps``):

- ``prefill alone`` / ``decode alone``: each kind on one stream;
- ``one stream``: both kinds interleaved on one stream (the engine today, without mixed passes);
- ``two streams``: each kind on its own stream, equal priority;
- ``decode high`` / ``prefill high``: one stream at the highest priority (the block scheduler starts its
  thread blocks first as SMs free up; nothing is pre-empted);
- ``carveout N``: the prefill graph recaptured while cuBLAS is asked to leave N SMs free
  (``torch._C._set_sm_carveout_experimental``), decode high: room for the decode kernels beside the GEMMs;
- ``green prefill N`` / ``green decode N``: that kind's graph captured on the stream of a CUDA green context of
  N SMs (torch's ``torch.cuda.green_contexts``), the other free on a high-priority stream; ``alone ms`` is the
  confined kind alone on its N SMs.
- ``split N``: one split of the SMs into two disjoint green contexts through the driver, decode captured in
  the N-SM one and prefill in the rest; ``alone ms`` is prefill / decode alone in their parts. (Run 108 replayed graphs captured outside a green context on its stream:
  their time did not change at 32 SMs, so the partition binds work captured in it, if any.)

``hidden`` is the share of the shorter kind's time that the arm hid: (prefill alone + decode alone - arm) /
min(prefill alone, decode alone). An arm that fails is a result. Prints a table last and writes
gpu_overlap_probe.json. GPU only; no Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import print_table  # noqa: E402

ROWS, SPAN, PROMPT = 64, 768, 512


def hidden_share(prefill_ms: float, decode_ms: float, both_ms: float) -> float:
    """The share of the shorter kind's time that running both kinds in one arm hid: 0 where the times add, 1
    where the arm took only as long as the longer kind alone; negative where the arm was slower than both
    one after the other."""
    shorter = min(prefill_ms, decode_ms)
    if shorter <= 0:
        raise ValueError(f"the kinds' times alone must be positive, got {prefill_ms} and {decode_ms}")
    return (prefill_ms + decode_ms - both_ms) / shorter


def build_decoder():
    """The engine's decoder on the 7B-class model, compiled and captured as the engine's warm-up does."""
    import torch

    from benchmarks.gpu_engine import random_qwen7b
    from serve_app.engines.fused import fuse_projections
    from serve_app.engines.slot_kv import ATTENTION_NAME, SlotDecoder, register_attention

    model = random_qwen7b()
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    fuse_projections(model)
    dec = SlotDecoder(model, num_slots=ROWS, max_len=1024, dtype=torch.bfloat16, device=torch.device("cuda"),
                      use_graphs=True, batch_sizes=[ROWS], span_step=SPAN, compile_step=True,
                      compile_prefill=True, prefill_graph_tokens=PROMPT)
    with torch.inference_mode():
        dec.capture()
        # rows that stay put: with no row active every replay writes and reads the same positions
        dec.active.zero_()
        dec.positions.fill_(SPAN - 68)
        dec.tokens.fill_(123)
        dec._stage_prompt([1000 + i % 500 for i in range(PROMPT)], ROWS - 1, 0, PROMPT)
    torch.cuda.synchronize()
    return dec


class Launchers:
    """Replays of the captured decode step and prefill pass on whatever stream is current."""

    def __init__(self, dec):
        self.dec = dec

    def decode(self) -> None:
        self.dec.graphs[(ROWS, SPAN)][0].replay()

    def prefill(self) -> None:
        self.dec._prefill_runs[PROMPT][0].replay()


def timed(torch, queue, reps: int) -> dict:
    """Median over ``reps`` of ``queue(start_event) -> {name: end event}``: each arm queues its work behind a GPU
    sleep on the current stream (so all of it is queued before any runs) and returns an event per stream."""
    cur = torch.cuda.current_stream()
    runs: list[dict] = []
    for _ in range(reps + 1):  # the first is a warm-up
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # ~10 ms at ~2 GHz: longer than queueing the arm takes
        start = torch.cuda.Event(enable_timing=True)
        start.record(cur)
        ends = queue(start)
        torch.cuda.synchronize()
        runs.append({k: start.elapsed_time(e) for k, e in ends.items()})
    runs = runs[1:]
    out = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    out["total_ms"] = round(statistics.median(max(r.values()) for r in runs), 2)
    return out


def on_streams(torch, launches: list[tuple[str, object]], streams: dict, start) -> dict:
    """Queues ``launches`` ((stream name, fn) in order) on their streams after ``start``; an end event per
    stream."""
    for s in streams.values():
        s.wait_event(start)
    for name, fn in launches:
        with torch.cuda.stream(streams[name]):
            fn()
    ends = {}
    for name, s in streams.items():
        e = torch.cuda.Event(enable_timing=True)
        e.record(s)
        ends[name] = e
    for s in streams.values():
        torch.cuda.current_stream().wait_stream(s)
    return ends


def interleaved(prefills: int, steps: int, p, d) -> list[tuple[str, object]]:
    """Decode steps and prefill passes alternated (a step first), the longer kind's rest at the end."""
    order = []
    for i in range(max(prefills, steps)):
        if i < steps:
            order.append(("decode", d))
        if i < prefills:
            order.append(("prefill", p))
    return order


def on_one_stream(torch, fns: list, stream, reps: int) -> dict:
    """``fns`` queued in order on ``stream``, timed."""
    return timed(torch, lambda start: on_streams(torch, [("both", fn) for fn in fns], {"both": stream}, start), reps)


def side_by_side(torch, fns: dict, streams: dict, prefills: int, steps: int, reps: int) -> dict:
    """``prefills`` of ``fns["prefill"]`` and ``steps`` of ``fns["decode"]``, each kind on its stream, timed."""
    order = interleaved(prefills, steps, fns["prefill"], fns["decode"])
    return timed(torch, lambda start: on_streams(torch, order, streams, start), reps)


def stream_arm(torch, launch: Launchers, prefills: int, steps: int, reps: int, prio_p: int = 0,
               prio_d: int = 0, one: bool = False) -> dict:
    if one:
        order = interleaved(prefills, steps, launch.prefill, launch.decode)
        return on_one_stream(torch, [fn for _, fn in order], torch.cuda.Stream(), reps)
    streams = {"decode": torch.cuda.Stream(priority=prio_d), "prefill": torch.cuda.Stream(priority=prio_p)}
    return side_by_side(torch, {"decode": launch.decode, "prefill": launch.prefill}, streams, prefills, steps, reps)


def alone_arm(torch, fn, n: int, reps: int, stream=None) -> dict:
    return on_one_stream(torch, [fn] * n, stream or torch.cuda.Stream(), reps)


def carveout_arm(torch, dec, launch: Launchers, sms: int, prefills: int, steps: int, reps: int) -> dict:
    """The prefill graphs recaptured with cuBLAS asked to leave ``sms`` SMs free, then put back."""
    set_carveout = torch._C._set_sm_carveout_experimental
    try:
        set_carveout(sms)
        with torch.inference_mode():
            dec.capture_prefill_graphs()
        if dec.prefill_graph_error:
            raise RuntimeError(dec.prefill_graph_error)
        row = {"prefill_alone_ms": alone_arm(torch, launch.prefill, prefills, reps)["total_ms"]}
        row.update(stream_arm(torch, launch, prefills, steps, reps, prio_d=-10))
        return row
    finally:
        set_carveout(None)
        with torch.inference_mode():
            dec.capture_prefill_graphs()


def green_context(torch, num_sms: int):
    from torch.cuda import green_contexts

    if not green_contexts.SUPPORTED:
        raise RuntimeError("this torch has no green contexts")
    try:
        return green_contexts.GreenContext.create(num_sms=num_sms, device_id=0)
    except TypeError:  # the first form (torch 2.9) took them positionally
        return green_contexts.GreenContext.create(num_sms, 0)


def captured_in(torch, dec, kind: str, stream):
    """The decode step or the prefill pass captured anew on ``stream`` (in a pool of its own)."""
    from serve_app.engines.slot_kv import capture_graph

    with torch.inference_mode():
        if kind == "decode":
            run = lambda: dec._step(ROWS, SPAN)  # noqa: E731
        else:
            ids, slot_ids, last, _ = dec._prefill_in[:4]
            fn = dec._prefill_graph_fn()
            run = lambda: fn(ids[:PROMPT].view(1, PROMPT), slot_ids, last)  # noqa: E731
        with torch.compiler.set_stance("fail_on_recompile"):
            graph, _ = capture_graph(run, torch.cuda.graph_pool_handle(), stream)
    torch.cuda.synchronize()
    return graph


def green_arm(torch, dec, launch: Launchers, kind: str, sms: int, prefills: int, steps: int, reps: int) -> dict:
    """One kind's graph captured on the stream of a green context of ``sms`` SMs; the other kind's graph as the
    engine captured it, on a stream of the highest priority. torch makes each green context by its own split of
    the device's SMs, so two of them would overlap: only one kind is confined, and the other may use every SM.
    The confined kind alone says what it keeps of its speed on ``sms`` SMs."""
    ctx = green_context(torch, sms)
    if not hasattr(ctx, "Stream"):
        raise RuntimeError("this torch's green contexts give no stream to capture on")
    confined = ctx.Stream()
    graph = captured_in(torch, dec, kind, confined)
    other = "prefill" if kind == "decode" else "decode"
    fns = {kind: graph.replay, other: getattr(launch, other)}
    streams = {kind: confined, other: torch.cuda.Stream(priority=-10)}
    counts = {"decode": steps, "prefill": prefills}
    row = {"confined": kind, "sms": sms}
    row[f"{kind}_alone_ms"] = alone_arm(torch, fns[kind], counts[kind], reps, confined)["total_ms"]
    row.update(side_by_side(torch, fns, streams, prefills, steps, reps))
    return row


class DisjointGreenContexts:
    """Two CUDA green contexts on disjoint SMs, from one split of the device's (``first_sms`` and the rest), each
    with a stream torch can use. torch's own GreenContext.create splits the device anew for each context, so
    two of them overlap; this goes to the driver (libcuda through ctypes, no extra package): cuDeviceGetDevResource,
    cuDevSmResourceSplitByCount (which gives the group and the remainder), cuDevResourceGenerateDesc,
    cuGreenCtxCreate and cuGreenCtxStreamCreate (CUDA 12.5+)."""

    RESOURCE_BYTES = 256  # CUdevResource is 136-144 bytes (CUDA 13 / 12); opaque here, the SM count at byte 96
    SM_COUNT_OFFSET = 96

    def __init__(self, torch, first_sms: int):
        import ctypes

        cu = ctypes.CDLL("libcuda.so.1")

        def check(name, *args):
            rc = getattr(cu, name)(*args)
            if rc != 0:
                raise RuntimeError(f"{name} returned CUDA error {rc}")

        torch.cuda.init()
        dev = ctypes.c_int()
        check("cuDeviceGet", ctypes.byref(dev), torch.cuda.current_device())
        whole = ctypes.create_string_buffer(self.RESOURCE_BYTES)
        check("cuDeviceGetDevResource", dev, whole, 1)  # CU_DEV_RESOURCE_TYPE_SM
        group, rest = ctypes.create_string_buffer(self.RESOURCE_BYTES), ctypes.create_string_buffer(self.RESOURCE_BYTES)
        groups = ctypes.c_uint(1)
        check("cuDevSmResourceSplitByCount", group, ctypes.byref(groups), whole, rest, 0, first_sms)
        self.sms = tuple(int.from_bytes(r.raw[self.SM_COUNT_OFFSET:self.SM_COUNT_OFFSET + 4], "little")
                         for r in (group, rest))
        self.streams = []
        self._keep = [cu, whole, group, rest]
        for res in (group, rest):
            desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            check("cuDevResourceGenerateDesc", ctypes.byref(desc), res, 1)
            check("cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, 1)  # CU_GREEN_CTX_DEFAULT_STREAM
            check("cuGreenCtxStreamCreate", ctypes.byref(stream), ctx, 1, 0)  # CU_STREAM_NON_BLOCKING, priority 0
            self._keep.append(ctx)
            self.streams.append(torch.cuda.ExternalStream(stream.value))


def split_arm(torch, dec, decode_sms: int, prefills: int, steps: int, reps: int) -> dict:
    """Decode captured in a green context of ``decode_sms`` SMs, prefill in one of the rest (disjoint)."""
    split = DisjointGreenContexts(torch, decode_sms)
    sd, sp = split.streams
    fns = {"decode": captured_in(torch, dec, "decode", sd).replay,
           "prefill": captured_in(torch, dec, "prefill", sp).replay}
    streams = {"decode": sd, "prefill": sp}
    row = {"decode_sms": split.sms[0], "prefill_sms": split.sms[1]}
    row["decode_alone_ms"] = alone_arm(torch, fns["decode"], steps, reps, sd)["total_ms"]
    row["prefill_alone_ms"] = alone_arm(torch, fns["prefill"], prefills, reps, sp)["total_ms"]
    row.update(side_by_side(torch, fns, streams, prefills, steps, reps))
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    p.add_argument("--prefills", type=int, default=8, help="one-prompt prefill passes per arm")
    p.add_argument("--steps", type=int, default=16, help="batch-64 decode steps per arm")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--carveouts", default="32", help="comma-separated SMs left free by cuBLAS; empty for none")
    p.add_argument("--green-prefill", default="100", help="comma-separated SMs of a green context the prefill pass "
                   "is confined to (decode free, high priority); empty for none")
    p.add_argument("--green-decode", default="32,64", help="comma-separated SMs of a green context the decode step "
                   "is confined to (prefill free); empty for none")
    p.add_argument("--split", default="40", help="comma-separated SMs of the decode side of one split into two "
                   "disjoint green contexts (prefill on the rest); empty for none")
    args = p.parse_args()
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "prefills": args.prefills,
                 "steps": args.steps, "reps": args.reps, "arms": {}}

    def save():
        (out / "gpu_overlap_probe.json").write_text(json.dumps(res, indent=2))

    t0 = time.monotonic()
    dec = build_decoder()
    res["setup_s"] = round(time.monotonic() - t0, 1)
    res["compile_s"] = {"decode": round(dec.compile_s, 1), "prefill": round(dec.prefill_compile_s, 1)}
    res["errors"] = {"decode": dec.compile_error, "prefill": dec.prefill_compile_error,
                     "prefill_graph": dec.prefill_graph_error}
    save()
    launch = Launchers(dec)
    n_p, n_d, reps = args.prefills, args.steps, args.reps
    arms = [("prefill alone", lambda: alone_arm(torch, launch.prefill, n_p, reps)),
            ("decode alone", lambda: alone_arm(torch, launch.decode, n_d, reps)),
            ("one stream", lambda: stream_arm(torch, launch, n_p, n_d, reps, one=True)),
            ("two streams", lambda: stream_arm(torch, launch, n_p, n_d, reps)),
            ("decode high", lambda: stream_arm(torch, launch, n_p, n_d, reps, prio_d=-10)),
            ("prefill high", lambda: stream_arm(torch, launch, n_p, n_d, reps, prio_p=-10))]
    arms += [(f"carveout {n}", lambda n=int(n): carveout_arm(torch, dec, launch, n, n_p, n_d, reps))
             for n in args.carveouts.split(",") if n.strip()]
    arms += [(f"split {n}", lambda n=int(n): split_arm(torch, dec, n, n_p, n_d, reps))
             for n in args.split.split(",") if n.strip()]
    for kind, sms in (("prefill", args.green_prefill), ("decode", args.green_decode)):
        arms += [(f"green {kind} {n}", lambda k=kind, n=int(n): green_arm(torch, dec, launch, k, n, n_p, n_d, reps))
                 for n in sms.split(",") if n.strip()]
    for name, fn in arms:
        try:
            row = fn()
        except Exception as e:  # noqa: BLE001 - an arm that fails is a result
            row = {"error": f"{type(e).__name__}: {str(e)[:400]}", "trace": traceback.format_exc()[-2000:]}
        res["arms"][name] = row
        save()
        print(name, json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)

    pa = res["arms"].get("prefill alone", {}).get("total_ms")
    da = res["arms"].get("decode alone", {}).get("total_ms")
    rows = []
    for name, r in res["arms"].items():
        if "error" in r:
            rows.append({"arm": name, "total ms": "failed", "hidden": r["error"][:80]})
            continue
        row = {"arm": name, "total ms": r["total_ms"], "prefill end ms": r.get("prefill", ""),
               "decode end ms": r.get("decode", ""),
               "alone ms": " / ".join(str(r[k]) for k in ("prefill_alone_ms", "decode_alone_ms") if k in r)}
        if pa and da and name not in ("prefill alone", "decode alone"):
            row["hidden"] = f"{hidden_share(pa, da, r['total_ms']):.0%}"
            row["per prompt ms"] = f"{r['total_ms'] / n_p:.2f}"
        rows.append(row)
    res["table"] = rows
    save()
    print(f"\n{n_p} one-prompt prefill passes ({PROMPT} tokens) and {n_d} decode steps ({ROWS} rows, span {SPAN}); "
          f"{res['gpu']}, torch {res['torch']}; setup {res['setup_s']} s")
    print_table(rows, ["arm", "total ms", "prefill end ms", "decode end ms", "hidden", "per prompt ms",
                       "alone ms"])


if __name__ == "__main__":
    main()
