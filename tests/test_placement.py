"""Per-replica placement groups on a real 2-node Ray cluster with logical GPUs.

The cluster runs in a subprocess (tests/placement_probe.py): this session's own
Ray is already initialised and one process holds one Ray connection."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def probe():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "placement_probe.py")], capture_output=True,
                       text=True, timeout=420, cwd=ROOT, env=env)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line, f"probe failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return json.loads(line[len("PROBE "):])


def _gpu_ids_per_replica(rep):
    return [g for rank in rep["ranks"] for g in rank["gpu_ids"]]


@pytest.mark.slow
def test_tp4_gives_one_replica_per_node_on_distinct_gpus(probe):
    reps = probe["tp4"]
    assert len(reps) == 2
    assert sorted(r["node"] for r in reps) == probe["worker_nodes"]
    for rep in reps:
        assert [r["rank"] for r in rep["ranks"]] == [0, 1, 2, 3]
        assert {r["node_id"] for r in rep["ranks"]} == {rep["node"]}  # STRICT_PACK: never leaves the node
        ids = _gpu_ids_per_replica(rep)
        assert len(ids) == 4 and len(set(ids)) == 4
        assert all(r["nccl_env"]["NCCL_NVLS_ENABLE"] == "0" for r in rep["ranks"])
        assert all(r["nccl_env"]["NCCL_DEBUG"] == "WARN" for r in rep["ranks"])


@pytest.mark.slow
def test_tp2_fits_four_replicas_two_per_node(probe):
    reps = probe["tp2"]
    assert len(reps) == 4
    per_node = {}
    for rep in reps:
        assert {r["node_id"] for r in rep["ranks"]} == {rep["node"]}
        per_node.setdefault(rep["node"], []).extend(_gpu_ids_per_replica(rep))
    assert sorted(per_node) == probe["worker_nodes"]
    for ids in per_node.values():
        assert len(ids) == 4 and len(set(ids)) == 4  # no GPU handed to two ranks


@pytest.mark.slow
def test_tp8_is_rejected_with_the_reason(probe):
    assert "tensor_parallel_size 8" in probe["tp8_error"]
    assert "largest node has 4" in probe["tp8_error"]


@pytest.mark.slow
def test_unplaceable_replica_shows_pending_with_reason(probe):
    assert probe["tp2x5"]["running"] == 4
    assert "to be scheduled" in probe["tp2x5"]["message"]
    assert "to be scheduled" in probe["status_text"]


@pytest.mark.slow
def test_a_loopback_bind_on_a_cluster_of_several_nodes_is_warned_of(probe):
    # clients on other machines would be refused by every node's proxy: `seekserve deploy` says so and how to fix it
    warned = probe["bind_warning"]
    assert "server.host is 127.0.0.1 on a cluster of 3 nodes" in warned["127.0.0.1"]
    assert "set server.host: 0.0.0.0" in warned["127.0.0.1"]
    assert warned["0.0.0.0"] is None
    assert probe["deploy_stderr"].startswith("warning: server.host is 127.0.0.1 on a cluster of 3 nodes")


def test_a_loopback_bind_is_only_warned_of_where_other_machines_would_be_refused():
    from serve_app.app import bind_warning

    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert bind_warning(host, 1) is None  # one node: `make serve` on a laptop
        assert f"server.host is {host} on a cluster of 2 nodes" in bind_warning(host, 2)
    for host in ("0.0.0.0", "::", "10.0.0.5", "serve.internal"):
        assert bind_warning(host, 8) is None


def test_hf_tp_must_divide_smollm2_heads_and_use_the_dynamic_cache():
    def variant(tp, gpus=1, **options):
        return {"name": "v", "tensor_parallel_size": tp, "resources": {"num_gpus": gpus},
                "engine": {"backend": "hf", "options": {"model": "embedded:smollm2-135m-instruct", **options}}}

    def parse(v):
        return parse_config({"models": [{"name": "m", "variants": [v]}]})

    parse(variant(3))  # 9 heads, 3 KV heads
    parse(variant(3, gpus=0, device="cpu"))  # gloo ranks need no GPU
    with pytest.raises(ConfigError, match="does not divide the model's 9 attention heads and 3 KV heads"):
        parse(variant(2))
    with pytest.raises(ConfigError, match="static KV cache runs on one rank only"):
        parse(variant(3, kv_cache="static"))
    with pytest.raises(ConfigError, match="num_gpus >= 1"):
        parse(variant(3, gpus=0))  # device auto: GPU ranks unless it says cpu
    with pytest.raises(ConfigError, match="tensor_parallel_size: Input should be less than or equal to 64"):
        parse({**variant(3), "tensor_parallel_size": 65})


def test_tp_heads_divisibility_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 28, "num_key_value_heads": 4}))
    v = {"name": "v", "resources": {"num_gpus": 1}, "engine": {"backend": "trtllm", "options": {"model": str(tmp_path)}}}
    parse_config({"models": [{"name": "m", "variants": [{**v, "tensor_parallel_size": 4}]}]})
    with pytest.raises(ConfigError, match="does not divide the model's 28 attention heads and 4 KV heads"):
        parse_config({"models": [{"name": "m", "variants": [{**v, "tensor_parallel_size": 8}]}]})
    with pytest.raises(ConfigError, match="num_gpus >= 1"):
        parse_config({"models": [{"name": "m", "variants": [{**v, "tensor_parallel_size": 2,
                                                               "resources": {"num_gpus": 0}}]}]})


def test_bad_nccl_env_in_config_is_rejected_with_path():
    v = {"name": "v", "engine": {"backend": "null"}, "nccl": {"env": {"NCCL_NTHREADS": "8"}}}
    with pytest.raises(ConfigError, match=r"models\[0\]\.variants\[0\]\.nccl.*NCCL_NTHREADS"):
        parse_config({"models": [{"name": "m", "variants": [v]}]})
