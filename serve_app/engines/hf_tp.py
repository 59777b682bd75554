"""Tensor parallelism for the hf backend: transformers' TP plan over torch.distributed.

Each rank worker of the replica's placement group (:mod:`cluster.placement`)
hosts one :class:`TensorParallelShard`: it joins a process group (NCCL on
GPU, gloo on CPU) and loads the model with ``DistributedConfig(tp_plan="auto")``,
so attention heads, KV heads and MLP columns are split across the ranks and
the logits come back whole. The replica's engine thread keeps scheduling and
sampling; :class:`TensorParallelRunner` sends every step to all ranks at once
(each holds its slice of the batch's KV cache, with the same row layout) and
reads the logits of rank 0. Ranks execute the same calls in the same order,
which is what keeps their collectives matched.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

from serve_app.errors import EngineError, EngineNotReadyError

from .base import ParallelConfig
from .hf_batch import LocalRunner, resolve_device_dtype
from .options import HFEngineOptions

log = logging.getLogger(__name__)

SHARD_FACTORY = "serve_app.engines.hf_tp:TensorParallelShard"


class TensorParallelShard:
    """One rank's slice of the model and of the running batch's KV cache."""

    def __init__(self, rank: int, world_size: int, master: str, model_dir: str, options: dict, pad_id: int):
        import torch
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        opts = HFEngineOptions.model_validate(options)
        device, dtype_name = resolve_device_dtype(opts)
        if opts.num_threads:
            torch.set_num_threads(opts.num_threads)
        # Ray shows each rank only the GPU of its bundle: it is device 0 here, and
        # transformers places a device-mesh model on LOCAL_RANK
        os.environ["LOCAL_RANK"] = "0"
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://{master}",
                                rank=rank, world_size=world_size, timeout=timedelta(minutes=10))
        mesh = dist.init_device_mesh(device, (world_size,))
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            dtype=getattr(torch, dtype_name),
            attn_implementation=opts.attn_implementation,
            distributed_config=DistributedConfig(tp_plan="auto"),
            device_mesh=mesh,
            local_files_only=True,
        )
        model.eval()
        from .memory import KVLayout, check_tokens, device_budget

        local = torch.device(device if device == "cpu" else "cuda:0")
        # this rank's share of the heads of every token max_kv_tokens admits (see HFEngine._load)
        check_tokens(KVLayout.of(model.config, model.dtype.itemsize, world_size), opts.max_kv_tokens,
                     device_budget(local, opts.gpu_memory_utilization))
        self.rank = rank
        self.runner = LocalRunner(model, local, pad_id)
        log.info("hf TP shard %d/%d ready on %s/%s", rank, world_size, device, dtype_name)

    def _logits(self, t):
        # only rank 0's logits travel back to the replica
        return t.float().cpu().numpy() if self.rank == 0 else None

    def prefill(self, prompts: list[list[int]]):
        import torch

        with torch.inference_mode():
            return self._logits(self.runner.prefill(prompts))

    def decode(self, tokens: list[int]):
        import torch

        with torch.inference_mode():
            return self._logits(self.runner.decode(tokens))

    def keep(self, rows: list[int]) -> None:
        self.runner.keep(rows)

    def clear(self) -> None:
        self.runner.clear()


class TensorParallelRunner:
    """The replica's side: the :class:`~serve_app.engines.hf_batch.LocalRunner`
    interface, each call run on every rank."""

    def __init__(self, parallel: ParallelConfig, model_dir: str, options: HFEngineOptions, pad_id: int):
        import ray

        workers = list(parallel.rank_workers)
        tp = parallel.tensor_parallel_size
        if len(workers) != tp:
            raise EngineNotReadyError(f"tensor_parallel_size {tp} but the replica started {len(workers)} rank worker(s)")
        self._workers = workers
        self._step_timeout_s = options.rank_step_timeout_s
        self.broken: BaseException | None = None
        master = ray.get(workers[0].free_address.remote())
        spec = {"world_size": tp, "master": master, "model_dir": model_dir,
                "options": options.model_dump(), "pad_id": pad_id}
        try:
            ray.get([w.host.remote(SHARD_FACTORY, {**spec, "rank": i}) for i, w in enumerate(workers)])
        except ray.exceptions.RayError as e:
            raise EngineNotReadyError(f"loading the tensor-parallel shards failed: {e}") from e

    def _all(self, method: str, *args):
        import ray

        if self.broken is not None:
            raise EngineError(f"a tensor-parallel rank failed earlier: {self.broken}")
        refs = [w.call.remote(method, *args) for w in self._workers]
        pending = list(refs)
        try:
            # not one ray.get on all: when a rank dies, the others wait in a collective
            # for it forever, so the first failure (or the step timeout) must end the wait
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=self._step_timeout_s)
                if not done:
                    raise TimeoutError(f"{len(pending)} rank(s) did not finish {method} in "
                                       f"{self._step_timeout_s:g} s")
                ray.get(done)
            return ray.get(refs[0])
        except (ray.exceptions.RayError, TimeoutError) as e:
            # a rank that died, raised or hung leaves the others out of step: this
            # replica cannot serve again, and its failing health check makes Serve
            # replace it (its rank workers go with it)
            self.broken = e
            raise EngineError(f"tensor-parallel {method} failed on a rank: {e}") from e

    async def check(self, timeout_s: float = 10.0) -> None:
        """Ping every rank (answered beside a running step), so that a rank lost
        while the replica idles takes it out of service before a request finds out."""
        import asyncio

        import ray

        if self.broken is not None:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*[w.ping.remote() for w in self._workers]), timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
            self.broken = e if isinstance(e, ray.exceptions.RayError) else TimeoutError(
                f"a rank did not answer a ping in {timeout_s:g} s")

    def prefill(self, prompts: list[list[int]]):
        import torch

        return torch.from_numpy(self._all("prefill", prompts))

    def decode(self, tokens):
        import torch

        return torch.from_numpy(self._all("decode", torch.as_tensor(tokens).view(-1).tolist()))

    def keep(self, rows: list[int]) -> None:
        self._all("keep", rows)

    def clear(self) -> None:
        try:
            self._all("clear")
        except EngineError as e:  # called while failing a batch: the failure is already reported
            log.warning("clearing the tensor-parallel batch failed: %s", e)
