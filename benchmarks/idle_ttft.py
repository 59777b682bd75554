"""One request at a time through the full stack: time to the first SSE chunk, request by request.

    python benchmarks/idle_ttft.py [--requests 60] [--ingress-replicas 4] [--stream-interval-ms 50]
                                   [--http-proxy python|haproxy] [--ingress separate|direct] [--trace] [--out FILE]

The null engine (128 tokens at 200 tok/s, a 512-token prompt of ids) behind the
app as deployed, the client on loopback. Prints every request's time in order
(a slow first request per ingress replica shows as early outliers), the
median, the median of as many requests from a bare socket client (what httpx
itself adds is the difference), and the median through a Serve handle straight
to the LLM server (no HTTP proxy, no ingress); writes JSON. With --ingress
direct the LLM server replica serves HTTP itself (server.direct_streaming).
With --trace every request is traced to a file and each client's first chunk
is split into legs (gpu_stack.first_token_breakdown): the body read and
validated in the app, the app's routing to the first delta (the engine's own
time inside it), and the rest: the client and the way to and from the app.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import (  # noqa: E402
    add_http_proxy_arg,
    add_ingress_arg,
    bare_client_ttft_s,
    free_port,
    ingress_server_keys,
    save_json,
)

PROMPT = list(range(1000, 1512))
BODY = {"model": "bench", "prompt": PROMPT, "max_tokens": 128, "stream": True}


async def first_chunk_ms(base: str, n: int) -> list[float]:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(n):
            t0, first = time.perf_counter(), None
            async with client.stream("POST", f"{base}/v1/completions", json=BODY) as r:
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - t0
            out.append(1000 * first)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--ingress-replicas", type=int, default=4)
    p.add_argument("--stream-interval-ms", type=float, default=50.0)
    add_http_proxy_arg(p)
    add_ingress_arg(p)
    p.add_argument("--trace", action="store_true", help="trace each request and split its first chunk into legs")
    p.add_argument("--out", default=str(ROOT / "results" / "idle_ttft.json"))
    args = p.parse_args()
    from cluster.launcher import select_http_proxy

    select_http_proxy(args.http_proxy)  # before Ray starts
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from benchmarks.gpu_stack import first_token_breakdown, handle_first_token_ms, wait_for_traces
    from serve_app.app import deploy
    from serve_app.config import parse_config

    trace_file = Path(tempfile.mkdtemp(prefix="idle_ttft-")) / "traces.jsonl"

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    http_port, grpc_port = free_port(), free_port()
    deploy(parse_config({
        "models": [{"name": "bench", "variants": [{"name": "stable", "weight": 100, "max_ongoing_requests": 1024,
                                                   "engine": {"backend": "null", "options": {
                                                       "num_tokens": 128, "tokens_per_s": 200, "max_model_len": 4096}}}]}],
        "server": {"host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port,
                   **ingress_server_keys(args.ingress, args.ingress_replicas),
                   "stream_interval_ms": args.stream_interval_ms},
        "rollout": {"enabled": False},
        **({"tracing": {"exporter": "file", "file_path": str(trace_file)}} if args.trace else {}),
    }))
    windows_ns = [time.time_ns()]
    times = asyncio.run(first_chunk_ms(f"http://127.0.0.1:{http_port}", args.requests))
    windows_ns.append(time.time_ns())
    bare_ms = [1000 * t for t in asyncio.run(bare_client_ttft_s(f"http://127.0.0.1:{http_port}/v1/completions",
                                                                  BODY, args.requests))]
    windows_ns.append(time.time_ns())
    handle_ms = asyncio.run(handle_first_token_ms(PROMPT, 128))
    legs = {}
    if args.trace:
        wait_for_traces(trace_file, 2 * args.requests)  # both clients' requests
        legs = {"httpx": first_token_breakdown(trace_file, windows_ns[:2]),
                "bare": first_token_breakdown(trace_file, windows_ns[1:3])}
    ray.shutdown()
    if args.ingress == "direct":
        args.ingress_replicas = 0  # no Ingress deployment
    res = {"http_proxy": args.http_proxy, "ingress": args.ingress, "ingress_replicas": args.ingress_replicas,
           "stream_interval_ms": args.stream_interval_ms, "first_chunk_ms": [round(t, 1) for t in times],
           "median_ms": statistics.median(times), "median_after_10_ms": statistics.median(times[10:]),
           "max_of_first_10_ms": max(times[:10]), "max_after_10_ms": max(times[10:]),
           "handle_median_ms": handle_ms,
           # the same path from a client that builds nothing and parses nothing: httpx's own share is the difference
           "bare_client_first_chunk_ms": [round(t, 2) for t in bare_ms],
           "bare_client_median_after_10_ms": statistics.median(bare_ms[10:]),
           "first_chunk_legs": legs}
    save_json(args.out, res)
    print(json.dumps(res["first_chunk_ms"]))
    print(f"{'HTTP proxy':<12}{'ingress':>9}{'median':>9}{'max of first 10':>17}{'max after':>11}{'handle':>9}"
          f"{'after 10: httpx':>17}{'bare client':>13}  (ms)")
    ingress = "direct" if args.ingress == "direct" else f"{args.ingress_replicas} repl"
    print(f"{args.http_proxy:<12}{ingress:>9}{res['median_ms']:>9.1f}{res['max_of_first_10_ms']:>17.1f}"
          f"{res['max_after_10_ms']:>11.1f}{handle_ms:>9.1f}{res['median_after_10_ms']:>17.2f}"
          f"{res['bare_client_median_after_10_ms']:>13.2f}")
    for client, lg in legs.items():
        whole = statistics.median(times if client == "httpx" else bare_ms)
        print(f"  {client} ({lg['requests']} traced), medians ms: first chunk {whole:.2f} = body read and validated "
              f"{lg['parse_p50_ms']:.2f} + routing to the first delta {lg['at_ingress_p50_ms']:.2f} (the engine's "
              f"queue and first token {lg['engine_queue_p50_ms'] + lg['engine_prefill_p50_ms']:.2f}) + the rest "
              f"(client, proxy, server before the app) {whole - lg['parse_p50_ms'] - lg['at_ingress_p50_ms']:.2f}")


if __name__ == "__main__":
    main()
