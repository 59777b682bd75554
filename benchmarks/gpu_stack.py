"""The full stack on a GPU: Ray Serve (ingress + one LLMServer replica in its own
placement group) with the OpenAI HTTP API, driven over loopback with the same
load as benchmarks/gpu_engine.py, so the two can be compared.

    python benchmarks/gpu_stack.py --tokenizer DIR [--out DIR]

Needs Ray on the machine (benchmarks/ray_bundle.py builds a bundle for the
device). Reuses the random 7B model directory gpu_engine.py built in the same
call. If gpu_engine.json is in --out, prints the stack against it: throughput
ratio (target >= 95 %) and TTFT p50 added (target <= 5 ms). With
--model/--device cpu it runs the same path on the CPU (a check of the script).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serve_app import gcpause  # noqa: E402
from benchmarks.gpu_engine import (  # noqa: E402
    ENGINE_COUNTERS, WARM_PROMPT_SEED, _option, bench_options, compare_tag, concurrent_load, gap_line,
    gpu_budget_line, live_compare, pass_line, prompt_draw, think_line)
from serve_app.engines.launch_timing import pass_times_delta  # noqa: E402
from benchmarks.loadgen import (  # noqa: E402
    add_access_log_arg,
    add_engine_process_arg,
    add_http_proxy_arg,
    add_ingress_arg,
    add_user_code_loop_arg,
    BareClient,
    bare_client_ttft_s,
    free_port,
    ingress_server_keys,
    percentile,
    TCP_COUNTERS,
    tcp_counters,
    tcp_counters_delta,
)

ADMIN_TOKEN = "gpu-stack-bench"


def stream_body(model: str, prompt: list[int], out_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


# httpcore's trace events (httpx's "trace" request extension) that split a request's way to its response
# headers: a new connection, the request on the wire, the headers back
CLIENT_LEG_EVENTS = {"connection.connect_tcp.complete": "connected",
                     "http11.send_request_body.complete": "sent",
                     "http11.receive_response_headers.complete": "headers"}


def client_legs(t0: float, seen: dict) -> dict:
    """``sent_s`` (from the call to the request written: the client's own work, a wait for a pooled
    connection, a connect) and ``headers_s`` (from then to the response's headers: the proxy, the
    replica's server and handler up to its first send, which for a stream carries its first chunk, so the
    engine's first token too), and whether a connection was opened for it."""
    out = {"new_connection": "connected" in seen}
    if "sent" in seen:
        out["sent_s"] = seen["sent"] - t0
        if "headers" in seen:
            out["headers_s"] = seen["headers"] - seen["sent"]
    return out


async def http_one(client, url: str, model: str, prompt: list[int], out_tokens: int) -> dict:
    body = stream_body(model, prompt, out_tokens)
    seen: dict[str, float] = {}

    async def trace(event: str, info: dict) -> None:  # httpcore's events: where a slow first token waited
        if event in CLIENT_LEG_EVENTS:
            seen[CLIENT_LEG_EVENTS[event]] = time.perf_counter()

    t0 = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url, json=body, extensions={"trace": trace}) as r:
        legs = client_legs(t0, seen)
        if r.status_code != 200:
            await r.aread()
            return {"ttft_s": None, "tokens": 0, "status": r.status_code}
        # parse as little as possible: 64 streams of ~100 tokens/s each must not make the client the bottleneck
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if line.startswith('data: {"error"'):
                return {"ttft_s": None, "tokens": 0, "status": 500}
            if first is None:
                first = time.perf_counter() - t0
            if '"completion_tokens"' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    # an SSE chunk carries text (textless tokens send none): this is gpu_engine's ttft_text
    return {"ttft_s": first, "ttft_text_s": first, "e2e_s": time.perf_counter() - t0, "tokens": tokens, **legs}


def replica_handle():
    """A Serve handle to the one LLMServer replica (with direct streaming, the deployment hosting it)."""
    from ray import serve

    from serve_app.app import APP_NAME, llm_deployment_name

    return serve.get_deployment_handle(llm_deployment_name("bench", "stable"), APP_NAME)


async def handle_first_token_ms(prompt: list[int], out_tokens: int, n: int = 5) -> float:
    """Median time to the first delta when the driver calls the LLMServer replica through a Serve
    handle (one Ray hop, no HTTP proxy, no ingress): splits the stack's first-token overhead
    into replica + engine vs proxy + ingress."""
    from serve_app.internal import Delta, InferenceRequest

    h = replica_handle()
    xs = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        gen = h.options(stream=True).generate.remote(InferenceRequest(
            request_id=f"hop-{i}", model="bench", prompt_token_ids=prompt, max_tokens=out_tokens, temperature=0,
            ignore_eos=True))
        first = None
        async for wire in gen:
            d = Delta.from_wire(wire)
            if first is None and d.text:  # like an HTTP client: the first delta with text
                first = time.perf_counter() - t0
        if i:  # the first call also sets up the handle
            xs.append(first)
    return 1000 * statistics.median(xs)


class ClientLag:
    """How late this client's own event loop wakes from a 1 ms sleep, the share of a core its process
    uses and its own garbage-collector pauses, over one load: what the client adds to the TTFT it measures
    (one Python process drives every stream), so the stack is not charged for it.

    Entering collects and freezes what the process holds so far (Ray's driver, earlier loads' records), as
    gpu_engine.py does once and Ray Serve does in each replica: on machines AD, AE and AF the sixth load of
    every run (the second set's 64 x 10) had the client's loop stall for 187-222 ms once, which a full
    collection of a growing heap explains, and then every stream in flight read its token that late."""

    def __init__(self):
        self._lags_s: list[float] = []
        self._task = None
        self._gc = None

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self._lags_s.append(time.perf_counter() - t - 0.001)

    def __enter__(self):
        gc.collect()
        gc.freeze()
        self._gc = gcpause.GcPauses()  # this load's own collections
        gc.callbacks.append(self._gc.callback)
        self._lags_s.clear()
        self._cpu0, self._t0 = time.process_time(), time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()
        gc.callbacks.remove(self._gc.callback)
        self.summary = {
            "cpu_share": (time.process_time() - self._cpu0) / max(1e-9, time.perf_counter() - self._t0),
            **{f"lag_p{q}_ms": 1000 * percentile(self._lags_s, q) for q in (50, 99)},
            "lag_max_ms": 1000 * max(self._lags_s, default=0.0),
            "gc_collections": list(self._gc.count),
            "gc_pause_max_ms": list(self._gc.max_ms),
        }


async def engine_counters(h) -> dict:
    """The replica engine's counters now (ENGINE_COUNTERS), and its passes' GPU time by kind (``gpu_pass_ms``),
    through a Serve handle."""
    s = await h.stats.remote()
    return {**{c: s.get(c) or 0 for c in ENGINE_COUNTERS}, "gpu_pass_ms": s.get("gpu_pass_ms") or {}}


async def drive(base: str, model: str, args, checkpoint=lambda part: None, started_options: dict | None = None) -> dict:
    """The loads through the HTTP API, then again under each of ``args.compare``'s option changes, made on the
    live replica and undone after (back to ``started_options``, the values it started with), then again from
    each further client of ``args.clients``; ``checkpoint`` gets what is measured so far after each load."""
    import httpx

    prompt, rng = prompt_draw(args.prompt)
    url = f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    out = {}
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await http_one(client, url, model, prompt(), 4)  # connection and first-request warm-up
        singles = [await http_one(client, url, model, prompt(), args.output) for _ in range(3)]
        steps = sorted((r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in singles)
        out["single"] = {"decode_step_ms": 1000 * steps[1],
                         "ttft_ms": 1000 * sorted(r["ttft_s"] for r in singles)[1],
                         "ttft_via_handle_ms": await handle_first_token_ms(prompt(), args.output),
                         # the same requests from a client that builds and parses nothing: what httpx adds
                         "ttft_bare_client_ms": 1000 * statistics.median(
                             await bare_client_ttft_s(url, stream_body(model, prompt(), args.output), 5))}
        if args.warm_rounds:
            await concurrent_load(lambda i, p: http_one(client, url, model, p, args.output), 64,
                                  *prompt_draw(args.prompt, WARM_PROMPT_SEED), args.warm_rounds)
        h = replica_handle()
        bare = BareClient(url)

        def sender(client_name: str, conc: int):
            if client_name == "bare":  # request k of concurrent_load is stream k % conc's: its own connection
                return lambda k, p: bare.send(k % conc, stream_body(model, p, args.output))
            return lambda k, p: http_one(client, url, model, p, args.output)

        async def load(key: str, conc: int, rounds: int, client_name: str = args.clients[0]) -> None:
            before = await engine_counters(h)
            tcp_before = tcp_counters()
            t0_ns = time.time_ns()
            with ClientLag() as lag:
                out[key] = await concurrent_load(sender(client_name, conc), conc, prompt, rng, rounds,
                                                 think_ms=args.think_ms)
            out[key]["window_ns"] = [t0_ns, time.time_ns()]
            out[key]["tcp"] = tcp_counters_delta(tcp_before, tcp_counters())
            out[key]["client"] = lag.summary
            await asyncio.sleep(0.2)  # an engine in its own process sends its counters with its outputs, <= 50 ms
            after = await engine_counters(h)
            out[key].update({c: after[c] - before[c] for c in ENGINE_COUNTERS})
            out[key]["gpu_pass"] = pass_times_delta(before["gpu_pass_ms"], after["gpu_pass_ms"])
            checkpoint(out)

        for key, conc, rounds, _ in loads(args):
            await load(key, conc, rounds)
        for change in args.compare:
            tag = compare_tag(change)
            out.setdefault("compare_tags", []).append(tag)
            out.setdefault("compare_applied", {})[tag] = await h.update_engine_options.remote(change)
            for key, conc, rounds, _ in loads(args):
                await load(f"{key}_{tag}", conc, rounds)
            await h.update_engine_options.remote({k: (started_options or {})[k] for k in change})
        out["clients"] = args.clients
        for i, client_name in enumerate(args.clients[1:], 1):
            tag = f"client_{client_name}_{i}"  # the i-th arm: a client may come back (httpx bare httpx)
            out.setdefault("client_tags", []).append(tag)
            for key, conc, rounds, _ in loads(args):
                await load(f"{key}_{tag}", conc, rounds, client_name)
        bare.close()
    return out


def loads(args) -> list[tuple[str, int, int, str]]:
    """(result key, streams, requests per stream, label) of each load, in the order they run: one per
    --concurrency, then --steady-rounds' longer 64-stream load (gpu_engine.py's of the same key)."""
    out = [(f"concurrency_{conc}", conc, 3, f"at {conc}") for conc in args.concurrency]
    if args.steady_rounds:
        out.append(("concurrency_64_steady", 64, args.steady_rounds, f"at 64, {args.steady_rounds}/stream"))
    return out


def wait_for_traces(trace_file: Path, requests: int, timeout_s: float = 60.0) -> None:
    """Until the trace file holds ``requests`` requests' spans from both their ingress (the span with the first
    delta's event) and their replica (``engine.prefill``), or the timeout: the two tracer providers' exporters
    write on their own schedules."""
    from serve_app.trace_top import read_spans

    def written() -> bool:
        spans = read_spans(trace_file) if trace_file.exists() else []
        return min(sum(1 for sp in spans if sp.name == "engine.prefill"),
                   sum(1 for sp in spans if "seekserve.first_chunk" in sp.events)) >= requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not written():
        time.sleep(1)


def first_token_breakdown(trace_file: Path, window_ns: list[int]) -> dict:
    """Median and p95 (ms) of each leg of the first token's path, over the requests whose ingress span
    started in the window: the request's body read and validated (from the app's receipt to the routing:
    ``parse``), routing -> replica (Serve's router and one Ray hop, none with direct streaming), the
    engine's queue, its prefill, replica -> ingress (the first delta's way back); ``at_ingress`` is the
    routing to the first delta. The client's TTFT minus ``parse`` and ``at_ingress`` is the HTTP path's
    share outside the app (the client's own work, the proxy, the server before the app's middleware)."""
    from serve_app.trace_top import build_trees, read_spans

    legs: dict[str, list[float]] = {"parse": [], "to_replica": [], "engine_queue": [], "engine_prefill": [],
                                     "back_to_ingress": [], "at_ingress": []}
    for root in build_trees(read_spans(trace_file)):
        first = root.events.get("seekserve.first_chunk")
        gen = next((c for c in root.children if c.name == "llm_server.generate"), None)
        route = next((c for c in root.children if c.name == "router.route"), None)
        if first is None or gen is None or route is None or not window_ns[0] <= root.start_ns <= window_ns[1]:
            continue
        kids = {c.name: c for c in gen.children}
        if "engine.queue" not in kids or "engine.prefill" not in kids:
            continue
        routed_ns = route.start_ns  # the span starts earlier, at the receipt (at the routing before 2026-12-05)
        for leg, ns in (("parse", routed_ns - root.start_ns),
                        ("to_replica", gen.start_ns - routed_ns),
                        ("engine_queue", kids["engine.queue"].duration_ns),
                        ("engine_prefill", kids["engine.prefill"].duration_ns),
                        ("back_to_ingress", first - kids["engine.prefill"].end_ns),
                        ("at_ingress", first - routed_ns)):
            legs[leg].append(ns / 1e6)
    from benchmarks.loadgen import percentile

    return {"requests": len(legs["at_ingress"]),
            **{f"{leg}_p50_ms": percentile(xs, 50) for leg, xs in legs.items()},
            **{f"{leg}_p95_ms": percentile(xs, 95) for leg, xs in legs.items()}}


def engine_process_resolved(res: dict) -> str:
    """What the layout was ("auto" picks one in the replica): only the engine's own process has a pid."""
    return "separate" if (res.get("warm_up") or {}).get("engine_process_pid") else "inline"


def arm_suffix(proxy: str, engine_process: str, ingress: str, user_code_loop: str = "separate") -> str:
    """The file-name part of one arm: each setting away from the first runs' default names itself."""
    return "".join(f"_{v}" for v, default in ((proxy, "python"), (engine_process, "inline"), (ingress, "separate"),
                                                (user_code_loop, "separate")) if v != default)


def run_stack(args, proxy: str, opts: dict, gpus: int, engine_process: str = "inline",
              ingress: str = "separate", user_code_loop: str = "separate") -> dict:
    """Start Ray with `proxy` as Serve's HTTP data path, deploy (the engine in the replica's process or
    in its own, `engine_process`; an Ingress deployment in front or the replica serving HTTP itself,
    `ingress`; our code on Serve's user-code thread or the replica's main loop, `user_code_loop`), drive
    the loads, stop Ray."""
    from cluster.launcher import select_http_proxy

    select_http_proxy(proxy)  # before Ray starts: Serve's controller reads it once
    import httpx
    import ray
    from ray import serve

    from serve_app.app import deploy
    from serve_app.config import parse_config

    res: dict = {"http_proxy": proxy, "engine_process": engine_process, "stream_interval_ms": args.stream_interval_ms,
                 "access_log": args.access_log,
                 "ingress": ingress, "ingress_replicas": 0 if ingress == "direct" else args.ingress_replicas,
                 "engine_options_set": dict(args.set)}
    trace_file = Path(args.work) / f"traces{arm_suffix(proxy, engine_process, ingress, user_code_loop)}.jsonl"
    trace_file.unlink(missing_ok=True)
    ray.init(num_cpus=max(4, os.cpu_count() or 4), num_gpus=gpus, include_dashboard=False, log_to_driver=True)
    http_port, grpc_port = free_port(), free_port()
    config = parse_config({
        "models": [{"name": "bench", "variants": [{
            "name": "stable", "weight": 100, "engine": {"backend": "hf", "options": opts, "process": engine_process},
            "resources": {"num_cpus": 1, "num_gpus": gpus},
            "max_ongoing_requests": 1024,
        }]}],
        "server": {"host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port,
                   "ingress_max_ongoing_requests": 4096, **ingress_server_keys(ingress, args.ingress_replicas),
                   "stream_interval_ms": args.stream_interval_ms, "user_code_loop": user_code_loop,
                   "access_log": args.access_log == "on"},
        "rollout": {"enabled": False},
        **({"tracing": {"exporter": "file", "file_path": str(trace_file)}}
           if args.trace else {}),
    })
    # the file names and the report say what ran, not 'auto'
    res["user_code_loop"] = user_code_loop = config.server.effective_user_code_loop()
    t0 = time.perf_counter()
    deploy(config)  # the operator's path: capacity check, Serve start, placement group per replica
    res["deploy_ready_s"] = time.perf_counter() - t0
    base = f"http://127.0.0.1:{http_port}"
    stats = httpx.get(f"{base}/admin/engine-stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                      timeout=60).json()
    res["placement"] = stats["bench/stable"].get("placement")
    res["warm_up"] = stats["bench/stable"].get("warm_up")

    def checkpoint(part: dict) -> None:
        # a call cut short by its time limit still leaves the deploy and the loads done (gpu_engine.py saves so
        # too): on 2026-12-04 a cold deploy that compiled for 7 minutes left nothing
        partial = Path(args.out) / f"gpu_stack_partial_{proxy}_{engine_process}_{ingress}_{user_code_loop}.json"
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({**res, **part, "partial": True}, indent=2))

    checkpoint({})
    from serve_app.engines.registry import options_model_for

    started = options_model_for("hf").model_validate(opts).model_dump()  # what a compare's change is undone to
    res.update(asyncio.run(drive(base, "bench", args, checkpoint, started)))
    stats = httpx.get(f"{base}/admin/engine-stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                      timeout=60).json()["bench/stable"]
    res["engine_forward_passes"] = stats.get("forward_passes")
    res["engine_prefill_passes"] = stats.get("prefill_passes")
    res["engine_prefill_graph_passes"] = stats.get("prefill_graph_passes")  # one-prompt passes replayed
    res["engine_mixed_passes"] = stats.get("mixed_passes")  # one prompt and a decode step in one captured pass
    res["replica_gc"] = stats.get("gc")  # the LLM server process's collections since its constructor
    res["engine_process_gc"] = stats.get("engine_process_gc")  # with --engine-process separate
    res["warm_up"] = stats.get("warm_up")
    res["engine_process_resolved"] = engine_process_resolved(res)
    # before Serve's shutdown: on 2026-12-04 (run 74) it outlasted the call's limit, and the loads were only in
    # a partial file without these stats
    checkpoint({})
    if args.trace:
        time.sleep(2)  # the replicas' span processors export every 0.5 s
    serve.shutdown()
    ray.shutdown()
    if args.trace:
        for key, *_ in loads(args):
            res[key]["first_token_legs"] = first_token_breakdown(trace_file, res[key]["window_ns"])
    return res


def with_compare(res: dict, tag: str) -> dict:
    """``res`` with the loads run under the compare ``tag`` in the default loads' places."""
    suffix = f"_{tag}"
    return {**res, **{k[: -len(suffix)]: v for k, v in res.items() if k.endswith(suffix)}}


def client_gc_text(cl: dict) -> str:
    """The client's full collections in one load, where the file records them (files before ClientLag's
    collect-and-freeze do not)."""
    if "gc_collections" not in cl:
        return ""
    return f"; its full collections {cl['gc_collections'][2]}, longest {cl['gc_pause_max_ms'][2]:.1f} ms"


def legs_text(legs: dict) -> str:
    """A load's client legs (gpu_engine.client_legs_summary) on one line."""
    return (f"request written p50 / p99 / max {legs['sent_p50_ms']:.2f} / {legs['sent_p99_ms']:.2f} / "
            f"{legs['sent_max_ms']:.1f} ms, then response headers {legs['headers_p50_ms']:.2f} / "
            f"{legs['headers_p99_ms']:.2f} / {legs['headers_max_ms']:.1f} ms; {legs['new_connections']} connections opened")


def tcp_text(tcp: dict) -> str:
    """The host's TCP counters over a load (loadgen.tcp_counters), in TCP_COUNTERS' order."""
    return ", ".join(f"{k} {tcp[k]}" for names in TCP_COUNTERS.values() for k in names if k in tcp)


def ttft_spread(load: dict) -> tuple | None:
    """TTFT p25, p50, p75 over a load's requests, and the p50 of those started after its first wave's last
    arrival, from its per-request records (ms; None where the file has none)."""
    records = load.get("per_request")
    if not records:
        return None
    ttft = [r[1] for r in records]
    later = [r[1] for r in records if r[0] > load.get("first_wave_last_arrival_s", 0.0)]
    return (*(percentile(ttft, q) for q in (25, 50, 75)), percentile(later, 50) if later else float("nan"))


def ttft_mean_ms(load: dict) -> float | None:
    """A load's mean TTFT from its per-request records (ms; None where the file has none). The engine's records
    hold its first token, which is its first text for the benchmark's model (gpu_engine's TTFT rows)."""
    records = load.get("per_request")
    return sum(r[1] for r in records) / len(records) if records else None


def print_loads(res: dict, alone: dict | None, args) -> None:
    """The rows of each load: the stack's figures against the engine alone's."""
    for key, _, _, at in loads(args):
        c = res[key]
        a = (alone or {}).get(key, {})
        # the two runs compare only on one arrival schedule (engine files before 2026-12-03 lack the field)
        # and on one pause between requests (files before --think-ms have none: no pause)
        same = (a.get("first_wave_last_arrival_s") == c.get("first_wave_last_arrival_s")
                and a.get("think_ms", 0.0) == c.get("think_ms", 0.0))
        ratio = (f"  {100 * c['output_tok_s'] / a['output_tok_s']:.0f} % of engine (>= 95 %)"
                 + ("" if same else "; other arrival schedule: not comparable")) if a else ""
        print(f"{f'output tok/s {at}':<34}{c['output_tok_s']:>10.0f}{a.get('output_tok_s', float('nan')):>10.0f}"
              f"{ratio}")
        fw, afw = c.get("full_window") or {}, a.get("full_window") or {}
        if fw:
            fw_ratio = f"  {100 * fw['output_tok_s'] / afw['output_tok_s']:.0f} %" if afw else ""
            print(f"{'  with all streams in flight':<34}{fw['output_tok_s']:>10.0f}"
                  f"{afw.get('output_tok_s', float('nan')):>10.0f}{fw_ratio}")
        print(f"{'  first wave ends at (s)':<34}{c.get('first_wave_last_arrival_s', float('nan')):>10.2f}"
              f"{a.get('first_wave_last_arrival_s', float('nan')):>10.2f}")
        # both columns to the first text: an HTTP client gets no chunk for a token without text
        added = f"  {c['ttft_p50_ms'] - a['ttft_text_p50_ms']:+.1f} ms (<= 5 ms)" if a.get("ttft_text_p50_ms") else ""
        print(f"{f'TTFT p50 {at} (ms)':<34}{c['ttft_p50_ms']:>10.1f}"
              f"{a.get('ttft_text_p50_ms', float('nan')):>10.1f}{added}")
        print(f"{f'TTFT p95 {at} (ms)':<34}{c['ttft_p95_ms']:>10.1f}"
              f"{a.get('ttft_text_p95_ms', float('nan')):>10.1f}")
        spread = [ttft_spread(r) for r in (c, a)]
        if all(spread):
            # the TTFTs have two humps (admitted in the next pass, or behind several-prompt passes), so a median
            # moves several ms between runs: its neighbours and the requests after the first wave say more
            print("  TTFT p25 / p50 / p75, after the first wave p50 (ms): "
                  + "; ".join(f"{who} {' / '.join(f'{v:.1f}' for v in sp)}" for who, sp in zip(("stack", "engine"), spread)))
        means = [ttft_mean_ms(r) for r in (c, a)]
        if all(m is not None for m in means):
            # a median between the humps moves 10-25 ms when a few per cent of requests change hump (runs 133-136);
            # the mean says what the stack costs a request on average
            print(f"  TTFT mean (ms): stack {means[0]:.1f}, engine {means[1]:.1f} ({means[0] - means[1]:+.1f} ms)")
        if c.get("client"):
            cl = c["client"]
            print(f"  the client's own loop: late by p50 / p99 / max {cl['lag_p50_ms']:.2f} / {cl['lag_p99_ms']:.2f} / "
                  f"{cl['lag_max_ms']:.1f} ms, {100 * cl['cpu_share']:.0f} % of a core"
                  + client_gc_text(cl))
        if c.get("client_legs"):
            print(f"  the client's legs: {legs_text(c['client_legs'])}")
        if c.get("tcp"):
            print(f"  TCP during the load: {tcp_text(c['tcp'])}")
        if c["failed"]:
            print(f"  {c['failed']} requests failed")
        legs = c.get("first_token_legs")
        if legs:
            print(f"  first token's legs, p50 / p95 ms ({legs['requests']} traced requests):")
            for leg in ("parse", "to_replica", "engine_queue", "engine_prefill", "back_to_ingress", "at_ingress"):
                if f"{leg}_p50_ms" in legs:  # raw files before the parse leg have none
                    print(f"    {leg:<30}{legs[f'{leg}_p50_ms']:>10.1f}{legs[f'{leg}_p95_ms']:>10.1f}")
        for who, r in (("stack", c), ("engine", a)):
            if gap_line(r):
                print(f"  GPU between passes, {who}: {gap_line(r)}")
            if pass_line(r):
                print(f"  GPU per pass, {who}: {pass_line(r)}")
                print(f"  GPU time by pass family, {who}: {gpu_budget_line(r)}")


def print_report(res: dict, alone: dict | None, args) -> None:
    front = ("no Ingress: the LLMServer replica serves HTTP (direct streaming)" if res.get("ingress") == "direct"
             else f"{res['ingress_replicas']} ingress replicas")
    loop = res.get("user_code_loop", "separate")  # files before 2026-12-04's sixteenth session: Serve's default
    print(f"\nfull stack (Ray Serve, OpenAI HTTP via its {res['http_proxy']} proxy, engine "
          f"{'in its own process' if res['engine_process_resolved'] == 'separate' else 'in the replica process'}, streaming; "
          f"{front}, stream_interval_ms {args.stream_interval_ms:g}, our code on "
          f"{'the replica main loop' if loop == 'shared' else 'Serve user-code thread'}); "
          f"ready after {res['deploy_ready_s']:.1f} s; placement {res['placement']}")
    if (alone or {}).get("engine_process") == "separate":
        print("engine column: the engine alone in a process of its own, driven from the benchmark's (gpu_engine.py "
              "--engine-process separate)")
    think = think_line(res)
    if think:
        print(think)
    if (res.get("warm_up") or {}).get("compile_cache"):  # whether the replica's compiles found the disk caches warm
        print(f"compile caches at ready: {res['warm_up']['compile_cache']}")
    if res.get("client_tags"):
        print(f"the loads' client: {res['clients'][0]} (then the others below)")
    print(f"{'measure':<34}{'stack':>10}{'engine':>10}  target")
    print_loads(res, alone, args)
    for tag in res.get("compare_tags", []):
        # the engine column only from the engine's own loads under the same change
        paired = alone is not None and any(k.endswith(f"_{tag}") for k in alone)
        print(f"with {tag}, changed on the live replica"
              + ("" if paired else " (the engine file has no loads under it: no engine column)") + ":")
        print_loads(with_compare(res, tag), with_compare(alone, tag) if paired else None, args)
    for tag in res.get("client_tags", []):
        print(f"from the {tag.split('_')[1]} client, the same deployment, the same engine column:")
        print_loads(with_compare(res, tag), alone, args)
    if res.get("engine_prefill_passes") is not None:
        w = res.get("warm_up") or {}
        about = f"{w.get('prefill_graphs', 0)} graphs captured in {w.get('prefill_graph_capture_s') or 0:.1f} s"
        if w.get("prefill_graph_gb") is not None:
            about += f", {w['prefill_graph_gb']:.2f} GB"
        if w.get("prefill_graph_error"):
            about += f"; {w['prefill_graph_error']}"
        print(f"{'prefill passes / one-prompt replayed':<34}{res['engine_prefill_passes']:>10d}"
              f"{res.get('engine_prefill_graph_passes') or 0:>10d}  (whole run; {about})")
    s = res["single"]
    print(f"{'single-stream decode step (ms)':<34}{s['decode_step_ms']:>10.2f}"
          f"{(alone or {}).get('single', {}).get('decode_step_ms', float('nan')):>10.2f}")
    print(f"{'single-stream TTFT, first text (ms)':<34}{s['ttft_ms']:>10.1f}"
          f"{(alone or {}).get('single', {}).get('ttft_text_ms', float('nan')):>10.1f}"
          f"  (driver -> replica handle, no proxy/ingress: {s['ttft_via_handle_ms']:.1f}"
          + (f"; bare socket client: {s['ttft_bare_client_ms']:.1f}" if "ttft_bare_client_ms" in s else "") + ")")
    g = res.get("replica_gc") or {}
    if g:
        print(f"{'replica GC full collections':<34}{g['collections'][2]:>10d}  longest {g['pause_max_ms'][2]:.1f} ms, "
              f"{g['pause_total_ms'][2]:.0f} ms in all; young: {sum(g['collections'][:2])} collections, "
              f"{sum(g['pause_total_ms'][:2]):.0f} ms (the first full one is Ray Serve's startup collect + freeze)")
    g = res.get("engine_process_gc") or {}
    if g:
        print(f"{'engine process GC full collections':<34}{g['collections'][2]:>10d}  longest {g['pause_max_ms'][2]:.1f} ms; "
              f"young: {sum(g['collections'][:2])} collections, {sum(g['pause_total_ms'][:2]):.0f} ms "
              f"({g['frozen_objects']} objects frozen after its start)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", help="tokenizer directory for the random 7B model")
    p.add_argument("--work", default="/tmp/seekserve-bench")
    p.add_argument("--model", default=None, help="serve this model instead of the random 7B (e.g. embedded:...)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--max-positions", type=int, default=None,
                   help="the random 7B's max_position_embeddings, as gpu_engine.py's (with --set max_model_len=8192)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--stream-interval-ms", type=float, default=50.0,
                   help="server.stream_interval_ms: tokens after the first merged at most once per interval")
    p.add_argument("--ingress-replicas", type=int, default=4, help="server.ingress_replicas")
    p.add_argument("--set", action="append", default=[], type=_option, metavar="KEY=JSON",
                   help="an engine option over the benchmark's own, e.g. --set compile_decode=false")
    p.add_argument("--compare", action="append", default=[], type=live_compare(), metavar="KEY=JSON[,KEY=JSON]",
                   help="after the loads, the same loads again with these engine options changed on the live "
                        "replica, then changed back (repeatable): options the engine reads while it runs, e.g. "
                        "launch_lead_ms=1; each prints against gpu_engine.py's loads under the same --compare")
    p.add_argument("--trace", action="store_true",
                   help="trace every request to a file and split each load's first token into its legs")
    p.add_argument("--clients", nargs="+", choices=("httpx", "bare"), default=["httpx"],
                   help="the loads' HTTP client: httpx (as the openai package), or loadgen's bare socket client, "
                        "which builds and parses next to nothing; several: the loads again from each, on the same "
                        "deployment after the first's (and its --compare), e.g. httpx bare httpx")
    add_http_proxy_arg(p, many=True)  # both: the second compile reuses Inductor's cache (below)
    add_engine_process_arg(p, "engine.process: the engine in the replica's process, in a child process of its "
                              "own, what 'auto' picks (the child on a GPU), or several one after the other "
                              "(each with every --http-proxy)", default="auto")
    add_ingress_arg(p, many=True)  # several: each with every --http-proxy and --engine-process
    add_user_code_loop_arg(p, many=True)  # several: each with every other arm
    add_access_log_arg(p)
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="as gpu_engine.py's: each stream's mean pause before each request after its first "
                        "(0: the closed loop, the targets' load)")
    p.add_argument("--steady-rounds", type=int, default=0,
                   help="requests per stream of a longer 64-concurrent load after the others (0: none), "
                        "against gpu_engine.py's of the same name")
    p.add_argument("--warm-rounds", type=int, default=1,
                   help="requests per stream of a 64-concurrent load run and discarded before the measured ones, "
                        "as gpu_engine.py's (0: none, as every run before 2026-12-04's fourteenth session)")
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "results")))
    p.add_argument("--report", nargs="+", metavar="STACK_JSON",
                   help="run nothing: print the table of these raw stack files against --engine-json (the "
                        "load flags must be the run's, e.g. --steady-rounds 10)")
    p.add_argument("--engine-json", help="with --report: gpu_engine.py's raw file of the same machine")
    p.add_argument("--engine-compare", metavar="TAG",
                   help="with --report: the engine's loads under one of its --compare changes, e.g. "
                        "slots.prefill_graphs=false, instead of its defaults")
    args = p.parse_args()
    if args.report:
        alone = json.loads(Path(args.engine_json).read_text()) if args.engine_json else None
        if alone and args.engine_compare:
            alone = with_compare(alone, args.engine_compare)
        for f in args.report:
            res = json.loads(Path(f).read_text())
            res.setdefault("engine_process_resolved", engine_process_resolved(res))  # a partial file lacks it
            # the header's settings are the run's own
            args.stream_interval_ms = res["stream_interval_ms"]
            print_report(res, alone, args)
        return
    os.environ["SEEKSERVE_ADMIN_TOKEN"] = ADMIN_TOKEN  # Ray workers inherit the driver's environment
    # one Inductor cache for every Ray this run starts, so a second deployment's compile hits it
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.work) / "inductor"))

    opts, build_s = bench_options(args.work, args.tokenizer, args.model, args.device, max_positions=args.max_positions)
    opts.update(dict(args.set))
    gpus = 1 if args.device == "cuda" else 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "".join(f"_{k}" for k, _ in args.set)
    alone_path = out / "gpu_engine.json"
    alone = json.loads(alone_path.read_text()) if alone_path.exists() else None
    results = []
    arms = [(proxy, engine_process, ingress, loop) for loop in args.user_code_loop for proxy in args.http_proxy
            for engine_process in args.engine_process for ingress in args.ingress]
    for proxy, engine_process, ingress, loop in arms:
        res = run_stack(args, proxy, opts, gpus, engine_process, ingress, loop)
        res["build_model_s"] = build_s
        # the Python proxy's inline file with an Ingress keeps the name earlier runs used
        (out / f"gpu_stack{tag}{arm_suffix(proxy, engine_process, ingress, res['user_code_loop'])}.json").write_text(
            json.dumps(res, indent=2))
        results.append(res)
    for res in results:
        print_report(res, alone, args)


if __name__ == "__main__":
    main()
