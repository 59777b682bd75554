"""Replica placement: one placement group per replica, one bundle per TP rank.

A replica of tensor_parallel_size N reserves N GPU bundles with STRICT_PACK,
so its ranks never leave one node (one NVLink domain). The replica actor sits
in bundle 0 next to rank 0. Backends that start their own rank workers
(TensorRT-LLM's Ray executor) are pointed at these bundles; for the others the
LLMServer starts one :class:`RankWorker` per bundle.
"""

from __future__ import annotations

import os

from serve_app.config import AppConfig, ConfigError, VariantConfig


def bundles(v: VariantConfig) -> list[dict[str, float]] | None:
    tp = v.tensor_parallel_size
    g = v.resources.num_gpus
    if tp == 1:
        # a GPU replica still gets its own placement group: the same path for every GPU size,
        # and the GPU is reserved before the replica (and its engine) starts
        return [{"CPU": v.resources.num_cpus, "GPU": g}] if g > 0 else None
    # a CPU-only TP group (hf on gloo) asks for no GPU key at all
    gpu = {"GPU": g} if g > 0 else {}
    first = {"CPU": v.resources.num_cpus + 1.0, **gpu}
    return [first] + [{"CPU": 1.0, **gpu} for _ in range(tp - 1)]


def check_capacity(config: AppConfig, node_gpus: list[float]) -> None:
    """Reject a TP size that no node of the cluster can hold (STRICT_PACK never spans nodes)."""
    largest = max(node_gpus, default=0.0)
    problems = []
    for m in config.models:
        for v in m.variants:
            need = v.tensor_parallel_size * v.resources.num_gpus
            if v.tensor_parallel_size > 1 and need > largest:
                problems.append(
                    f"models[{m.name}].variants[{v.name}]: tensor_parallel_size {v.tensor_parallel_size} x "
                    f"{v.resources.num_gpus:g} GPU needs {need:g} GPUs on one node; the largest node has {largest:g}"
                )
    if problems:
        raise ConfigError("; ".join(problems))


def cluster_node_gpus() -> list[float]:
    import ray

    return [float(n["Resources"].get("GPU", 0.0)) for n in ray.nodes() if n.get("Alive")]


def _rank_worker_class():
    import ray

    @ray.remote
    class RankWorker:
        """Holds one TP rank's GPU bundle and reports where it landed."""

        def __init__(self, rank: int, world_size: int, env: dict):
            os.environ.update(env)
            self.rank, self.world_size = rank, world_size

        def info(self) -> dict:
            return {**replica_placement(self.rank),
                    "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}

        def free_address(self) -> str:
            """host:port for a process group's rendezvous, on this rank's node."""
            import socket

            ip = ray.util.get_node_ip_address()
            with socket.socket() as s:
                s.bind((ip, 0))
                return f"{ip}:{s.getsockname()[1]}"

        def host(self, factory: str, kwargs: dict) -> None:
            """Build the engine's per-rank object (``module:Class``) in this worker."""
            import importlib

            module, _, name = factory.partition(":")
            self.hosted = getattr(importlib.import_module(module), name)(**kwargs)

        def call(self, method: str, *args):
            return getattr(self.hosted, method)(*args)

        def ping(self) -> bool:
            return True

    return RankWorker


def replica_placement(rank: int = 0) -> dict:
    """Where the calling actor (a TP rank worker, or a TP=1 replica holding its GPU itself) landed."""
    import ray

    ctx = ray.get_runtime_context()
    return {"rank": rank, "node_id": ctx.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(), "placement_group": ctx.get_placement_group_id()}


def start_rank_workers(tp: int, gpus_per_rank: float, env: dict) -> list:
    """One worker per bundle of the calling replica's placement group."""
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError("tensor_parallel_size > 1 but the replica has no placement group")
    cls = _rank_worker_class()
    return [
        cls.options(
            # a second thread answers health pings while a long step runs
            max_concurrency=2,
            num_cpus=1,
            num_gpus=gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
            runtime_env={"env_vars": dict(env)},
        ).remote(i, tp, env)
        for i in range(tp)
    ]
