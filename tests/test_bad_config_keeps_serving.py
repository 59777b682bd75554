"""A bad config is rejected before anything is applied: the running app keeps
serving the old one (nothing half-applied)."""

import subprocess
import sys
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_bad_app_config_is_rejected_and_the_old_app_keeps_serving(slow_null_app, tmp_path):
    url = slow_null_app["base"] + "/v1/models"
    assert httpx.get(url, timeout=30).json()["data"][0]["id"] == "slow"
    bad = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    bad["models"][0]["variants"][0]["weight"] = 50  # weights no longer sum to 100
    bad["server"]["http_port"] = 1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    r = subprocess.run([sys.executable, "-m", "serve_app.cli", "deploy", str(path), "--address", "auto"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert "models[0]: Value error" not in r.stderr and "sum to 100, got 50" in r.stderr
    # the running app is untouched
    assert httpx.get(url, timeout=30).json()["data"][0]["id"] == "slow"
