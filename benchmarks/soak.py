"""Soak: minutes of mixed streaming / non-streaming load through the full stack,
on the null engine and on SmolLM2, watching errors, memory and latency drift.

    python benchmarks/soak.py [--minutes 10] [--engines null smollm2] [--concurrency 8]

For each engine: deploy, record the RSS of every Ray process (raylet, GCS,
Serve controller, proxy, ingress, LLMServer replica, ...), run the load for the
given time in one-minute windows (half the requests stream), record RSS again.
Reports per engine: requests, errors, p99 of the first and the last window
(drift), and the RSS growth of each process. Pass criteria (issue #10): 0
errors, every process's RSS growth < 5 %. Prints a table last and writes
results/soak.json.

Ray starts with MALLOC_ARENA_MAX=2, as cluster.yaml's ``ray start`` lines do:
glibc's per-thread arenas otherwise keep growing RSS for minutes in Ray's
many-threaded workers (Ingress +6.7 % in 10 min without it, while tracemalloc
showed its Python heap flat). ``--malloc-arena-max 0`` measures without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import free_port, percentile, print_table, save_json  # noqa: E402

ENGINES = {
    "null": {"backend": "null", "options": {"num_tokens": 32, "tokens_per_s": 200, "max_num_seqs": 256}},
    "smollm2": {"backend": "hf", "options": {"model": "embedded:smollm2-135m-instruct", "device": "cpu",
                                             "max_num_seqs": 16, "max_model_len": 2048}},
}
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?",
             "Write a haiku about rain.", "Explain what a CPU does in one sentence."]


def ray_processes() -> dict[int, str]:
    """Every Ray process on this machine: pid -> label (its title: ray::ServeReplica:..., raylet, ...).
    Labels are taken once, at the start, and processes are then followed by pid: an actor's title
    changes with the method it runs, and a label looked up again could miss it."""
    import psutil

    out: dict[int, str] = {}
    for p in psutil.process_iter(["cmdline", "name"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if not cmd:
            continue
        if cmd.startswith("ray::") or "/ray/core/src" in cmd or "ray/_private" in cmd or "ray/dashboard" in cmd:
            # an actor's title names the method it runs (ray::ServeController.listen_for_change): drop it
            key = cmd.split()[0].split(".")[0] if cmd.startswith("ray::") else Path(cmd.split()[0]).name
            # Python daemons are named by their script; the raylet's own command line
            # also names a script (its worker command), so binaries keep their name
            if key.startswith("python") and ("ray/_private" in cmd or "ray/dashboard" in cmd):
                key = next((Path(a).name for a in cmd.split() if a.endswith(".py")), key)
            out[p.pid] = f"{key} (pid {p.pid})"
    return out


def memory_of(procs: dict[int, str]) -> dict[str, tuple[int, int]]:
    """label -> (RSS, of it shared pages: files and shared memory such as the object store) now;
    a process that has exited is left out."""
    import psutil

    out = {}
    for pid, label in procs.items():
        try:
            m = psutil.Process(pid).memory_info()
        except psutil.Error:
            continue
        out[label] = (m.rss, m.shared)
    return out


async def window(base: str, model: str, concurrency: int, seconds: float, rng: random.Random,
                 stream_fraction: float = 0.5) -> dict:
    import httpx

    lat, errors, n = [], 0, 0
    deadline = time.monotonic() + seconds

    async def worker(client):
        nonlocal errors, n
        while time.monotonic() < deadline:
            stream = rng.random() < stream_fraction
            body = {"model": model, "max_tokens": 24, "temperature": 0 if rng.random() < 0.5 else 0.8,
                    "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "stream": stream}
            t0 = time.perf_counter()
            try:
                if stream:
                    ok = False
                    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith('data: {"error"'):
                                break
                            if line == "data: [DONE]":
                                ok = r.status_code == 200
                    errors += not ok
                else:
                    r = await client.post(f"{base}/v1/chat/completions", json=body)
                    errors += r.status_code != 200
                lat.append(time.perf_counter() - t0)
            except Exception:
                errors += 1
            n += 1

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        if concurrency == 0:  # idle: what Ray's processes do with no requests at all
            await asyncio.sleep(seconds)
    return {"requests": n, "errors": errors, "p50_ms": 1000 * percentile(lat, 50),
            "p99_ms": 1000 * percentile(lat, 99)}


def memory_summary(samples: list[dict[str, tuple[int, int]]]) -> dict:
    """From memory_of samples (the first at the start, one after each window): each process's RSS
    growth start -> end, the worst one, and RSS and shared MB per window (growth that flattens is
    allocator warm-up; a steady climb is a leak)."""
    rss0, rss1 = ({k: v[0] for k, v in sample.items()} for sample in (samples[0], samples[-1]))
    growth = {k: 100 * (rss1[k] - rss0[k]) / rss0[k] for k in rss0 if k in rss1 and rss0[k]}
    worst = max(growth.items(), key=lambda kv: kv[1]) if growth else ("-", 0.0)
    return {"worst_rss_process": worst[0], "worst_rss_growth_pct": worst[1],
            "rss_start_mb": {k: v / 1e6 for k, v in rss0.items()}, "rss_growth_pct": growth,
            "rss_mb_per_window": {k: [m.get(k, (0, 0))[0] / 1e6 for m in samples] for k in rss0},
            "shared_mb_per_window": {k: [m.get(k, (0, 0))[1] / 1e6 for m in samples] for k in rss0}}


def soak_bare_ray(args) -> dict:
    """No Serve at all: Ray's own processes, sampled like soak_one's (a baseline for their growth)."""
    procs = ray_processes()
    samples = [memory_of(procs)]
    minutes = max(1, round(args.minutes))
    for _ in range(minutes):
        time.sleep(args.minutes * 60 / minutes)
        samples.append(memory_of(procs))
    return {"engine": "none", "minutes": args.minutes, "requests": 0, "errors": 0,
            "p99_first_ms": float("nan"), "p99_last_ms": float("nan"), **memory_summary(samples)}


def soak_one(name: str, args, port: int) -> dict:
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import parse_config

    cfg = parse_config({"models": [{"name": name, "variants": [{"name": "stable", "engine": ENGINES[name]}]}],
                        "rollout": {"enabled": False}})
    serve.run(build_app(cfg), name=f"soak-{name}", route_prefix=f"/{name}")
    base = f"http://127.0.0.1:{port}/{name}"
    rng = random.Random(0)
    asyncio.run(window(base, name, args.concurrency, 10, rng))  # warm-up: lazy imports, caches, first batches
    if args.warmup_minutes > 0:
        # a fresh Ray's raylet and GCS grow for their first ~10 minutes and then stay flat, load or no
        # load (docs/benchmarks.md): measured from a cold start that warm-up reads as growth
        w = asyncio.run(window(base, name, args.concurrency, args.warmup_minutes * 60, rng, args.stream_fraction))
        print(json.dumps({"engine": name, "warmup": True, **w}), flush=True)
    ingress = serve.get_deployment_handle("Ingress", f"soak-{name}")
    if args.tracemalloc:
        ingress.memory_mark.remote().result()
    procs = ray_processes()
    samples = [memory_of(procs)]  # at the start, then after every window
    windows = []
    minutes = max(1, round(args.minutes))
    for i in range(minutes):
        w = asyncio.run(window(base, name, args.concurrency, args.minutes * 60 / minutes, rng, args.stream_fraction))
        samples.append(memory_of(procs))
        print(json.dumps({"engine": name, "window": i, **w}), flush=True)
        windows.append(w)
    growth_by_line = ingress.memory_growth.remote(20).result() if args.tracemalloc else []
    for line in growth_by_line:
        print(f"  ingress {line}", flush=True)
    serve.delete(f"soak-{name}")
    return {"engine": name, "minutes": args.minutes, "warmup_minutes": args.warmup_minutes,
            "malloc_arena_max": args.malloc_arena_max or None,
            "stream_fraction": args.stream_fraction,
            "requests": sum(w["requests"] for w in windows),
            "errors": sum(w["errors"] for w in windows), "p99_first_ms": windows[0]["p99_ms"],
            "p99_last_ms": windows[-1]["p99_ms"], **memory_summary(samples), "windows": windows,
            "ingress_python_growth": growth_by_line}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=10.0, help="per engine")
    p.add_argument("--engines", nargs="+", default=["null", "smollm2"], choices=sorted(ENGINES) + ["none"],
                   help="'none': Ray alone, no Serve application (a baseline)")
    p.add_argument("--concurrency", type=int, default=8, help="clients; 0 leaves the app idle (a baseline)")
    p.add_argument("--stream-fraction", type=float, default=0.5, help="share of requests that stream")
    p.add_argument("--warmup-minutes", type=float, default=0.0,
                   help="load before the first memory sample (the measured minutes follow)")
    p.add_argument("--out", default=str(ROOT / "results" / "soak.json"))
    p.add_argument("--malloc-arena-max", type=int, default=2,
                   help="MALLOC_ARENA_MAX for every Ray process, as cluster.yaml's ray start sets it (0: unset)")
    p.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                   help="trace the Ingress's Python allocations (this many frames) and print what grew")
    args = p.parse_args()
    if "none" in args.engines and args.engines != ["none"]:
        p.error("--engines none measures Ray alone and runs by itself")
    import os

    # both reach every process of the local Ray started below
    if args.tracemalloc:
        os.environ["SEEKSERVE_TRACEMALLOC"] = str(args.tracemalloc)
    if args.malloc_arena_max:
        os.environ["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    else:
        os.environ.pop("MALLOC_ARENA_MAX", None)

    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    if args.engines == ["none"]:
        rows = [soak_bare_ray(args)]
    else:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
        rows = [soak_one(name, args, port) for name in args.engines]
        serve.shutdown()
    ray.shutdown()
    save_json(args.out, rows)
    print()
    print_table(rows, ["engine", "minutes", "requests", "errors", "p99_first_ms", "p99_last_ms",
                       "worst_rss_process", "worst_rss_growth_pct"])
    ok = all(r["errors"] == 0 and r["worst_rss_growth_pct"] < 5.0 for r in rows)
    print("PASS" if ok else "FAIL (errors, or a process grew by 5 % or more)")


if __name__ == "__main__":
    main()
