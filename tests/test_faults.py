"""Faults and load on a real Ray Serve app: a replica killed under load, scale-down
and redeploy while requests are in flight, and 3x overload.

The null engine stands in for the model (tokens at a fixed rate), so request
times are known and the assertions are about the serving path alone.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import ray
from ray import serve

from serve_app.app import llm_deployment_name
from tests.conftest import deploy_app, null_config, wait_for

MODEL = "faulty"


def _cfg(replicas: int, num_tokens: int, tokens_per_s: float, **engine) -> dict:
    cfg = null_config(MODEL, num_tokens=num_tokens, tokens_per_s=tokens_per_s, **engine)
    cfg["models"][0]["variants"][0]["num_replicas"] = replicas
    cfg["timeouts"] = {"request_timeout_s": 30, "replica_failure_retries": 3, "replica_failure_backoff_s": 0.3}
    return cfg


def _replica_states(app: str) -> dict:
    dep = serve.status().applications[app].deployments[llm_deployment_name(MODEL, "stable")]
    return {str(k.value if hasattr(k, "value") else k): v for k, v in dep.replica_states.items()}


def _running(app: str) -> int:
    return _replica_states(app).get("RUNNING", 0)


def _replica_actors(app: str) -> list:
    dep = llm_deployment_name(MODEL, "stable")
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{app}#{dep}#")]
    return [ray.get_actor(n, namespace="serve") for n in names]


def _complete(base: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": max_tokens},
                      timeout=60)


def _stream(base: str, max_tokens: int, started: threading.Semaphore | None = None) -> list[str]:
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1 and started is not None:
                    started.release()
    return events


@pytest.fixture(scope="module")
def kill_app(serve_session):
    deploy_app(_cfg(2, num_tokens=30, tokens_per_s=20), name="kill", route_prefix="/kill")
    yield serve_session["base"] + "/kill"
    serve.delete("kill")  # the session's Ray has 8 CPUs for every module's apps


def test_killed_replica_loses_no_untouched_request_and_comes_back(kill_app):
    base = kill_app
    wait_for(lambda: _running("kill") == 2, timeout_s=60)
    replicas = _replica_actors("kill")
    with ThreadPoolExecutor(32) as pool:
        plain = [pool.submit(_complete, base, 30) for _ in range(16)]
        first_tokens = threading.Semaphore(0)
        streams = [pool.submit(_stream, base, 30, first_tokens) for _ in range(6)]
        for _ in streams:  # every stream has sent bytes: these can no longer be retried
            assert first_tokens.acquire(timeout=20)

        def ongoing() -> list[int]:
            return ray.get([a.get_num_ongoing_requests.remote() for a in replicas])

        # kill only once requests are mid-generation (each takes 1.5 s) on the victim
        held = wait_for(lambda: (lambda n: n if sum(n) >= 16 else None)(ongoing()), timeout_s=20, interval_s=0.05)
        victim = replicas[held.index(max(held))]
        ray.kill(victim, no_restart=True)
        more = [pool.submit(_complete, base, 30) for _ in range(8)]  # sent while the replica is gone
        responses = [f.result() for f in plain + more]
        stream_events = [f.result() for f in streams]

    codes = [r.status_code for r in responses]
    assert codes == [200] * len(codes), [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 30 for r in responses)
    broken = 0
    for events in stream_events:
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        if "error" in last:  # the stream was on the killed replica: an in-band error, then [DONE]
            broken += 1
            assert last["error"]["type"] and last["error"]["message"]
        else:
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
            assert text.count("tok") == 30
    wait_for(lambda: _running("kill") == 2, timeout_s=90)
    assert _complete(base, 5).status_code == 200
    print(f"in flight per replica at the kill: {held}; streams cut by it: {broken} of {len(stream_events)}")


@pytest.fixture(scope="module")
def drain_app(serve_session):
    deploy_app(_cfg(2, num_tokens=40, tokens_per_s=10), name="drain", route_prefix="/drain")
    yield serve_session["base"] + "/drain"
    serve.delete("drain")


def _in_flight_while(base: str, n: int, change) -> list[httpx.Response]:
    with ThreadPoolExecutor(n + 2) as pool:
        futures = [pool.submit(_complete, base, 40) for _ in range(n)]
        time.sleep(1.0)  # all admitted and generating (each takes 4 s)
        changer = pool.submit(change)
        responses = [f.result() for f in futures]
        changer.result()
    return responses


def test_scale_down_drains_in_flight_requests(drain_app):
    wait_for(lambda: _running("drain") == 2, timeout_s=60)
    responses = _in_flight_while(drain_app, 12, lambda: deploy_app(
        _cfg(1, num_tokens=40, tokens_per_s=10), name="drain", route_prefix="/drain"))
    assert [r.status_code for r in responses] == [200] * 12, [r.text[:200] for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in responses)
    wait_for(lambda: _replica_states("drain") == {"RUNNING": 1}, timeout_s=90)


def test_redeploy_with_new_engine_options_drains_old_replicas(drain_app):
    wait_for(lambda: _running("drain") >= 1, timeout_s=60)
    # new engine options -> new replicas; the old one finishes what it holds before it stops
    responses = _in_flight_while(drain_app, 8, lambda: deploy_app(
        _cfg(1, num_tokens=40, tokens_per_s=10, token_text=" new"), name="drain", route_prefix="/drain"))
    assert [r.status_code for r in responses] == [200] * 8, [r.text[:200] for r in responses]
    texts = {r.json()["choices"][0]["text"] for r in responses}
    assert texts == {" tok" * 40}, texts  # all finished on the old replica
    wait_for(lambda: _complete(drain_app, 2).json()["choices"][0]["text"] == " new" * 2, timeout_s=60)


@pytest.fixture(scope="module")
def overload_app(serve_session):
    # capacity: 2 running x (8 tokens / 20 tok/s = 0.4 s) = 5 requests/s, 2 more may wait
    cfg = _cfg(1, num_tokens=8, tokens_per_s=20, max_num_seqs=2, max_waiting_requests=2)
    cfg["timeouts"]["retry_after_s"] = 2
    deploy_app(cfg, name="overload", route_prefix="/overload")
    yield serve_session["base"] + "/overload"
    serve.delete("overload")


def _replica_rss_bytes(app: str) -> int:
    # Ray titles each worker process after its actor: ray::ServeReplica:<app>:<deployment>
    title = f"ServeReplica:{app}:{llm_deployment_name(MODEL, 'stable')}"
    procs = [p for p in psutil.process_iter(["cmdline"]) if title in " ".join(p.info["cmdline"] or [])]
    assert procs, f"no process titled {title}"
    return sum(p.memory_info().rss for p in procs)


def test_three_times_capacity_gets_429_and_admitted_latency_holds(overload_app):
    base = overload_app
    wait_for(lambda: _running("overload") == 1, timeout_s=60)
    capacity_rps, factor, duration_s = 5.0, 3, 6.0
    rss_before = _replica_rss_bytes("overload")
    results: list[tuple[int, float, str | None]] = []
    lock = threading.Lock()

    def fire():
        t0 = time.monotonic()
        r = _complete(base, 8)
        with lock:
            results.append((r.status_code, time.monotonic() - t0, r.headers.get("retry-after")))

    n = int(capacity_rps * factor * duration_s)
    with ThreadPoolExecutor(64) as pool:  # open loop: arrivals do not wait for answers
        t_start = time.monotonic()
        for i in range(n):
            time.sleep(max(0.0, t_start + i / (capacity_rps * factor) - time.monotonic()))
            pool.submit(fire)
    codes = [c for c, _, _ in results]
    admitted = sorted(s for c, s, _ in results if c == 200)
    rejected = [ra for c, _, ra in results if c == 429]
    seen = f"{len(admitted)} admitted, {len(rejected)} rejected, codes {sorted(set(codes))}, latencies {admitted}"
    assert len(results) == n and set(codes) <= {200, 429}, seen
    assert rejected and all(ra == "2" for ra in rejected), rejected[:5]
    # admitted work is at most what capacity allows over the window, give or take the queue
    assert len(admitted) <= capacity_rps * duration_s * 1.5 + 4, seen
    assert len(admitted) >= capacity_rps * duration_s * 0.3, seen
    # the queue bound holds latency: 2 running + 2 waiting ahead is ~1.2 s of engine work; an
    # unbounded queue at 3x would make the last admitted request wait ~12 s (60 extra requests at
    # 5/s). Measured: p99 1.8 s on an idle 2-core box, 4.8 s on the CI box with the session's other
    # apps alive (the HTTP path itself queues there), so the bound is half the unbounded case.
    p99 = admitted[min(len(admitted) - 1, int(0.99 * len(admitted)))]
    assert p99 <= 6.0, f"admitted p99 {p99:.2f} s; {seen}"
    rss_after = _replica_rss_bytes("overload")
    assert rss_after < rss_before * 1.2 + 50e6, (rss_before, rss_after)
    print(f"{n} sent at {capacity_rps * factor:g}/s: {len(admitted)} admitted (p99 {p99:.2f} s), "
          f"{len(rejected)} got 429; replica RSS {rss_before / 1e6:.0f} -> {rss_after / 1e6:.0f} MB")
