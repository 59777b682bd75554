"""seekserve's Prometheus metrics, exported through Ray's metrics pipeline
(``ray.serve.metrics``): a Prometheus that scrapes each Ray node's metrics
export port sees them, with Ray's node / replica labels added.

See docs/observability.md for the table of names, types and labels.
Metric objects are created lazily per process: Ray allows a name once.
"""

from __future__ import annotations

import functools

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 60.0]
ITL_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28]


@functools.cache
def _m():
    from ray.serve.metrics import Counter, Gauge, Histogram

    v = ("model", "variant")
    return {
        "ttft": Histogram("seekserve_time_to_first_token_seconds", "Time to first token at the replica.",
                          boundaries=LATENCY_BUCKETS_S, tag_keys=v),
        "itl": Histogram("seekserve_inter_token_latency_seconds", "Time between streamed tokens.",
                         boundaries=ITL_BUCKETS_S, tag_keys=v),
        "e2e": Histogram("seekserve_e2e_request_latency_seconds", "End-to-end latency at the ingress.",
                         boundaries=LATENCY_BUCKETS_S, tag_keys=v),
        "queue": Histogram("seekserve_queue_time_seconds", "Time a request waited in the engine's queue.",
                           boundaries=LATENCY_BUCKETS_S, tag_keys=v),
        "running": Gauge("seekserve_requests_running", "Sequences in the engine's batch.", tag_keys=v),
        "waiting": Gauge("seekserve_requests_waiting", "Requests in the engine's waiting queue.", tag_keys=v),
        "kv": Gauge("seekserve_kv_cache_usage_ratio", "KV-cache tokens used over the budget (0..1).", tag_keys=v),
        "prompt_tokens": Counter("seekserve_prompt_tokens_total", "Prompt tokens processed.", tag_keys=v),
        "gen_tokens": Counter("seekserve_generation_tokens_total", "Tokens generated.", tag_keys=v),
        "requests": Counter("seekserve_requests_total", "Requests by outcome at the ingress.",
                            tag_keys=("model", "variant", "status_code", "error_type")),
        "replica_retries": Counter("seekserve_replica_retries_total",
                                   "Requests re-sent because their replica died before any token was sent.",
                                   tag_keys=("model",)),
        "gpu_util": Gauge("seekserve_gpu_utilization_ratio", "GPU utilisation (NVML, smoothed), 0..1.",
                          tag_keys=("model", "variant", "gpu")),
        "gpu_mem_used": Gauge("seekserve_gpu_memory_used_bytes", "GPU memory used.",
                              tag_keys=("model", "variant", "gpu")),
        "gpu_mem_total": Gauge("seekserve_gpu_memory_total_bytes", "GPU memory in total.",
                               tag_keys=("model", "variant", "gpu")),
        "load": Gauge("seekserve_engine_load_seconds", "Time the engine took to load and warm up.", tag_keys=v),
        "rollout_weight": Gauge("seekserve_rollout_weight_percent", "Traffic weight of each variant.",
                                tag_keys=("model", "variant")),
        "rollout_phase": Gauge("seekserve_rollout_phase", "1 for the rollout's current phase, 0 for the others.",
                               tag_keys=("model", "rollout", "phase")),
        "gate": Gauge("seekserve_rollout_gate_value", "Last value of each rollout gate.",
                      tag_keys=("model", "rollout", "metric")),
    }


def get(name: str):
    return _m()[name]


def tags(model: str, variant: str) -> dict[str, str]:
    return {"model": model, "variant": variant}
