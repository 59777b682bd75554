"""Builds the Ray Serve application from an :class:`AppConfig`."""

from __future__ import annotations

import ipaddress

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, HTTPOptions, gRPCOptions

from autoscale.ray_policy import QueueGpuAutoscalingPolicy
from cluster.placement import bundles, check_capacity, cluster_node_gpus

from serve_app.config import AppConfig, VariantConfig
from serve_app.deployments.direct import DirectServer
from serve_app.deployments.ingress import Ingress
from serve_app.deployments.llm_server import LLMServer

APP_NAME = "seekserve"

def llm_deployment_name(model: str, variant: str) -> str:
    return f"LLMServer-{model}-{variant}"


def autoscaling_config(v: VariantConfig) -> AutoscalingConfig | None:
    a = v.autoscaling
    if a is None:
        return None
    return AutoscalingConfig(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        initial_replicas=a.initial_replicas,
        metrics_interval_s=a.metrics_interval_s,
        look_back_period_s=a.look_back_period_s,
        # delays and cooldown live in our policy; Serve must not add its own
        upscale_delay_s=0,
        downscale_delay_s=0,
        policy=AutoscalingPolicy(
            policy_function=QueueGpuAutoscalingPolicy, policy_kwargs=a.policy.model_dump()
        ),
    )


# Serve reads these once, when a replica's process starts; per deployment, so other apps keep Serve's defaults
SHARED_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def replica_runtime_env(config: AppConfig) -> dict:
    """``ray_actor_options`` entries every seekserve replica gets: where ``server.user_code_loop`` resolves
    to 'shared', the environment that has Serve run our code on the replica's main loop (Ray merges a
    deployment's env_vars into the job's)."""
    if config.server.effective_user_code_loop() == "shared":
        return {"runtime_env": {"env_vars": dict(SHARED_LOOP_ENV)}}
    return {}


def logging_config(config: AppConfig) -> dict:
    """Serve's per-deployment logging settings."""
    return {"enable_access_log": config.server.access_log}


def _llm_options(model: str, v: VariantConfig, max_ongoing: int, max_queued: int, config: AppConfig) -> dict:
    """Serve options of the deployment that hosts a variant's engine: replicas, placement, resources."""
    scaling = autoscaling_config(v)
    replicas = {"autoscaling_config": scaling} if scaling else {"num_replicas": v.num_replicas}
    pg = bundles(v)
    placement = {"placement_group_bundles": pg, "placement_group_strategy": "STRICT_PACK"} if pg else {}
    return dict(
        name=llm_deployment_name(model, v.name),
        **replicas,
        **placement,
        max_ongoing_requests=max_ongoing,
        max_queued_requests=max_queued,
        ray_actor_options={
            "num_cpus": v.resources.num_cpus,
            # with TP the GPUs belong to the rank workers; a TP=1 replica holds its bundle's GPU itself
            "num_gpus": v.resources.num_gpus if v.tensor_parallel_size == 1 else 0,
            **replica_runtime_env(config),
        },
        health_check_period_s=10,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=60,
        logging_config=logging_config(config),
    )


def _llm_server_kwargs(model: str, v: VariantConfig, config: AppConfig) -> dict:
    """LLMServer's constructor arguments for one variant."""
    a = v.autoscaling
    return dict(
        model_name=model,
        variant=v.name,
        backend=v.engine.backend,
        engine_options=v.engine.options,
        max_tokens_default=config.limits.max_tokens_default,
        gpu_source=a.gpu_source if a else "nvml",
        gpu_sample_interval_s=a.gpu_sample_interval_s if a else 1.0,
        tensor_parallel_size=v.tensor_parallel_size,
        gpus_per_rank=v.resources.num_gpus,
        nccl=v.nccl.model_dump(),
        lora_adapter=v.lora_adapter,
        sampling=v.sampling.model_dump() if v.sampling else None,
        tracing=config.tracing.model_dump(),
        stream_interval_s=config.server.stream_interval_ms / 1000.0,
        engine_process=v.engine.process,
    )


def _direct_app(config: AppConfig):
    """``server.direct_streaming``: one deployment, the variant's replicas serving the API themselves. Its
    Serve-level bound is the front's (the proxy balances on it); the variant's own bound is applied inside,
    where it can still answer an OpenAI-shaped 429."""
    m = config.models[0]
    v = m.variants[0]
    limit = config.server.ingress_max_ongoing_requests
    return serve.deployment(DirectServer).options(**_llm_options(m.name, v, limit, limit, config)).bind(
        config.model_dump(), _llm_server_kwargs(m.name, v, config))


def build_app(config: AppConfig):
    if config.server.direct_streaming:
        return _direct_app(config)
    handles: dict[str, dict] = {}
    for m in config.models:
        for v in m.variants:
            max_ongoing = v.effective_max_ongoing_requests()
            # bound the callers' queues too: past this Serve raises BackPressureError -> 429
            options = _llm_options(m.name, v, max_ongoing, max_queued=max_ongoing, config=config)
            handles.setdefault(m.name, {})[v.name] = serve.deployment(LLMServer).options(**options).bind(
                **_llm_server_kwargs(m.name, v, config))
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=config.server.ingress_replicas,
        max_ongoing_requests=config.server.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": 0, **replica_runtime_env(config)},
        logging_config=logging_config(config),
    )
    return ingress.bind(config.model_dump(), handles)


def http_options(config: AppConfig) -> HTTPOptions:
    return HTTPOptions(host=config.server.host, port=config.server.http_port)


def bind_warning(host: str, alive_nodes: int) -> str | None:
    """What to tell an operator who deploys an API bound to a loopback address on a cluster of several nodes;
    None when the address is not loopback or the cluster is one node. Not an error: loopback behind an SSH
    tunnel or a proxy on the head is a deliberate choice, and the embedded default binds 127.0.0.1 so that
    `make serve` exposes nothing."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: what it resolves to is the operator's
        return None
    if not loopback or alive_nodes < 2:
        return None
    return (f"server.host is {host} on a cluster of {alive_nodes} nodes: each node's proxy answers only on its own "
            f"loopback, so clients on other machines are refused (and Serve's HAProxy cannot reach replicas on "
            f"other nodes); set server.host: 0.0.0.0 to serve them, with auth.mode: api_keys")


GRPC_SERVICERS = [
    "serve_app.protos.seekserve_pb2_grpc.add_InferenceServicer_to_server",
    # standard health checking; Ray's proxy routes Health/Check to Ingress.Check
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def grpc_options(config: AppConfig) -> gRPCOptions:
    return gRPCOptions(
        port=config.server.grpc_port,
        grpc_servicer_functions=GRPC_SERVICERS,
        request_timeout_s=config.timeouts.request_timeout_s + 5,
    )


def external_scaler(config: AppConfig) -> bool:
    """The rollout controller scales a rolled-back canary down through Serve's
    external-scaler API, which Serve allows only when no deployment autoscales."""
    return not any(v.autoscaling for m in config.models for v in m.variants)


def run_app(config: AppConfig, name: str = APP_NAME, route_prefix: str = "/", blocking: bool = False):
    return serve.run(build_app(config), name=name, route_prefix=route_prefix, blocking=blocking,
                     external_scaler_enabled=external_scaler(config))


def deploy(config: AppConfig, blocking: bool = False):
    """Start Serve on the connected Ray cluster and deploy the app."""
    check_capacity(config, cluster_node_gpus())
    serve.start(http_options=http_options(config), grpc_options=grpc_options(config))
    return run_app(config, blocking=blocking)


def app_builder(args: dict):
    """Ray Serve application builder for declarative configs (`serve deploy`, KubeRay):
    ``args: {app_config: {...}}`` inline, or ``args: {config_path: FILE}``."""
    from serve_app.config import load_config, parse_config

    if "app_config" in args:
        config = parse_config(args["app_config"])
    elif "config_path" in args:
        config = load_config(args["config_path"])
    else:
        raise ValueError("app_builder needs args.app_config or args.config_path")
    return build_app(config)
