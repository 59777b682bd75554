"""The custom policy inside a real Ray Serve: scale 1 -> >=2 under load and back,
and no scale-up (with the alert) when the GPU is idle.

GPU utilisation comes from FakeGpuUtilSource (``fake:<busy>:<idle>``): this
machine has no NVML. It reports <busy> while the engine runs requests."""

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import pytest
from ray import serve

from autoscale.policy import ALERT_GPU_IDLE
from autoscale.ray_policy import read_decision
from serve_app.app import llm_deployment_name
from tests.conftest import deploy_app, null_config, wait_for


def scaling_config(model: str, gpu_source: str) -> dict:
    cfg = null_config(model, num_tokens=10, tokens_per_s=10, max_num_seqs=2, max_waiting_requests=200)
    v = cfg["models"][0]["variants"][0]
    v["resources"] = {"num_cpus": 0.1}
    v["autoscaling"] = {
        "min_replicas": 1,
        "max_replicas": 3,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 1.0,
        "gpu_source": gpu_source,
        "gpu_sample_interval_s": 0.2,
        "policy": {
            "queue_high": 3, "queue_low": 0.5, "upscale_delay_s": 1, "downscale_delay_s": 3,
            "cooldown_s": 1, "metric_max_age_s": 30,
        },
    }
    return cfg


def running_replicas(app: str, model: str) -> int:
    st = serve.status().applications[app].deployments[llm_deployment_name(model, "stable")]
    return st.replica_states.get("RUNNING", 0)


class Load:
    """`concurrency` clients sending back to back until stopped (bounded to 60 s)."""

    def __init__(self, url: str, model: str, concurrency: int):
        self.url, self.model, self.concurrency = url, model, concurrency
        self.stop = threading.Event()
        self.codes: list[int] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self):
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(timeout=60) as c:
            async def worker():
                while not self.stop.is_set() and time.monotonic() < deadline:
                    r = await c.post(self.url, json={"model": self.model, "max_tokens": 10,
                                                     "messages": [{"role": "user", "content": "hi"}]})
                    self.codes.append(r.status_code)
            await asyncio.gather(*[worker() for _ in range(self.concurrency)])

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(90)


@pytest.mark.slow
@pytest.mark.parametrize("direct", [False, True], ids=["ingress", "direct-streaming"])
def test_scales_up_under_load_and_back_down(serve_session, direct):
    """With direct streaming the replicas that scale are the ones serving HTTP, which Serve's proxy
    balances over: none of the load's requests may fail while they come and go."""
    app, prefix = ("scale-busy-direct", "/busydirect") if direct else ("scale-busy", "/busy")
    cfg = scaling_config("busy", "fake:90:5")
    if direct:
        cfg.update(server={"direct_streaming": True}, rollout={"enabled": False})
    deploy_app(cfg, name=app, route_prefix=prefix)
    url = serve_session["base"] + prefix + "/v1/chat/completions"
    assert running_replicas(app, "busy") == 1
    with Load(url, "busy", concurrency=24) as load:
        wait_for(lambda: running_replicas(app, "busy") >= 2, timeout_s=45)
        decision = read_decision(app, llm_deployment_name("busy", "stable"))
    assert decision is not None and decision["desired_replicas"] >= 2
    shown = subprocess.run(
        [sys.executable, "-m", "serve_app.cli", "status", "--app", app, "--url", ""],
        capture_output=True, text=True, timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "LLMServer-busy-stable" in shown.stdout and "autoscaler:" in shown.stdout, shown.stdout
    assert set(load.codes) == {200}, set(load.codes)  # scaling dropped nothing
    wait_for(lambda: running_replicas(app, "busy") == 1, timeout_s=60)
    last = read_decision(app, llm_deployment_name("busy", "stable"))
    assert last["kind"] in ("at_min", "scale_down", "stabilizing_down")
    serve.delete(app)


@pytest.mark.slow
def test_idle_gpu_blocks_scale_up_and_raises_the_alert(serve_session):
    deploy_app(scaling_config("idle", "fake:20:5"), name="scale-idle", route_prefix="/idle")
    url = serve_session["base"] + "/idle/v1/chat/completions"
    name = llm_deployment_name("idle", "stable")
    with Load(url, "idle", concurrency=24):
        d = wait_for(lambda: (x := read_decision("scale-idle", name)) and ALERT_GPU_IDLE in x["alerts"] and x,
                     timeout_s=30)
        time.sleep(4)  # several control-loop ticks past the upscale delay
        assert running_replicas("scale-idle", "idle") == 1
    assert d["desired_replicas"] == 1 and d["kind"] == "gpu_idle_alert"
    serve.delete("scale-idle")
