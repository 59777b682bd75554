"""Application configuration (pydantic v2), loaded from YAML.

Every field has a description; unknown keys are rejected; cross-field rules
live in ``model_validator(mode="after")``. :func:`load_config` reports each
problem with its field path (``models[0].variants[1].weight: ...``).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator

from autoscale.policy import PolicyConfig
from serve_app._model import StrictModel
from serve_app.engines.options import MAX_TENSOR_PARALLEL, OPTIONS_BY_BACKEND, SEPARATE_PROCESS_BACKENDS
from serve_app.engines.registry import UnknownEngineError, options_model_for

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _check_name(v: str) -> str:
    if not _NAME.match(v):
        raise ValueError("must be 1-128 of letters, digits, '.', '_' or '-', starting alphanumeric")
    return v


# model and variant names travel in URLs, headers and deployment names
Name = Annotated[str, AfterValidator(_check_name)]


class ConfigError(ValueError):
    """A configuration file or object is invalid; the message names each field."""


class EngineSpec(StrictModel):
    backend: str = Field(description="Registered engine backend name (hf, null, trtllm).")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Backend-specific options, validated by the backend's schema."
    )
    process: Literal["auto", "inline", "separate"] = Field(
        "auto",
        description="Where the engine runs: 'inline' in the replica's process, or 'separate' in a child "
        "process of its own (vLLM V1's layout), so that its scheduling and kernel launches do not share "
        "a GIL with the replica's event loop; the replica keeps tokenizing; one rank only. 'auto': "
        "separate for an hf engine of one rank on a GPU (measured there: 99 % of the engine alone's "
        "tok/s at 64 concurrent against 86 % inline), inline otherwise (on a CPU host the extra "
        "process competes for the cores; docs/engines.md).",
    )

    @model_validator(mode="after")
    def _validate_options(self) -> "EngineSpec":
        try:
            schema = options_model_for(self.backend)
        except UnknownEngineError as e:
            raise ValueError(str(e)) from e
        try:
            validated = schema.model_validate(self.options)
        except ValidationError as e:
            raise ValueError(f"engine.options for backend {self.backend!r}: {format_errors(e)}") from e
        # store the normalised form so replicas receive complete, defaulted options
        object.__setattr__(self, "options", validated.model_dump())
        if self.process == "separate" and self.backend in OPTIONS_BY_BACKEND \
                and self.backend not in SEPARATE_PROCESS_BACKENDS:
            raise ValueError(
                f"engine.process 'separate' is not available for the {self.backend!r} backend; "
                f"it is for: {', '.join(sorted(SEPARATE_PROCESS_BACKENDS))}"
            )
        return self


class ReplicaResources(StrictModel):
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved by each LLMServer replica.")
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs per tensor-parallel rank (the whole replica when tensor_parallel_size is 1)."
    )


class NcclSpec(StrictModel):
    profile: Literal["auto", "nvlink", "pcie", "multi_node_ib", "multi_node_tcp", "none"] = Field(
        "auto", description="NCCL profile; 'auto' reads the node's NVLink topology from NVML at replica start."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="NCCL_* overrides on top of the profile, validated against NCCL's ranges."
    )
    socket_ifname: str | None = Field(None, description="NCCL_SOCKET_IFNAME for multi-node profiles.")
    ib_hca: str | None = Field(None, description="NCCL_IB_HCA for the multi_node_ib profile.")
    multicast_allowed: bool = Field(
        False, description="Allow NVLink multicast (NVLS). Off by default: some platforms forbid it."
    )

    @model_validator(mode="after")
    def _check(self) -> "NcclSpec":
        from cluster.nccl import NcclConfigError, check

        try:
            check(self.env, None if self.profile in ("auto", "none") else self.profile, self.multicast_allowed)
        except NcclConfigError as e:
            raise ValueError(f"nccl.env: {e}") from e
        return self

    def resolve(self, detected_topology: str | None) -> dict[str, str]:
        from cluster.nccl import check, profile

        topo = detected_topology if self.profile == "auto" else self.profile
        env = {} if self.profile == "none" or topo is None else profile(
            topo, self.socket_ifname, self.ib_hca, self.multicast_allowed)
        if not self.multicast_allowed:
            env.setdefault("NCCL_NVLS_ENABLE", "0")
        env.update(self.env)
        check(env, topo, self.multicast_allowed)
        return env


_GPU_SOURCE = re.compile(r"^(nvml|none|fake:\d+(\.\d+)?:\d+(\.\d+)?)$")


class AutoscalingSpec(StrictModel):
    min_replicas: int = Field(1, ge=1, le=1024, description="Fewest replicas.")
    max_replicas: int = Field(4, ge=1, le=1024, description="Most replicas.")
    initial_replicas: int | None = Field(None, ge=1, description="Replicas at deploy time; default min.")
    metrics_interval_s: float = Field(2.0, gt=0, description="How often replicas report their signals.")
    look_back_period_s: float = Field(10.0, gt=0, description="Window Serve averages the signals over.")
    gpu_source: str = Field(
        "nvml",
        description="Where GPU utilisation comes from: 'nvml', 'none' (queue only), or "
        "'fake:<busy_pct>:<idle_pct>' (a fake for CPU-only tests).",
    )
    gpu_sample_interval_s: float = Field(1.0, gt=0, description="NVML sampling interval (EMA smoothed).")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Decision thresholds and delays.")

    @field_validator("gpu_source")
    @classmethod
    def _gpu_source(cls, v: str) -> str:
        if not _GPU_SOURCE.match(v):
            raise ValueError(f"{v!r} is not one of nvml, none, fake:<busy_pct>:<idle_pct>")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        init = self.initial_replicas
        if init is not None and not self.min_replicas <= init <= self.max_replicas:
            raise ValueError(f"initial_replicas ({init}) is outside [{self.min_replicas}, {self.max_replicas}]")
        return self


class SamplingOverrides(StrictModel):
    temperature: float | None = Field(None, ge=0, le=2, description="Replaces the request's temperature.")
    top_p: float | None = Field(None, gt=0, le=1, description="Replaces the request's top_p.")


class VariantConfig(StrictModel):
    name: Name = Field(description="Variant name, unique within its model (e.g. stable, canary).")
    weight: int = Field(100, ge=0, le=100, description="Share of the model's traffic, percent.")
    engine: EngineSpec = Field(description="Which engine serves this variant, and its options.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs (ranks) per replica.")
    num_replicas: int = Field(1, ge=1, le=1024, description="Replicas when autoscaling is off.")
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Ray Serve's per-replica concurrency cap; default: the engine's batch "
        "plus its waiting queue, so that the engine's own bound answers 429 first.",
    )
    resources: ReplicaResources = Field(
        default_factory=ReplicaResources, description="Resources each replica reserves."
    )
    autoscaling: AutoscalingSpec | None = Field(
        None, description="Autoscale on queue depth and GPU utilisation; num_replicas is then ignored."
    )
    nccl: NcclSpec = Field(default_factory=NcclSpec, description="NCCL environment for the TP ranks.")
    lora_adapter: str | None = Field(
        None, description="Serve this variant through a LoRA adapter of the engine (trtllm)."
    )
    sampling: SamplingOverrides | None = Field(
        None, description="Sampling this variant forces on every request (e.g. to canary a new default)."
    )

    @model_validator(mode="after")
    def _tensor_parallel(self) -> "VariantConfig":
        tp = self.tensor_parallel_size
        backend = self.engine.backend
        limit = MAX_TENSOR_PARALLEL.get(backend)
        if limit is not None and tp > limit:
            raise ValueError(
                f"tensor_parallel_size {tp}: the {backend!r} backend runs at most {limit} rank(s)"
            )
        if tp > 1 and self.engine.process == "separate":
            raise ValueError(
                f"tensor_parallel_size {tp}: engine.process 'separate' runs one rank; use 'inline'"
            )
        cpu_ranks = backend == "hf" and self.engine.options.get("device") == "cpu"
        if tp > 1 and self.resources.num_gpus <= 0 and not cpu_ranks:
            raise ValueError(
                f"tensor_parallel_size {tp} needs resources.num_gpus >= 1 (GPUs per rank), "
                "or the hf backend with engine.options.device 'cpu' (gloo ranks)"
            )
        if tp > 1 and backend == "hf" and self.engine.options.get("quantization", "none") != "none":
            raise ValueError(
                f"tensor_parallel_size {tp}: the hf backend's quantization "
                f"{self.engine.options['quantization']!r} runs on one rank only"
            )
        if tp > 1 and backend == "hf" and self.engine.options.get("kv_cache") == "static":
            raise ValueError(
                f"tensor_parallel_size {tp}: the hf backend's static KV cache runs on one rank only; "
                "use kv_cache 'dynamic' (or 'auto')"
            )
        heads = model_heads(backend, self.engine.options) if tp > 1 else None
        if heads is not None:
            n_heads, n_kv = heads
            if n_heads % tp or n_kv % tp:
                raise ValueError(
                    f"tensor_parallel_size {tp} does not divide the model's {n_heads} attention heads "
                    f"and {n_kv} KV heads"
                )
        if self.lora_adapter is not None:
            adapters = (self.engine.options.get("lora") or {}).get("adapters", {})
            if self.lora_adapter not in adapters:
                raise ValueError(
                    f"lora_adapter {self.lora_adapter!r} is not among engine.options.lora.adapters {sorted(adapters)}"
                )
        return self

    def effective_max_ongoing_requests(self) -> int:
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        opts = self.engine.options
        return int(opts.get("max_num_seqs", 64)) + int(opts.get("max_waiting_requests", 64)) + 8


class SamplingDefaults(StrictModel):
    """The sampling a request gets for the fields it leaves out; a request's own values always win."""

    temperature: float = Field(1.0, ge=0.0, le=2.0,
                               description="Temperature of requests that name none (0 is greedy); OpenAI's is 1.0.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass of requests that name none; OpenAI's is 1.0.")


class ModelConfig(StrictModel):
    name: Name = Field(description="The model name clients send in the 'model' field.")
    variants: list[VariantConfig] = Field(min_length=1, description="Variants serving this model.")
    sampling_defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults,
        description="Sampling for the fields a request leaves out, as vLLM takes it from a model's "
                    "generation_config.json (a small model samples sensibly only at its recommended temperature). "
                    "Default: OpenAI's, temperature 1.0 and top_p 1.0.")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        names = [v.name for v in self.variants]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate variant names: {sorted(dup)}")
        total = sum(v.weight for v in self.variants)
        if total != 100:
            raise ValueError(f"variant weights must sum to 100, got {total}")
        return self


class LimitsConfig(StrictModel):
    max_tokens_default: int = Field(
        256, ge=1, description="max_tokens when a request names none (capped by the context left)."
    )
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_stop_sequences: int = Field(4, ge=0, le=64, description="Most stop strings per request.")
    max_stop_length: int = Field(256, ge=1, description="Longest stop string, in characters.")
    max_top_logprobs: int = Field(20, ge=0, le=100, description="Largest top_logprobs per request.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body accepted.")
    max_prompt_chars: int = Field(
        1 << 20, ge=1, description="Longest prompt text before tokenizing (cheap early rejection)."
    )

    @model_validator(mode="after")
    def _check(self) -> "LimitsConfig":
        if self.max_tokens_default > self.max_tokens_limit:
            raise ValueError(
                f"max_tokens_default ({self.max_tokens_default}) exceeds max_tokens_limit "
                f"({self.max_tokens_limit})"
            )
        return self


class TimeoutsConfig(StrictModel):
    request_timeout_s: float = Field(
        300.0, gt=0, description="End-to-end limit of one request; past it: 504 and abort."
    )
    first_token_timeout_s: float | None = Field(
        None, gt=0, description="Limit on waiting for the first token; default: request_timeout_s."
    )
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After advertised with 429.")
    replica_failure_retries: int = Field(
        2, ge=0, le=5,
        description="Times a request is re-sent to another replica when its replica dies before the client "
        "got any token (non-streaming requests, and streams before their first chunk).",
    )
    replica_failure_backoff_s: float = Field(
        0.2, ge=0, le=10, description="Pause before the first re-send; doubled for each later one."
    )


class ServerConfig(StrictModel):
    host: str = Field("127.0.0.1", description="Address the HTTP (and gRPC) proxy binds.")
    http_port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP port.")
    grpc_port: int = Field(9000, ge=1, le=65535, description="gRPC port.")
    ingress_max_ongoing_requests: int = Field(
        2048, ge=1, description="Concurrency cap of each ingress replica (with direct_streaming, Serve's cap of "
        "each LLMServer replica; the variant's own max_ongoing_requests still answers 429 past its bound)."
    )
    ingress_replicas: int = Field(1, ge=1, le=64, description="Ingress replicas.")
    stream_interval_ms: float = Field(
        0.0, ge=0, le=1000,
        description="Streaming pace: after the first chunk, a stream's tokens are sent at most once per "
        "this interval, merged (vLLM's stream_interval). 0 sends every token as soon as the "
        "transport is free. 20-50 keeps many fast GPU streams from saturating the serving processes.",
    )
    direct_streaming: bool = Field(
        False,
        description="The model's LLMServer replicas serve the HTTP and gRPC APIs themselves, with no "
        "Ingress deployment in front (Ray Serve LLM's direct streaming): one Ray hop fewer each way for "
        "every request and every streamed message. Needs exactly one model with one variant and "
        "rollouts off (there is no split to route); the replicas' count is the variant's. Pair it with "
        "the HAProxy data path (`seekserve serve --http-proxy haproxy`) to take Serve's Python proxy "
        "out of the path as well.",
    )
    access_log: bool = Field(
        True,
        description="Ray Serve's access log: one line per request (method, route, status, latency) in each "
        "replica's log file under the Ray session's logs/serve and on its stderr (Serve's LoggingConfig."
        "enable_access_log, on by default; Serve's Python HTTP proxy, where it is in the path, logs its own). "
        "Off saves each request's formatting and two writes on the replica's loop (no difference measured on "
        "the CPU box, docs/operations.md); spans and metrics are unchanged.",
    )
    user_code_loop: Literal["auto", "separate", "shared"] = Field(
        "auto",
        description="Where each replica runs our code. 'shared' runs it on the replica's main loop, which also "
        "answers Serve's control calls and, on the HAProxy data path, HTTP (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_"
        "THREAD=0 and RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 in the replicas, as Ray Serve LLM sets for the "
        "ingress router of its direct streaming); safe for seekserve's deployments, which never block their "
        "loop. 'separate' is Ray Serve's own default: a thread and event loop of their own, so every request "
        "and streamed message crosses between two threads. 'auto' (the default) is 'shared' with "
        "direct_streaming, where it took ~8 ms off the first token at 64 streams on an H200, and 'separate' "
        "with an Ingress deployment, where on the CPU box it cost unary requests ~2-3 ms.",
    )

    def effective_user_code_loop(self) -> str:
        """'separate' or 'shared': what 'auto' resolves to for this layout."""
        if self.user_code_loop == "auto":
            return "shared" if self.direct_streaming else "separate"
        return self.user_code_loop

    @model_validator(mode="after")
    def _check(self) -> "ServerConfig":
        if self.http_port == self.grpc_port:
            raise ValueError(f"http_port and grpc_port are both {self.http_port}")
        return self


class RolloutSettings(StrictModel):
    enabled: bool = Field(True, description="Run the rollout controller (canary plans, automatic rollback).")
    db_path: str = Field(
        "~/.seekserve/{app}/rollouts.db",
        description="SQLite file (WAL) on the head node for rollout state and the audit log; '{app}' is "
        "replaced by the Serve application name.",
    )
    tick_s: float = Field(1.0, gt=0, description="How often the controller advances rollouts.")
    split_poll_s: float = Field(0.25, gt=0, description="How often each ingress replica picks up new weights.")


class TracingSettings(StrictModel):
    exporter: Literal["none", "console", "file", "otlp"] = Field(
        "none", description="Where sampled spans go: nowhere, stdout, an OTLP JSON-lines file, or an OTLP/HTTP endpoint."
    )
    file_path: str = Field("~/.seekserve/traces.jsonl", description="File for the 'file' exporter.")
    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces endpoint; default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or localhost."
    )
    sampling_ratio: float = Field(
        1.0, ge=0, le=1, description="Share of traces exported (all are recorded for rollout gates)."
    )


class AuthSettings(StrictModel):
    mode: Literal["off", "api_keys"] = Field(
        "off", description="'api_keys': every inference call (HTTP and gRPC) needs a valid client key."
    )
    api_keys_file: str | None = Field(None, description="File of 'name:sha256hex' lines (keys hashed at rest).")
    api_keys_env: str | None = Field(
        "SEEKSERVE_API_KEYS", description="Environment variable with comma-separated 'name:sha256hex' entries."
    )
    rate_limit_per_s: float = Field(20.0, gt=0, description="Requests per second per key (token bucket).")
    burst: int = Field(40, ge=1, description="Requests a key may send at once before the rate applies.")
    max_concurrent_per_key: int = Field(64, ge=1, description="Requests in flight per key; more get 429.")

    @model_validator(mode="after")
    def _check(self) -> "AuthSettings":
        if self.mode == "api_keys" and not (self.api_keys_file or self.api_keys_env):
            raise ValueError("mode 'api_keys' needs api_keys_file or api_keys_env")
        return self


class AdminSettings(StrictModel):
    token_env: str = Field(
        "SEEKSERVE_ADMIN_TOKEN",
        description="Environment variable holding the admin token (rollout control, variant override). "
        "Unset: the admin API refuses every call.",
    )


class AppConfig(StrictModel):
    models: list[ModelConfig] = Field(min_length=1, description="Served models.")
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="Canary rollouts.")
    admin: AdminSettings = Field(default_factory=AdminSettings, description="Admin API access.")
    tracing: TracingSettings = Field(default_factory=TracingSettings, description="OpenTelemetry traces.")
    auth: AuthSettings = Field(default_factory=AuthSettings, description="Client API keys and per-key limits.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig, description="Timeouts.")
    server: ServerConfig = Field(default_factory=ServerConfig, description="Network endpoints.")

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate model names: {sorted(dup)}")
        if self.server.direct_streaming:
            self._check_direct_streaming()
        n, a = self.ingress_replica_count(), self.auth
        if a.mode == "api_keys" and n > 1 and (a.burst < n or a.max_concurrent_per_key < n):
            raise ValueError(
                f"auth: each of the {n} ingress replicas enforces 1/{n} of the per-key limits, so burst "
                f"({a.burst}) and max_concurrent_per_key ({a.max_concurrent_per_key}) must be at least {n}"
            )
        return self

    def _check_direct_streaming(self) -> None:
        variants = [(m.name, v) for m in self.models for v in m.variants]
        if len(variants) != 1:
            raise ValueError(
                f"server.direct_streaming serves exactly one model with one variant, and this config has "
                f"{len(variants)} variants over {len(self.models)} models; set server.direct_streaming: false "
                "to route between them")
        if self.rollout.enabled:
            raise ValueError("server.direct_streaming has a single variant and nothing to roll out: "
                             "set rollout.enabled: false")
        if self.server.ingress_replicas != 1:
            raise ValueError(f"server.ingress_replicas is {self.server.ingress_replicas}, but there is no Ingress "
                             "deployment with server.direct_streaming: the variant's replicas (num_replicas or "
                             "autoscaling) serve the API")
        model, v = variants[0]
        if self.auth.mode == "api_keys" and v.autoscaling is not None:
            raise ValueError(
                f"auth: each replica enforces its share of the per-key limits, which needs a fixed count; "
                f"model {model!r} autoscales, so use server.direct_streaming: false (a fixed Ingress) or "
                "a fixed num_replicas")

    def ingress_replica_count(self) -> int:
        """Replicas that serve the API: the Ingress deployment's, or with direct streaming the variant's."""
        if self.server.direct_streaming:
            return self.models[0].variants[0].num_replicas
        return self.server.ingress_replicas

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


def model_heads(backend: str, options: dict) -> tuple[int, int] | None:
    """(attention heads, KV heads) of the variant's model, read from local files; None if unknown."""
    from serve_app.engines.options import EMBEDDED_SMOLLM2

    model = options.get("model")
    if backend not in ("hf", "trtllm") or not model:
        return None
    if model == EMBEDDED_SMOLLM2:
        return _gguf_heads()
    cfg_path = Path(model).expanduser() / "config.json"
    if not cfg_path.exists():
        return None
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg.get("num_attention_heads")
    if heads is None:
        return None
    return int(heads), int(cfg.get("num_key_value_heads", heads))


@functools.lru_cache(maxsize=1)
def _gguf_heads() -> tuple[int, int] | None:
    try:
        from gguf import GGUFReader

        from serve_app.engines.model_store import _gguf_path

        reader = GGUFReader(_gguf_path())
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

        def value(key):
            f = reader.fields[f"{arch}.{key}"]
            return int(f.parts[f.data[0]][0])

        return value("attention.head_count"), value("attention.head_count_kv")
    except Exception:  # the package is absent: nothing to check against
        return None


def format_errors(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        path = ""
        for loc in err["loc"]:
            path += f"[{loc}]" if isinstance(loc, int) else (f".{loc}" if path else str(loc))
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{path or '<root>'}: {msg}")
    return "; ".join(parts)


def parse_config(data: Any) -> AppConfig:
    try:
        return AppConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e)) from e


def load_config(path: str | Path) -> AppConfig:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from e
