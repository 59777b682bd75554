"""Metrics through Ray's pipeline into a real Prometheus, alert rules under
promtool, the Grafana dashboard's queries, and traces joined across the
ingress and the replica, attributed by `seekserve trace top`."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from ray import serve

from tests.conftest import _free_port, deploy_app, null_config, smol_config, wait_for

ROOT = Path(__file__).resolve().parent.parent
PROM_DIR = ROOT / "deploy" / "prometheus"


def _tool(name):
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} must be installed in CI (.ci/run installs Debian's prometheus)")
        pytest.skip(f"{name} is not installed here (apt-get install prometheus)")
    return path


def _metric_names() -> set[str]:
    from serve_app import metrics

    return {m.info["name"] if hasattr(m, "info") else m._name for m in metrics._m().values()}


def test_alert_rules_check_and_unit_tests():
    promtool = _tool("promtool")
    check = subprocess.run([promtool, "check", "rules", "rules.yml"], cwd=PROM_DIR, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", "rules_test.yml"], cwd=PROM_DIR, capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_leak_rule_uses_deriv_on_the_gauge():
    rules = (PROM_DIR / "rules.yml").read_text()
    leak = rules[rules.index("SeekserveGPUMemoryLeak"):]
    leak = leak[:leak.index("- alert:", 10) if "- alert:" in leak[10:] else len(leak)]
    assert "deriv(ray_seekserve_gpu_memory_used_bytes" in leak and "rate(ray_seekserve_gpu_memory" not in leak


def test_dashboard_and_rules_only_query_metrics_we_export():
    ours = _metric_names()
    dash = json.loads((ROOT / "deploy" / "grafana" / "seekserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append((PROM_DIR / "rules.yml").read_text())
    used = set()
    for e in exprs:
        # Ray's exporter prefixes every application metric with "ray_"
        assert not re.findall(r"(?<![a-z_:])seekserve_[a-z]", e), f"missing ray_ prefix in {e}"
        for name in re.findall(r"\bray_(seekserve_[a-z0-9_]+)", e):
            used.add(re.sub(r"_(bucket|count|sum)$", "", name))
    used.discard("seekserve_autoscaler_decisions_total")  # from autoscale/ray_policy.py
    assert used <= ours | {"seekserve_autoscaler_decisions"}, used - ours
    titles = {p["title"] for p in dash["panels"]}
    assert {"Time to first token (SLO 800 ms)", "GPU utilisation", "Rollout weights", "Replicas"} <= titles


@pytest.fixture(scope="module")
def traced_app(serve_session, tmp_path_factory):
    trace_file = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    cfg = smol_config("smol-traced", max_num_seqs=4, max_model_len=1024)
    cfg["tracing"] = {"exporter": "file", "file_path": str(trace_file)}
    deploy_app(cfg, name="traced", route_prefix="/traced")
    base = serve_session["base"] + "/traced"
    for i in range(3):
        r = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": "smol-traced", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": f"Name {i + 2} colours."}]})
        assert r.status_code == 200
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=120, json={
            "model": "smol-traced", "max_tokens": 12, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Name a colour."}]}) as r:
        assert r.status_code == 200 and "data: [DONE]" in r.read().decode()
    yield {"base": base, "trace_file": trace_file}
    serve.delete("traced")  # the session's Ray has 8 CPUs for every module's apps


@contextlib.contextmanager
def _prometheus(metrics_port: int, tmp_path: Path):
    """A real Prometheus scraping Ray's exporter every second; yields its query URL once it is ready.

    Its port comes from _free_port, which another process may take before Prometheus binds it: a Prometheus
    that exits while starting is started again on a new port, and its log is kept for the failure message."""
    prometheus = _tool("prometheus")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: ray\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
    )
    log = tmp_path / "prometheus.log"
    for _ in range(3):
        port = _free_port()
        with log.open("w") as err:
            proc = subprocess.Popen([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=subprocess.DEVNULL, stderr=err)

        def ready():
            if proc.poll() is not None:
                return "exited"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        with contextlib.suppress(AssertionError):  # not ready within the minute: as one that exited
            if wait_for(ready, timeout_s=60, interval_s=0.5) is True:
                break
        proc.terminate()
        proc.wait(30)
    else:
        pytest.fail(f"prometheus did not start in 3 tries: {log.read_text()[-2000:]}")
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_prometheus_scrapes_our_series(serve_session, traced_app, tmp_path):
    with _prometheus(serve_session["metrics_port"], tmp_path) as (prom, log):
        api = f"{prom}/api/v1/query"

        def value(q):
            try:
                res = httpx.get(api, params={"query": q}, timeout=5).json()["data"]["result"]
            except (httpx.HTTPError, KeyError, ValueError):
                return None
            return res or None

        # Ray's exporter adds the "ray_" prefix and replica / node labels; its
        # export runs on an interval, so wait until every request is counted
        def total(q, at_least):
            got = value(q)
            return got if got and sum(float(r["value"][1]) for r in got) >= at_least else None

        try:
            # CI once missed this for 90 s with no clue why: wait longer, and say what each side saw
            wait_for(lambda: total('ray_seekserve_requests_total{model="smol-traced",status_code="200"}', 3),
                     timeout_s=180, interval_s=2)
        except AssertionError as e:
            raise AssertionError(f"{e}; {_scrape_state(prom, serve_session['metrics_port'], log)}") from e
        wait_for(lambda: total('sum(ray_seekserve_time_to_first_token_seconds_count{model="smol-traced"})', 3),
                 timeout_s=60, interval_s=2)
        wait_for(lambda: total('sum(ray_seekserve_generation_tokens_total{model="smol-traced"})', 3),
                 timeout_s=60, interval_s=2)
        # the gauge is exported on Ray's interval: once the requests are done it must come back to 0
        wait_for(lambda: (v := value('ray_seekserve_requests_running{model="smol-traced"}'))
                 and float(v[0]["value"][1]) == 0.0, timeout_s=60, interval_s=2)
        load = wait_for(lambda: value('ray_seekserve_engine_load_seconds{model="smol-traced"}'), timeout_s=60,
                        interval_s=2)
        assert 0 < float(load[0]["value"][1]) < 300


def _scrape_state(prom: str, metrics_port: int, log: Path) -> str:
    """What a failed wait saw: Prometheus's view of its target, and whether Ray's exporter had the series."""
    try:
        targets = [(t["health"], t.get("lastError")) for t in
                   httpx.get(f"{prom}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        targets = repr(e)
    try:
        raw = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
        exported = [ln for ln in raw.splitlines() if ln.startswith("ray_seekserve_requests_total")]
    except httpx.HTTPError as e:
        exported = repr(e)
    return f"targets {targets}; the exporter's request series {exported}; prometheus log {log.read_text()[-1000:]}"


@pytest.mark.slow
def test_one_trace_covers_ingress_and_replica_and_trace_top_attributes_it(traced_app):
    from serve_app.trace_top import build_trees, read_spans

    path = traced_app["trace_file"]
    # the replica's and the ingress's exporters write on their own schedules: wait for both processes' spans
    def exported(spans):
        return (len([s for s in spans if s.name == "engine.decode"]) >= 4
                and len([s for s in spans if s.name.startswith("chat ")]) >= 4)

    wait_for(lambda: path.exists() and exported(read_spans(path)), timeout_s=30)
    roots = [r for r in build_trees(read_spans(path)) if r.name.startswith("chat ")]
    assert len(roots) >= 4
    for r in roots:
        assert sorted(c.name for c in r.children) == ["llm_server.generate", "router.route"]
        (gen,) = [c for c in r.children if c.name == "llm_server.generate"]
        (route,) = [c for c in r.children if c.name == "router.route"]
        # over HTTP the span starts when the app got the request: reading and validating its body comes before
        # the routing, inside the span
        assert r.start_ns < route.start_ns <= gen.start_ns
        assert {c.name for c in gen.children} == {"engine.queue", "engine.prefill", "engine.decode"}
        assert gen.trace_id == r.trace_id and r.start_ns <= gen.start_ns and gen.end_ns <= r.end_ns + 5_000_000
    # the streamed request marks when its first delta reached the ingress: after the replica's first token
    (streamed,) = [r for r in roots if "seekserve.first_chunk" in r.events]
    (gen,) = [c for c in streamed.children if c.name == "llm_server.generate"]
    (prefill,) = [c for c in gen.children if c.name == "engine.prefill"]
    assert prefill.end_ns <= streamed.events["seekserve.first_chunk"] <= streamed.end_ns
    out = subprocess.run([sys.executable, "-m", "serve_app.cli", "trace", "top", str(path), "--root", "chat"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"{len(roots)} request(s)")
    assert len(lines) == 4 and "engine.decode" in out.stdout
    shares = [float(ln.rsplit(None, 1)[-1].rstrip("%")) for ln in lines[1:]]
    assert shares == sorted(shares, reverse=True) and sum(shares) <= 100.5


@pytest.mark.slow
def test_gpu_stack_splits_a_traced_first_token_into_its_legs(traced_app):
    """benchmarks/gpu_stack.py --trace: the streamed request's first token, from the app's receipt, in legs that
    add up (body read and validated, routing to the first delta)."""
    from benchmarks.gpu_stack import first_token_breakdown
    from serve_app.trace_top import build_trees, read_spans

    path = traced_app["trace_file"]
    # only the streamed request has a first delta; its spans come from two processes' exporters
    legs = wait_for(lambda: (lg := path.exists() and first_token_breakdown(path, [0, 2 ** 63])) and lg["requests"]
                    and lg, timeout_s=30)
    assert legs["requests"] == 1
    (streamed,) = [r for r in build_trees(read_spans(path)) if "seekserve.first_chunk" in r.events]
    whole_ms = (streamed.events["seekserve.first_chunk"] - streamed.start_ns) / 1e6
    assert legs["parse_p50_ms"] > 0 and legs["at_ingress_p50_ms"] > legs["engine_prefill_p50_ms"] > 0
    assert abs(legs["parse_p50_ms"] + legs["at_ingress_p50_ms"] - whole_ms) < 1e-3


def _access_lines(request_id: str) -> list[str]:
    """Serve's access-log lines for one request id, from every replica's log file of this Ray session."""
    import ray

    serve_logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    pattern = re.compile(rf" {re.escape(request_id)} -- ")
    return [ln for f in serve_logs.glob("replica_*.log") for ln in f.read_text(errors="replace").splitlines()
            if pattern.search(ln)]


def test_access_log_is_a_setting(serve_session, traced_app):
    """server.access_log: Serve's per-request line in the replicas' logs by default (the traced app), none when
    off, while the request is still answered."""
    cfg = null_config("quiet-null")
    cfg["server"] = {"access_log": False}
    deploy_app(cfg, name="quiet", route_prefix="/quiet")
    try:
        ids = {"on": f"acc-on-{os.getpid()}", "off": f"acc-off-{os.getpid()}"}
        for key, (base, model) in {"on": (traced_app["base"], "smol-traced"),
                                   "off": (serve_session["base"] + "/quiet", "quiet-null")}.items():
            r = httpx.post(base + "/v1/completions", headers={"x-request-id": ids[key]}, timeout=120,
                           json={"model": model, "prompt": "Hello", "max_tokens": 4})
            assert r.status_code == 200, r.text
        # the ingress and the model's replica each write one line for the request
        on = wait_for(lambda: len(lines := _access_lines(ids["on"])) >= 2 and lines, timeout_s=30)
        assert any("POST /traced/v1/completions 200" in ln for ln in on), on
        assert any("CALL generate_full OK" in ln for ln in on), on
        assert _access_lines(ids["off"]) == []
    finally:
        serve.delete("quiet")
