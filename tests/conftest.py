"""Shared fixtures: one local Ray + Serve for the whole session, apps per module.

Ray Serve's HTTP proxy port is fixed once Serve starts, so every app in the
session shares it and is mounted under its own route prefix.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray workers inherit the driver's environment: the ingress reads the admin token from it
ADMIN_TOKEN = "test-admin-token"
os.environ["SEEKSERVE_ADMIN_TOKEN"] = ADMIN_TOKEN


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def started_engine(backend: str, options: dict, process: str = "inline"):
    """An engine as a replica creates it (``create_engine``), started, and shut down after."""
    from serve_app.engines.registry import create_engine

    eng = create_engine(backend, options, process=process)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


@pytest.fixture(scope="session")
def embedded_model_dir():
    """The dequantised SmolLM2 directory (built from the packaged GGUF on first use)."""
    from serve_app.engines.model_store import resolve_model_dir
    from serve_app.engines.options import EMBEDDED_SMOLLM2

    return resolve_model_dir(EMBEDDED_SMOLLM2)


@pytest.fixture(scope="session")
def tokenizer(embedded_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir, local_files_only=True)


@pytest.fixture(scope="session")
def serve_session():
    """A real local Ray cluster with Serve's HTTP proxy on a free loopback port."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from ray.serve.config import gRPCOptions

    from serve_app.app import GRPC_SERVICERS

    metrics_port = _free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    http_port, grpc_port = _free_port(), _free_port()
    serve.start(
        http_options=HTTPOptions(host="127.0.0.1", port=http_port),
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICERS),
    )
    yield {"http_port": http_port, "grpc_port": grpc_port, "base": f"http://127.0.0.1:{http_port}",
           "metrics_port": metrics_port}
    serve.shutdown()
    ray.shutdown()


SMOL = "smollm2"


@pytest.fixture(scope="session")
def smol_app(serve_session):
    """SmolLM2 on the hf engine, app 'smol' under /smol (shared by HTTP and gRPC tests)."""
    deploy_app(smol_config(SMOL, max_num_seqs=16), name="smol", route_prefix="/smol")
    return {"app": "smol", "base": serve_session["base"] + "/smol", "model": SMOL}


@pytest.fixture(scope="session")
def slow_null_app(serve_session):
    """A slow, tiny null engine: one running, one waiting, 2 s request timeout, app 'slownull'."""
    cfg = null_config("slow", num_tokens=40, tokens_per_s=10, max_num_seqs=1, max_waiting_requests=1)
    cfg["timeouts"] = {"request_timeout_s": 2.0, "retry_after_s": 3}
    deploy_app(cfg, name="slownull", route_prefix="/slow")
    return {"app": "slownull", "base": serve_session["base"] + "/slow", "model": "slow"}


def deploy_app(config_dict: dict, name: str, route_prefix: str):

    from serve_app.app import run_app
    from serve_app.config import parse_config

    cfg = parse_config(config_dict)
    run_app(cfg, name=name, route_prefix=route_prefix)
    return cfg


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s (last value {last!r})")


def null_config(model="null-model", **engine_options) -> dict:
    opts = {"num_tokens": 8, "tokens_per_s": 0}
    opts.update(engine_options)
    return {
        "models": [
            {
                "name": model,
                "variants": [{"name": "stable", "weight": 100, "engine": {"backend": "null", "options": opts}}],
            }
        ]
    }


def smol_config(model="smollm2", **engine_options) -> dict:
    opts = {"model": "embedded:smollm2-135m-instruct", "device": "cpu", "max_num_seqs": 32}
    opts.update(engine_options)
    return {
        "models": [
            {
                "name": model,
                "variants": [{"name": "stable", "weight": 100, "engine": {"backend": "hf", "options": opts}}],
            }
        ]
    }
