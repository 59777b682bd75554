"""Many paced streams through the full stack: does the serving path keep up?

    python benchmarks/stream_pacing.py [--streams 32] [--tokens-per-s 50] [--intervals-ms 0 20 50]
        [--engine-process inline separate] [--ingress separate direct]

The null engine emits each stream's tokens at a fixed rate (like a GPU decoding
a batch); the load generator holds `--streams` streams open over HTTP. For each
server.stream_interval_ms the app is redeployed and measured: tokens delivered
per second (the engine offers streams x tokens_per_s) and TTFT. Prints a table
last and writes results/stream_pacing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import (  # noqa: E402
    add_engine_process_arg,
    add_http_proxy_arg,
    add_ingress_arg,
    free_port,
    ingress_server_keys,
    print_table,
    run_load,
    save_json,
)


def replica_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) so far of the app's Serve replicas, by deployment."""
    import psutil

    out: dict[str, float] = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "-m serve_app.engines.process" in cmd:  # engine.process "separate": the engine's own process
            t = p.cpu_times()
            out["EngineProcess"] = out.get("EngineProcess", 0.0) + t.user + t.system
        for name in ("LLMServer", "Ingress"):  # with --ingress direct, LLMServer is both
            if cmd.startswith("ray::ServeReplica:pacing:" + name):
                t = p.cpu_times()
                out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens-per-s", type=float, default=50.0)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--intervals-ms", type=float, nargs="+", default=[0.0, 20.0, 50.0])
    add_http_proxy_arg(p)
    add_engine_process_arg(p, "engine.process for each interval, in this order (e.g. inline separate inline separate)")
    add_ingress_arg(p, many=True)
    p.add_argument("--out", default=str(ROOT / "results" / "stream_pacing.json"))
    args = p.parse_args()
    from cluster.launcher import select_http_proxy

    select_http_proxy(args.http_proxy)

    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from serve_app.app import build_app
    from serve_app.config import parse_config

    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
    rows = []
    for interval, engine_process, ingress in ((i, e, g) for i in args.intervals_ms for e in args.engine_process
                                              for g in args.ingress):
        cfg = parse_config({
            "models": [{"name": "null", "variants": [{"name": "stable", "max_ongoing_requests": 1024, "engine": {
                "backend": "null", "process": engine_process,
                "options": {"num_tokens": args.tokens, "tokens_per_s": args.tokens_per_s, "max_num_seqs": 1024}}}]}],
            "server": {"stream_interval_ms": interval, **ingress_server_keys(ingress, 1)},
            "rollout": {"enabled": False},
        })
        serve.run(build_app(cfg), name="pacing", route_prefix="/")
        body = {"model": "null", "prompt": "x", "max_tokens": args.tokens}
        cpu0 = replica_cpu_s()
        r = asyncio.run(run_load(f"http://127.0.0.1:{port}/v1/completions", body, args.streams,
                                 max_requests=100_000, max_duration_s=args.duration_s, stream=True,
                                 warmup_requests=2))
        s = r.summary()
        cpu1 = replica_cpu_s()
        # CPU per token of each serving process: what decides how many streams a replica can carry,
        # whatever share of this machine the load generator takes
        per_1k = {f"{k}_cpu_ms_per_1k_tok": 1e6 * (cpu1[k] - cpu0.get(k, 0.0)) / max(1, r.output_tokens)
                  for k in cpu1}
        offered = args.streams * args.tokens_per_s
        rows.append({"http_proxy": args.http_proxy, "ingress": ingress, "engine_process": engine_process,
                     "stream_interval_ms": interval, "streams": args.streams, "offered_tok_s": offered,
                     "delivered_tok_s": s["output_tok_s"], "delivered_pct": 100 * s["output_tok_s"] / offered,
                     "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p95_ms": s["ttft_p95_ms"],
                     # a request's whole stream: the engine's num_tokens / tokens_per_s plus what serving adds
                     "e2e_p50_ms": s["p50_ms"], "engine_ms": 1000 * args.tokens / args.tokens_per_s,
                     "errors": s["errors"],
                     **per_1k})
        print(json.dumps(rows[-1]), flush=True)
    serve.shutdown()
    ray.shutdown()
    save_json(args.out, rows)
    print()
    print_table(rows, ["http_proxy", "ingress", "engine_process", "stream_interval_ms", "streams", "offered_tok_s", "delivered_tok_s", "delivered_pct",
                       "ttft_p50_ms", "ttft_p95_ms", "e2e_p50_ms", "engine_ms", "errors", "LLMServer_cpu_ms_per_1k_tok",
                       "Ingress_cpu_ms_per_1k_tok", "EngineProcess_cpu_ms_per_1k_tok"])


if __name__ == "__main__":
    main()
