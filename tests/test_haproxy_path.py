"""Ray Serve's HAProxy data path (`seekserve serve --http-proxy haproxy`).

Serve reads the switch once, when its controller starts, so this runs in a Ray
of its own (a subprocess), not in the session's shared one: the same app, the
real HAProxy binary that ray[serve] installs, the openai client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ADMIN_TOKEN

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
direct = sys.argv[2] == "direct"
loop = sys.argv[3]
from cluster.launcher import select_http_proxy
from serve_app.app import deploy

select_http_proxy("haproxy")  # before Ray starts, as `seekserve serve --http-proxy haproxy` does
import httpx, openai, psutil, ray
from ray import serve
from benchmarks.loadgen import free_port
from serve_app.config import parse_config

ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
http_port, grpc_port = free_port(), free_port()
deploy(parse_config({
    "models": [{"name": "m", "variants": [{"name": "stable", "weight": 100, "engine": {
        "backend": "null", "options": {"num_tokens": 3000, "tokens_per_s": 200}}}]}],
    "server": {"host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port,
               "user_code_loop": loop, **({"direct_streaming": True} if direct else {"ingress_replicas": 2})},
    "rollout": {"enabled": False},
}))
deployments = sorted(serve.status().applications["seekserve"].deployments)
base = f"http://127.0.0.1:{http_port}"
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                                        max_tokens=5, stream_options={"include_usage": True})
chunks = list(chunks)
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
usage = [c.usage.completion_tokens for c in chunks if c.usage]
whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
admin = {"Authorization": "Bearer " + sys.argv[4]}
# clients that leave mid-stream: the replica must stop the generation. Serve watches for the disconnect; with
# its x-request-disconnect-disabled header it does not, and Starlette's StreamingResponse's own watch must
import time
for n, headers in enumerate([{}, {"x-request-disconnect-disabled": "?1"}], start=1):
    with httpx.stream("POST", base + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3000,
                      "stream": True}, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 30
    while True:
        s = httpx.get(base + "/admin/engine-stats", headers=admin, timeout=60).json()["m/stable"]
        if (s["aborted_requests"] >= n and s["num_running"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
left = {"aborted": s["aborted_requests"], "running": s["num_running"], "generated": s["generated_tokens"]}
bad = httpx.post(base + "/v1/chat/completions", json={"model": "m", "messages": [], "temperature": 9}, timeout=60)
listening = {c.laddr.port: c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN"}
owner = psutil.Process(listening[http_port]).name() if listening.get(http_port) else None
stats = httpx.get(base + "/admin/engine-stats", headers=admin, timeout=60).json()
print("RESULT " + json.dumps({"streamed": streamed, "usage": usage, "left": left,
                              "whole": whole.choices[0].message.content,
                              "bad_status": bad.status_code, "bad_body": bad.json(), "port_owner": owner,
                              "deployments": deployments, "user_code_thread": stats["m/stable"]["user_code_thread"]}))
ray.shutdown()
"""


@pytest.mark.parametrize("ingress,loop,on_main_loop", [
    ("separate", "auto", False), ("direct", "auto", True), ("direct", "separate", False)])
def test_the_app_serves_through_ray_serve_haproxy(ingress, loop, on_main_loop):
    """With an Ingress deployment, and with direct streaming, where HAProxy hands each connection to the
    LLMServer replica itself; our code on Serve's user-code thread, or on the replica's main loop."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), ingress, loop, ADMIN_TOKEN], capture_output=True,
                         text=True, env=env, timeout=240, cwd=ROOT)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    # HAProxy, not Serve's Python proxy actor, owns the HTTP port
    assert r["port_owner"] is not None and "haproxy" in r["port_owner"].lower()
    assert r["streamed"] == r["whole"] == " tok" * 5 and r["usage"] == [5]
    # the two clients that left mid-stream: aborted, not generated to their 3,000 tokens (15 s at 200 a second)
    assert r["left"]["aborted"] == 2 and r["left"]["running"] == 0 and r["left"]["generated"] < 1000, r["left"]
    assert r["bad_status"] == 400 and r["bad_body"]["error"]["param"] == "temperature"
    assert r["deployments"] == (["LLMServer-m-stable"] if ingress == "direct" else ["Ingress", "LLMServer-m-stable"])
    # Serve's own user-code thread is a plain threading.Thread; the main loop runs in Ray's "AsyncIO Thread"
    assert r["user_code_thread"].startswith("AsyncIO Thread") == on_main_loop, r["user_code_thread"]


def test_the_switch_names_its_choices():
    from cluster.launcher import HAPROXY_ENV, select_http_proxy

    env: dict[str, str] = {}
    select_http_proxy("haproxy", env)
    assert env == {HAPROXY_ENV: "1"}
    select_http_proxy("python", env)
    assert env == {HAPROXY_ENV: "0"}
    with pytest.raises(ValueError, match="valid: python, haproxy"):
        select_http_proxy("nginx", env)
