"""Serving-path overhead: the full stack (HTTP proxy -> ingress -> LLMServer) on the
`null` engine vs. calling the same engine directly, at concurrency 1 and 32.

    python benchmarks/serve_overhead.py [--duration-s 20] [--tokens 16] [--cold-start]

Loopback only; each run is bounded by a request count and a duration. Prints a
table last and writes results/serve_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import (  # noqa: E402
    add_http_proxy_arg,
    add_user_code_loop_arg,
    free_port,
    percentile,
    print_table,
    run_load,
    save_json,
)


async def engine_direct(concurrency: int, n_tokens: int, max_requests: int, duration_s: float) -> dict:
    from serve_app.engines.base import GenerationRequest, SamplingParams
    from serve_app.engines.registry import create_engine

    eng = create_engine("null", {"num_tokens": n_tokens, "tokens_per_s": 0, "max_num_seqs": 1024})
    await eng.start()
    lat = []
    issued = 0
    deadline = time.monotonic() + duration_s

    async def worker(w):
        nonlocal issued
        while issued < max_requests and time.monotonic() < deadline:
            issued += 1
            t0 = time.perf_counter()
            ids = eng.encode_chat([{"role": "user", "content": "hi"}])
            async for _ in eng.generate(GenerationRequest(f"{w}-{issued}", ids, SamplingParams(max_tokens=n_tokens))):
                pass
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker(i) for i in range(concurrency)])
    wall = time.perf_counter() - t0
    lat.sort()
    return {
        "path": "engine direct",
        "concurrency": concurrency,
        "requests": len(lat),
        "errors": 0,
        "rps": len(lat) / wall,
        "p50_ms": 1000 * percentile(lat, 50),
        "p99_ms": 1000 * percentile(lat, 99),
    }


async def handle_direct(concurrency: int, args) -> dict:
    """One Ray Serve hop (driver -> LLMServer handle), no HTTP: attributes the stack's cost."""
    from ray import serve

    from serve_app.app import llm_deployment_name
    from serve_app.internal import InferenceRequest

    h = serve.get_deployment_handle(llm_deployment_name("null", "stable"), "bench")
    lat, issued = [], 0
    deadline = time.monotonic() + min(args.duration_s, 8)

    async def worker():
        nonlocal issued
        while issued < args.max_requests and time.monotonic() < deadline:
            issued += 1
            t0 = time.perf_counter()
            await h.generate_full.remote(InferenceRequest(
                request_id=f"h{issued}", model="null", messages=[{"role": "user", "content": "hi"}],
                max_tokens=args.tokens))
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    wall = time.perf_counter() - t0
    lat.sort()
    return {"path": "serve handle (1 hop)", "concurrency": concurrency, "requests": len(lat), "errors": 0,
            "rps": len(lat) / wall, "p50_ms": 1000 * percentile(lat, 50), "p99_ms": 1000 * percentile(lat, 99)}


def full_stack(args) -> list[dict]:
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from serve_app.app import build_app
    from serve_app.config import parse_config

    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
    cfg = parse_config(
        {
            "models": [
                {
                    "name": "null",
                    "variants": [
                        {
                            "name": "stable",
                            "engine": {
                                "backend": "null",
                                "options": {"num_tokens": args.tokens, "tokens_per_s": 0, "max_num_seqs": 1024},
                            },
                        }
                    ],
                }
            ],
            "server": {"user_code_loop": args.user_code_loop},
        }
    )
    serve.run(build_app(cfg), name="bench", route_prefix="/")
    rows = [asyncio.run(handle_direct(c, args)) for c in (1, 32)]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "null", "messages": [{"role": "user", "content": "hi"}], "max_tokens": args.tokens}
    for stream in (False,) if args.skip_stream else (False, True):
        for c in (1, 32):
            r = asyncio.run(
                run_load(url, body, c, max_requests=args.max_requests, max_duration_s=args.duration_s,
                         stream=stream, warmup_requests=5)
            )
            s = r.summary()
            s["path"] = "full stack" + (" (stream)" if stream else "")
            rows.append(s)
    serve.shutdown()
    ray.shutdown()
    return rows


def cold_start(args) -> dict:
    """Wall time from `seekserve serve` to the first answered chat request."""
    port = free_port()
    cfg_path = Path("/tmp/seekserve-coldstart.yaml")
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    cfg["server"]["http_port"] = port
    cfg["server"]["grpc_port"] = free_port()
    cfg_path.write_text(yaml.safe_dump(cfg))
    import httpx

    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve_app.cli", "serve", "--config", str(cfg_path), "--quiet"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    first = None
    try:
        while time.perf_counter() - t0 < 300:
            try:
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": cfg["models"][0]["name"], "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 4},
                    timeout=30,
                )
                if r.status_code == 200:
                    first = time.perf_counter() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
    return {"path": "cold start (serve -> first answer)", "seconds": first}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--duration-s", type=float, default=15.0)
    p.add_argument("--max-requests", type=int, default=20000)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--cold-start", action="store_true")
    p.add_argument("--throughput-optimized", action="store_true",
                   help="set RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Serve's direct ingress + gRPC transport)")
    p.add_argument("--skip-stream", action="store_true")
    add_http_proxy_arg(p)
    add_user_code_loop_arg(p)
    p.add_argument("--out", default=str(ROOT / "results" / "serve_overhead.json"))
    args = p.parse_args()
    from cluster.launcher import select_http_proxy

    select_http_proxy(args.http_proxy)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.throughput_optimized:
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"

    rows = []
    for c in (1, 32):
        rows.append(asyncio.run(engine_direct(c, args.tokens, args.max_requests, min(args.duration_s, 5))))
    rows += full_stack(args)
    extra = {}
    if args.cold_start:
        extra = cold_start(args)
    save_json(args.out, {"rows": rows, "cold_start": extra, "args": vars(args),
                         "env": {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE")}})
    print()
    print_table(rows, ["path", "concurrency", "requests", "errors", "rps", "p50_ms", "p99_ms"])
    if extra:
        print(f"cold start: {extra['seconds']:.1f} s from `seekserve serve` to the first answer")


if __name__ == "__main__":
    main()
