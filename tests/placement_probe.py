"""Run in its own process by tests/test_placement.py: a real multi-node Ray
cluster (ray.cluster_utils.Cluster, 2 worker nodes x 4 logical GPUs), Serve on
it, and TP deployments of the null engine whose rank workers hold the bundles.
Prints one JSON line with what was observed."""

import contextlib
import io
import json
import os
import socket
import sys
import time

os.environ["RAY_SERVE_SLOW_STARTUP_WARNING_S"] = "3"
os.environ["RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S"] = "1"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.serve.config import HTTPOptions  # noqa: E402

from serve_app.app import bind_warning, build_app, llm_deployment_name  # noqa: E402
from serve_app.cli import _warn_bind  # noqa: E402
from serve_app.config import ConfigError, parse_config  # noqa: E402
from cluster.placement import check_capacity, cluster_node_gpus  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(model, tp, replicas):
    return parse_config({"models": [{"name": model, "variants": [{
        "name": "stable", "tensor_parallel_size": tp, "num_replicas": replicas,
        "resources": {"num_cpus": 0.1, "num_gpus": 1},
        "nccl": {"profile": "auto", "env": {"NCCL_DEBUG": "WARN"}},
        "engine": {"backend": "null", "options": {"num_tokens": 2}}}]}]})


def placements(app, model, replicas, timeout_s=60):
    h = serve.get_deployment_handle(llm_deployment_name(model, "stable"), app)
    seen = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas and time.monotonic() < deadline:
        s = h.stats.remote().result()
        seen[s["replica_actor_id"]] = {"node": s["replica_node_id"], "ranks": s["placement"]}
    return list(seen.values())


def main():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=8, num_gpus=4) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=free_port()))
    out = {"worker_nodes": sorted(n.node_id for n in nodes), "node_gpus": sorted(cluster_node_gpus())}
    # what `seekserve deploy` warns of on this cluster, for a loopback bind and for all interfaces, and what the
    # command prints after deploying a config that binds the default loopback address
    out["bind_warning"] = {h: bind_warning(h, len(cluster_node_gpus())) for h in ("127.0.0.1", "0.0.0.0")}
    with contextlib.redirect_stderr(io.StringIO()) as err:
        _warn_bind(config("bind", 1, 1))
    out["deploy_stderr"] = err.getvalue()

    serve.run(build_app(config("tp4", 4, 2)), name="tp4", route_prefix="/tp4")
    out["tp4"] = placements("tp4", "tp4", 2)
    serve.delete("tp4")

    serve.run(build_app(config("tp2", 2, 4)), name="tp2", route_prefix="/tp2")
    out["tp2"] = placements("tp2", "tp2", 4)
    serve.delete("tp2")

    try:
        check_capacity(config("tp8", 8, 1), cluster_node_gpus())
        out["tp8_error"] = None
    except ConfigError as e:
        out["tp8_error"] = str(e)

    # 5 replicas of TP=2 on 8 GPUs: one cannot be placed and must say why
    serve._run(build_app(config("tp2x5", 2, 5)), name="tp2x5", route_prefix="/tp2x5", _blocking=False)
    msg, running = "", 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        d = serve.status().applications.get("tp2x5")
        if d and llm_deployment_name("tp2x5", "stable") in d.deployments:
            dep = d.deployments[llm_deployment_name("tp2x5", "stable")]
            msg, running = dep.message or "", dep.replica_states.get("RUNNING", 0)
            if "to be scheduled" in msg and running == 4:
                break
        time.sleep(1)
    out["tp2x5"] = {"running": running, "message": msg}
    from serve_app import status

    out["status_text"] = status.render(status.collect("tp2x5"))
    print("PROBE " + json.dumps(out), flush=True)
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
