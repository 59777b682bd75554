"""Config validation: field paths and reasons, unknown backends, cross-field rules."""

import pytest

from serve_app.cli import DEFAULT_CONFIG
from serve_app.config import ConfigError, load_config, parse_config
from serve_app.engines.registry import UnknownEngineError, get_engine_class
from tests.conftest import null_config


def test_shipped_default_config_is_valid():
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.models[0].variants[0].engine.backend == "hf"
    # options are normalised with the backend's defaults
    assert cfg.models[0].variants[0].engine.options["max_waiting_requests"] == 128


def test_unknown_backend_lists_valid_ones():
    data = null_config()
    data["models"][0]["variants"][0]["engine"]["backend"] = "vllmx"
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    msg = str(e.value)
    assert "models[0].variants[0].engine" in msg
    assert "vllmx" in msg and "hf" in msg and "null" in msg


def test_unknown_key_is_rejected_with_path():
    data = null_config()
    data["models"][0]["variants"][0]["wieght"] = 50
    with pytest.raises(ConfigError, match=r"models\[0\]\.variants\[0\]\.wieght"):
        parse_config(data)


def test_backend_option_error_names_the_option():
    data = null_config(num_tokens=0)
    with pytest.raises(ConfigError, match=r"num_tokens"):
        parse_config(data)


def test_weights_must_sum_to_100():
    data = null_config()
    data["models"][0]["variants"].append(
        {"name": "canary", "weight": 20, "engine": {"backend": "null"}}
    )
    with pytest.raises(ConfigError, match="sum to 100, got 120"):
        parse_config(data)


def test_duplicate_variants_and_models():
    data = null_config()
    data["models"][0]["variants"][0]["weight"] = 50
    data["models"][0]["variants"].append({"name": "stable", "weight": 50, "engine": {"backend": "null"}})
    with pytest.raises(ConfigError, match="duplicate variant"):
        parse_config(data)
    data = null_config()
    data["models"].append(null_config()["models"][0])
    with pytest.raises(ConfigError, match="duplicate model"):
        parse_config(data)


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="max_tokens_default"):
        parse_config({**null_config(), "limits": {"max_tokens_default": 100, "max_tokens_limit": 10}})
    with pytest.raises(ConfigError, match="http_port and grpc_port"):
        parse_config({**null_config(), "server": {"http_port": 9000, "grpc_port": 9000}})
    data = null_config()
    data["models"][0]["variants"][0]["engine"] = {
        "backend": "hf",
        "options": {"max_model_len": 4096, "max_kv_tokens": 1024},
    }
    with pytest.raises(ConfigError, match="max_model_len"):
        parse_config(data)


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("models: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)


def test_engine_registry_unknown_name_lists_valid_ones():
    with pytest.raises(UnknownEngineError, match="hf, null"):
        get_engine_class("nope")


@pytest.mark.parametrize("direct,loop,env", [
    (False, "auto", None), (True, "auto", "0"), (False, "shared", "0"), (True, "separate", None)])
def test_where_replicas_run_our_code_follows_the_layout_unless_set(direct, loop, env):
    # 'auto': on the replica's main loop only where the replica serves HTTP itself (direct streaming)
    from serve_app.app import replica_runtime_env

    data = null_config()
    data["server"] = {"user_code_loop": loop, **({"direct_streaming": True} if direct else {})}
    if direct:
        data["rollout"] = {"enabled": False}
    got = replica_runtime_env(parse_config(data)).get("runtime_env", {}).get("env_vars", {})
    assert got.get("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD") == env
    assert got.get("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP") == env


def test_the_gpu_canary_example_and_its_plan_fit_each_other():
    """configs/gpu-7b-fp8-canary.yaml and configs/plans/fp8-canary.yaml: the plan names the config's model and
    variants as the rollout controller checks them at start, and the canary differs from stable only in FP8."""
    from pathlib import Path

    import yaml

    from rollout.plan import RolloutPlan, SetWeightStep

    root = Path(__file__).resolve().parent.parent
    cfg = parse_config(yaml.safe_load((root / "configs" / "gpu-7b-fp8-canary.yaml").read_text()))
    plan = RolloutPlan.model_validate(yaml.safe_load((root / "configs" / "plans" / "fp8-canary.yaml").read_text()))
    model = next(m for m in cfg.models if m.name == plan.model)
    variants = {v.name: v for v in model.variants}
    assert variants[plan.stable].weight == 100 and variants[plan.canary].weight == 0
    assert cfg.rollout.enabled and not cfg.server.direct_streaming
    stable, canary = variants[plan.stable].engine.options, variants[plan.canary].engine.options
    apart = {k for k in stable.keys() | canary.keys() if stable.get(k) != canary.get(k)}
    assert apart == {"quantization"} and canary["quantization"] == "fp8"
    weights = [s.set_weight for s in plan.steps if isinstance(s, SetWeightStep)]
    assert weights == sorted(weights) and weights[-1] == 100
    assert {"confidence", "drift_cdi"} <= {g.metric for g in plan.all_gates()}  # gated on answers, not speed alone
