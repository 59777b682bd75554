"""The serving path under a batched engine's bursts, on the CPU: the engine alone against the stack.

    python benchmarks/burst_path.py [--streams 64] [--tokens 16] [--step-ms 20] [--rounds 40] [--pairs 2]
        [--paths engine stack] [--set KEY=JSON] [--compare KEY=JSON] [--think-ms MEAN] [--http-proxy haproxy]
        [--stream-interval-ms MS] [--consumer generate|coalesced|pushed] [--clients httpx bare] [--trace]
        [--access-log on|off] [--out FILE]

A GPU engine hands out a pass's tokens together: at 64 streams 64 chunks at once, every ~5.8 ms on an H200,
and every hop to the client (the engine process's relay, the replica, its HTTP stream, the client) takes them in
that order. Per-request timers (the null engine's ``tokens_per_s``, benchmarks/stream_pacing.py) spread them out;
the null engine's stepped mode (``step_ms``) keeps the bursts without a model. The same closed loop (the GPU
benchmarks' first wave and client) runs against

- ``engine``: the engine in a process of its own, driven from this one (gpu_engine.py --engine-process
  separate's layout);
- ``stack``: HAProxy, the replica serving HTTP itself, the engine in its own process (gpu_stack.py's layout);

each first with one idle stream (the path alone), then ``--pairs`` loads of ``--streams`` x ``--rounds``. With
``--compare`` the loads alternate (ABBA) between the engine's options as started and the change, made on the live
engine, so both ways meet the same box; with two ``--clients`` the stack's loads alternate the same way between
httpx and the bare socket client (what the client itself adds). With ``--trace`` the stack traces every
request and each load's first token is split into legs (gpu_stack.first_token_breakdown): whether a request
waited in the engine's queue for a step it missed shows there. Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import _option, compare_tag, concurrent_load, live_compare, prompt_draw  # noqa: E402
from benchmarks.gpu_stack import ClientLag, http_one, replica_handle, stream_body  # noqa: E402
from benchmarks.loadgen import (BareClient, add_access_log_arg, add_http_proxy_arg, free_port, percentile,  # noqa: E402
                               save_json, stat_cpu_s)

_ids = itertools.count()


class ProcCpu:
    """CPU seconds the serving processes use over a load, from /proc (Linux): the replica (``ServeReplica``
    in its command line), the engine's child (``serve_app.engines.process``), HAProxy and this process. On this
    two-core box every process's CPU is taken from the others' share, and a replica loop's CPU per request is
    how long each request holds the loop that every stream's tokens pass through."""

    PATTERNS = {"replica": "ServeReplica:", "engine child": "serve_app.engines.process", "haproxy": "haproxy"}

    def __init__(self):
        self.pids = {"client": os.getpid()}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            for label, pattern in self.PATTERNS.items():
                if pattern in cmd and label not in self.pids:
                    self.pids[label] = int(entry)

    @staticmethod
    def _cpu_s(pid: int) -> float:
        try:
            return stat_cpu_s(f"/proc/{pid}/stat")
        except OSError:  # the process is gone
            return float("nan")

    def __enter__(self):
        self._t0 = {k: self._cpu_s(pid) for k, pid in self.pids.items()}
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_s = {k: self._cpu_s(pid) - self._t0[k] for k, pid in self.pids.items()}


def engine_options(args) -> dict:
    return {"num_tokens": args.tokens, "step_ms": args.step_ms, "max_num_seqs": 256, **dict(args.set)}


def engine_stream(engine, req, consumer: str, interval_s: float):
    """A request's chunks as ``consumer`` reads them: the engine's generator as is, or paced as a replica
    paces them (serve_app/deployments/coalesce: ``coalesced`` over the generator, ``pushed`` over submit)."""
    from serve_app.deployments.coalesce import engine_chunks

    if consumer == "generate":
        return engine.generate(req)
    return engine_chunks(engine, req, interval_s, push=consumer == "pushed")


async def engine_one(engine, prompt: list[int], tokens: int, consumer: str = "generate",
                     interval_s: float = 0.0) -> dict:
    """One request to the engine, timed as gpu_engine.py times them (at this process's consumer)."""
    from serve_app.engines.base import GenerationRequest, SamplingParams

    t0 = time.perf_counter()
    first, n = None, 0
    req = GenerationRequest(f"b{next(_ids)}", prompt, SamplingParams(max_tokens=tokens))
    async for c in engine_stream(engine, req, consumer, interval_s):
        if first is None and c.token_ids:
            first = time.perf_counter() - t0
        n += len(c.token_ids)
    return {"ttft_s": first, "ttft_text_s": first, "e2e_s": time.perf_counter() - t0, "tokens": n}


async def measure(senders: dict, set_options, stats, args, path: str) -> dict:
    """One idle stream, then the loads (ABBA with --compare, or between the clients of ``senders``, a
    ``send(k, prompt)`` for each; request k is stream k % streams'); ``set_options(dict)`` changes the live
    engine, ``stats()`` returns its counters."""
    prompt, rng = prompt_draw(16)
    first = next(iter(senders))
    idle = [(await senders[first](0, prompt()))["ttft_s"] for _ in range(21)][1:]
    await concurrent_load(senders[first], args.streams, prompt, rng, 2)  # warm-up
    if args.compare:  # (label, engine options, client)
        arms = [("as started", {}, first), (compare_tag(args.compare), args.compare, first)]
    else:
        arms = [("as started" if len(senders) == 1 else f"client {c}", {}, c) for c in senders]
    undo = {k: args.started_options[k] for k in (args.compare or {})}  # back to the options as started
    loads = []
    for pair in range(args.pairs):
        # ABBA: neither way always runs first in its pair (this box's load drifts between loads)
        for label, change, client in (arms if pair % 2 == 0 else arms[::-1]):
            await set_options(change or undo)
            before = await stats()
            t0_ns = time.time_ns()
            with ClientLag() as lag, ProcCpu() as cpu:
                res = await concurrent_load(senders[client], args.streams, prompt, rng, args.rounds,
                                            think_ms=args.think_ms)
            after = await stats()
            ttfts = [r[1] for r in res["per_request"]]
            loads.append({
                "path": path, "pair": pair, "arm": label,
                "requests": res["requests"], "failed": res["failed"], "token_counts": res["token_counts"],
                "output_tok_s": round(res["output_tok_s"], 1), "ttft_p50_ms": round(res["ttft_p50_ms"], 2),
                "ttft_p95_ms": round(res["ttft_p95_ms"], 2), "ttft_mean_ms": round(statistics.fmean(ttfts), 2),
                "engine_steps": after["forward_passes"] - before["forward_passes"], "client": lag.summary,
                "client_legs": res["client_legs"],
                "window_ns": [t0_ns, time.time_ns()],
                "cpu_ms_per_request": {k: round(1000 * v / max(1, res["requests"]), 3) for k, v in cpu.cpu_s.items()}})
            print(loads[-1], flush=True)
    return {"idle_ttft_p50_ms": round(1000 * percentile(idle, 50), 2), "loads": loads}


async def run_engine(args) -> dict:
    from serve_app.engines.registry import create_engine

    engine = create_engine("null", engine_options(args), process="separate")
    await engine.start()
    try:
        async def set_options(change: dict) -> dict:
            return engine.update_options(change) if change else {}

        async def stats() -> dict:
            await asyncio.sleep(0.2)  # the child sends its counters with its outputs, or every 0.5 s idle
            return engine.stats().as_dict()

        return await measure({"engine": lambda k, p: engine_one(engine, p, args.tokens, args.consumer,
                                                                args.stream_interval_ms / 1000)},
                             set_options, stats, args, "engine")
    finally:
        await engine.shutdown()


def run_stack(args) -> dict:
    from cluster.launcher import select_http_proxy

    select_http_proxy(args.http_proxy)  # before Ray starts
    import httpx
    import ray
    from ray import serve

    from serve_app.app import deploy
    from serve_app.config import parse_config

    trace_file = Path(tempfile.mkdtemp(prefix="burst_path-")) / "traces.jsonl"
    ray.init(num_cpus=max(4, os.cpu_count() or 4), include_dashboard=False, log_to_driver=False)
    http_port, grpc_port = free_port(), free_port()
    deploy(parse_config({
        "models": [{"name": "bench", "variants": [{
            "name": "stable", "weight": 100, "max_ongoing_requests": 1024,
            "engine": {"backend": "null", "process": "separate", "options": engine_options(args)}}]}],
        "server": {"host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port, "direct_streaming": True,
                   "stream_interval_ms": args.stream_interval_ms, "access_log": args.access_log == "on"},
        "rollout": {"enabled": False},
        **({"tracing": {"exporter": "file", "file_path": str(trace_file)}} if args.trace else {}),
    }))

    async def go() -> dict:
        h = replica_handle()
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            url = f"http://127.0.0.1:{http_port}/v1/completions"

            async def set_options(change: dict) -> dict:
                return await h.update_engine_options.remote(change) if change else {}

            async def stats() -> dict:
                await asyncio.sleep(0.2)
                return await h.stats.remote()

            bare = BareClient(url)
            make = {"httpx": lambda k, p: http_one(client, url, "bench", p, args.tokens),
                    "bare": lambda k, p: bare.send(k % args.streams, stream_body("bench", p, args.tokens))}
            try:
                return await measure({c: make[c] for c in args.clients}, set_options, stats, args, "stack")
            finally:
                bare.close()

    try:
        res = asyncio.run(go())
        if args.trace:
            add_legs(res["loads"], trace_file)
        return res
    finally:
        serve.shutdown()
        ray.shutdown()


def add_legs(loads: list[dict], trace_file: Path, timeout_s: float = 60.0) -> None:
    """Each load's first-token legs from the trace file, once the exporters have written every request."""
    from benchmarks.gpu_stack import first_token_breakdown, wait_for_traces

    wait_for_traces(trace_file, sum(r["requests"] for r in loads), timeout_s)
    for r in loads:
        r["first_token_legs"] = first_token_breakdown(trace_file, r["window_ns"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16, help="tokens per request: each stream sends a new request "
                   "every this many steps (at 64 streams and 16, four first tokens in every step)")
    p.add_argument("--step-ms", type=float, default=20.0, help="the null engine's step (an H200's 64-row decode "
                   "step of the 7B is ~5.8 ms; at 10 this box's two cores ran out in most loads)")
    p.add_argument("--rounds", type=int, default=40, help="requests per stream in each load")
    p.add_argument("--pairs", type=int, default=2, help="loads of each arm, ABBA")
    p.add_argument("--paths", nargs="+", choices=("engine", "stack"), default=["engine", "stack"])
    p.add_argument("--set", action="append", default=[], type=_option, metavar="KEY=JSON",
                   help="a null-engine option as started, e.g. --set launch_lead_ms=8 (the window a closed-loop "
                        "reply has to make the next step is then step_ms - 8)")
    p.add_argument("--compare", type=live_compare("null"), default=None, metavar="KEY=JSON[,KEY=JSON]",
                   help="null-engine options for the other arm, e.g. first_tokens_first=false")
    p.add_argument("--stream-interval-ms", type=float, default=50.0,
                   help="server.stream_interval_ms (the GPU stack runs' 50)")
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="each stream pauses this long on average (exponential) before each request after its first, "
                        "as gpu_engine.py / gpu_stack.py --think-ms: in the closed loop (0) a stream's next request "
                        "comes right after a step's hand-out on either path and waits for the next step, so what "
                        "the path takes on the way in hides in that wait")
    p.add_argument("--consumer", choices=("generate", "coalesced", "pushed"), default="generate",
                   help="the engine path's reader: the engine's generator as is (gpu_engine.py's), or paced at "
                        "--stream-interval-ms as a replica paces it, over the generator (a task per stream wakes "
                        "every step) or over submit (each step appends to the stream's buffer); the client's CPU "
                        "per request is then what the replica's side of the relay costs")
    p.add_argument("--clients", nargs="+", choices=("httpx", "bare"), default=["httpx"],
                   help="the stack path's HTTP client (gpu_stack.py's): httpx, the bare socket client, or both, "
                        "alternating ABBA (not with --compare)")
    p.add_argument("--trace", action="store_true", help="the stack path: trace every request, split each load's "
                   "first token into legs")
    add_access_log_arg(p)  # the stack path's
    add_http_proxy_arg(p)
    p.set_defaults(http_proxy="haproxy")
    p.add_argument("--out", default=str(ROOT / "results" / "burst_path.json"))
    args = p.parse_args()
    if args.compare and len(args.clients) > 1:
        p.error("--compare alternates engine options with the first client; --clients alternates clients: one at a time")
    if len(set(args.clients)) != len(args.clients):
        p.error("--clients: each client once")
    from serve_app.engines.options import NullEngineOptions

    args.started_options = NullEngineOptions(**engine_options(args)).model_dump()
    t0 = time.perf_counter()
    res = {"command": " ".join(sys.argv), "streams": args.streams, "tokens": args.tokens, "step_ms": args.step_ms,
           "rounds": args.rounds, "think_ms": args.think_ms, "set": dict(args.set), "compare": args.compare, "http_proxy": args.http_proxy,
           "stream_interval_ms": args.stream_interval_ms, "consumer": args.consumer, "clients": args.clients,
           "access_log": args.access_log,
           "paths": {}}
    for path in args.paths:
        res["paths"][path] = asyncio.run(run_engine(args)) if path == "engine" else run_stack(args)
        save_json(args.out, res)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    save_json(args.out, res)
    print_table(res)


def arm_means(loads: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for arm in dict.fromkeys(r["arm"] for r in loads):
        rs = [r for r in loads if r["arm"] == arm]
        out[arm] = {k: statistics.fmean(r[k] for r in rs) for k in ("output_tok_s", "ttft_p50_ms", "ttft_p95_ms",
                                                                      "ttft_mean_ms")}
    return out


def print_table(res: dict) -> None:
    print()
    print(f"{'path':<8}{'load':<6}{'arm':<28}{'tok/s':>8}{'TTFT p50':>10}{'p95':>8}{'mean':>8}{'steps':>7}"
          f"{'client lag p99':>16}{'replica CPU/req':>17}{'child':>7}  (ms)")
    for path, pr in res["paths"].items():
        print(f"{path:<8}{'idle':<6}{'one stream':<28}{'':>8}{pr['idle_ttft_p50_ms']:>10.2f}")
        for r in pr["loads"]:
            print(f"{path:<8}{r['pair']:<6}{r['arm']:<28}{r['output_tok_s']:>8.0f}{r['ttft_p50_ms']:>10.2f}"
                  f"{r['ttft_p95_ms']:>8.2f}{r['ttft_mean_ms']:>8.2f}{r['engine_steps']:>7}"
                  f"{r['client'].get('lag_p99_ms', float('nan')):>16.2f}"
                  f"{r.get('cpu_ms_per_request', {}).get('replica', float('nan')):>17.3f}"
                  f"{r.get('cpu_ms_per_request', {}).get('engine child', float('nan')):>7.3f}")
            lg = r.get("first_token_legs")
            if lg and lg["requests"]:
                print(f"{'':<14}legs p50 ms ({lg['requests']} traced): body read {lg['parse_p50_ms']:.2f}, routing "
                      f"to the engine {lg['to_replica_p50_ms']:.2f}, engine queue {lg['engine_queue_p50_ms']:.2f} "
                      f"(p95 {lg['engine_queue_p95_ms']:.2f}), first token {lg['engine_prefill_p50_ms']:.2f}, back "
                      f"{lg['back_to_ingress_p50_ms']:.2f}; client TTFT p50 - (body + routing to first delta) "
                      f"{r['ttft_p50_ms'] - lg['parse_p50_ms'] - lg['at_ingress_p50_ms']:.2f}")
    print("\nmeans over each arm's loads: tok/s, TTFT p50 / p95 / mean ms")
    means = {path: arm_means(pr["loads"]) for path, pr in res["paths"].items()}
    for path, by_arm in means.items():
        for arm, m in by_arm.items():
            print(f"  {path:<7}{arm:<28}{m['output_tok_s']:>7.0f}  {m['ttft_p50_ms']:.2f} / {m['ttft_p95_ms']:.2f}"
                  f" / {m['ttft_mean_ms']:.2f}")
    if "engine" in means and "stack" in means:
        e, s = res["paths"]["engine"], res["paths"]["stack"]
        print(f"the stack over the engine: one idle stream {s['idle_ttft_p50_ms'] - e['idle_ttft_p50_ms']:+.2f} ms")
        for arm in means["engine"]:
            if arm in means["stack"]:
                d = {k: means["stack"][arm][k] - means["engine"][arm][k] for k in ("ttft_p50_ms", "ttft_mean_ms")}
                print(f"  under load, {arm}: TTFT p50 {d['ttft_p50_ms']:+.2f}, mean {d['ttft_mean_ms']:+.2f} ms")
    for path, by_arm in means.items():
        arms = list(by_arm)
        if len(arms) == 2:
            a, b = by_arm[arms[0]], by_arm[arms[1]]
            print(f"{path}: {arms[1]} against {arms[0]}: TTFT p50 {b['ttft_p50_ms'] - a['ttft_p50_ms']:+.2f}, "
                  f"mean {b['ttft_mean_ms'] - a['ttft_mean_ms']:+.2f} ms, tok/s "
                  f"{b['output_tok_s'] - a['output_tok_s']:+.0f}")


if __name__ == "__main__":
    main()
