"""LLMServer: one Ray Serve deployment per model variant, hosting one engine.

It tokenizes, applies request limits that need the tokenizer (context length,
default max_tokens), runs the engine, and reports engine stats to Serve's
autoscaler. The engine is loaded and warmed up in ``__init__``, so a replica
reports ready only once it can answer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator

import ray

from serve_app import gcpause, metrics
from autoscale.gpu import GpuUtilSmoother, make_gpu_source
from autoscale.ray_policy import GPU_METRIC, OCCUPANCY_METRIC, QUEUE_METRIC
from cluster.nccl import detect
from cluster.placement import replica_placement, start_rank_workers
from serve_app.config import NcclSpec, TracingSettings
from serve_app.tracing import extract, make_provider
from serve_app.engines.base import GenerationRequest, ParallelConfig, SamplingParams
from serve_app.engines.registry import create_engine
from serve_app.errors import InvalidRequestError
from serve_app.deployments.coalesce import engine_chunks
from serve_app.internal import Completion, Delta, InferenceRequest

log = logging.getLogger("seekserve.llm_server")


class LLMServer:
    async def __init__(
        self,
        model_name: str,
        variant: str,
        backend: str,
        engine_options: dict,
        max_tokens_default: int = 256,
        gpu_source: str = "nvml",
        gpu_sample_interval_s: float = 1.0,
        tensor_parallel_size: int = 1,
        gpus_per_rank: float = 0.0,
        nccl: dict | None = None,
        lora_adapter: str | None = None,
        sampling: dict | None = None,
        tracing: dict | None = None,
        stream_interval_s: float = 0.0,
        engine_process: str = "auto",
    ):
        self.model_name = model_name
        self.variant = variant
        self.max_tokens_default = max_tokens_default
        self.stream_interval_s = stream_interval_s
        self.lora_adapter = lora_adapter
        self.sampling = {k: v for k, v in (sampling or {}).items() if v is not None}
        tp = tensor_parallel_size
        env = {}
        if tp > 1:
            # ranks are STRICT_PACKed on one node: the topology is this node's
            env = NcclSpec.model_validate(nccl or {}).resolve(detect(num_nodes=1).topology)
        parallel = ParallelConfig(tensor_parallel_size=tp, bundle_indices=list(range(tp)), env=env)
        self.engine = create_engine(backend, engine_options, parallel, process=engine_process)
        self.rank_workers = []
        if tp > 1 and not self.engine.places_own_workers:
            self.rank_workers = start_rank_workers(tp, gpus_per_rank, env)
            self.engine.parallel.rank_workers = self.rank_workers
        self.placement = ([await w.info.remote() for w in self.rank_workers] if self.rank_workers
                          else [replica_placement()])
        await self.engine.start()
        self.gpu = GpuUtilSmoother(
            make_gpu_source(gpu_source, lambda: self.engine.stats().num_running > 0),
            interval_s=gpu_sample_interval_s,
        )
        self.gpu.start()
        self._tags = metrics.tags(model_name, variant)
        self._tracer = None
        if tracing and tracing.get("exporter", "none") != "none":
            settings = TracingSettings.model_validate(tracing)
            self._tracer = make_provider(settings, "seekserve-llm-server").get_tracer("seekserve")
        self._load_time_s = float(getattr(self.engine, "load_time_s", 0.0) or 0.0)
        self._last_counts = (0, 0)
        self._stats_task = asyncio.get_running_loop().create_task(self._export_stats())
        self._gc = gcpause.pauses()
        log.info("LLMServer %s/%s ready (backend %s)", model_name, variant, backend)

    @classmethod
    async def create(cls, *args, **kwargs) -> "LLMServer":
        """Build one outside Serve's replica constructor (its ``__init__`` is a coroutine, which a plain
        call cannot await): the direct-streaming deployment hosts one in its own process."""
        server = cls.__new__(cls)
        await server.__init__(*args, **kwargs)
        return server

    def _to_generation_request(self, req: InferenceRequest) -> GenerationRequest:
        eng = self.engine
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        elif req.messages is not None:
            ids = eng.encode_chat(req.messages)
        else:
            ids = eng.encode_text(req.prompt or "")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if req.prompt_token_ids is not None and any(t < 0 for t in ids):
            raise InvalidRequestError("prompt token ids must be non-negative", param="prompt")
        room = eng.max_model_len - len(ids)
        max_tokens = req.max_tokens
        if max_tokens is None:
            # like vLLM: an unspecified max_tokens fills what the context has left
            max_tokens = max(1, min(self.max_tokens_default, room))
        return GenerationRequest(
            request_id=req.request_id,
            prompt_token_ids=ids,
            adapter=self.lora_adapter,
            sampling=SamplingParams(
                max_tokens=max_tokens,
                temperature=self.sampling.get("temperature", req.temperature),
                top_p=self.sampling.get("top_p", req.top_p),
                seed=req.seed,
                stop=list(req.stop),
                top_logprobs=req.top_logprobs,
                ignore_eos=req.ignore_eos,
            ),
        )

    async def generate(self, req: InferenceRequest) -> AsyncIterator[list]:
        """Stream deltas (as ``Delta.to_wire`` lists); an admission error is raised before the first one."""
        async for d in self._deltas(req, self.stream_interval_s):
            yield d.to_wire()

    async def _export_stats(self, interval_s: float = 1.0) -> None:
        """Engine and GPU gauges, and token counters from the engine's monotone totals."""
        while True:
            try:
                s = self.engine.stats()
                # a gauge set only once can miss Ray's export for good (CI once saw
                # this one absent for 60 s), so even this constant is set each tick
                metrics.get("load").set(self._load_time_s, tags=self._tags)
                metrics.get("running").set(s.num_running, tags=self._tags)
                metrics.get("waiting").set(s.num_waiting, tags=self._tags)
                metrics.get("kv").set(s.kv_cache_usage, tags=self._tags)
                p0, g0 = self._last_counts
                if s.prompt_tokens > p0:
                    metrics.get("prompt_tokens").inc(s.prompt_tokens - p0, tags=self._tags)
                if s.generated_tokens > g0:
                    metrics.get("gen_tokens").inc(s.generated_tokens - g0, tags=self._tags)
                self._last_counts = (s.prompt_tokens, s.generated_tokens)
                g = self.gpu.last
                if g is not None:
                    for i, u in enumerate(g.per_gpu_util_pct):
                        gt = {**self._tags, "gpu": str(i)}
                        metrics.get("gpu_util").set(u / 100.0, tags=gt)
                    gt = {**self._tags, "gpu": "all"}
                    metrics.get("gpu_mem_used").set(g.memory_used_bytes, tags=gt)
                    metrics.get("gpu_mem_total").set(g.memory_total_bytes, tags=gt)
            except Exception as e:  # metrics never break serving
                log.debug("stats export failed: %s", e)
            await asyncio.sleep(interval_s)

    async def _deltas(self, req: InferenceRequest, interval_s: float = 0.0) -> AsyncIterator[Delta]:
        greq = self._to_generation_request(req)
        t0 = last = time.monotonic()
        trace = _ReplicaTrace(self._tracer, req, self.variant)
        first = True
        # coalesced as engine chunks, before the per-chunk work below (metrics, deltas, the Ray message):
        # under load that work is paid once per message rather than once per token
        chunks = engine_chunks(self.engine, greq, interval_s)
        try:
            async for c in chunks:
                now = time.monotonic()
                if first:
                    metrics.get("ttft").observe(now - t0, tags=self._tags)
                    if c.queue_time_s is not None:
                        metrics.get("queue").observe(c.queue_time_s, tags=self._tags)
                    trace.first_chunk(c.queue_time_s)
                    first = False
                elif c.token_ids:
                    metrics.get("itl").observe((now - last) / len(c.token_ids), tags=self._tags)
                last = now
                yield self._delta(req, c)
        finally:
            await chunks.aclose()  # stops the engine's generator now (an abort), not when collected
            trace.end()

    def _delta(self, req: InferenceRequest, c) -> Delta:
        tokens = top = None
        if req.logprobs:
            token_text = self.engine.token_text
            tokens = [token_text(t) for t in c.token_ids]
            if c.top_logprobs is not None:
                top = [[(token_text(t), lp) for t, lp in d.items()] for d in c.top_logprobs]
        return Delta(
            text=c.text,
            token_ids=c.token_ids,
            logprobs=c.logprobs,
            tokens=tokens,
            top_logprobs=top,
            finish_reason=c.finish_reason,
            prompt_tokens=c.num_prompt_tokens,
            completion_tokens=c.num_generated_tokens,
        )

    async def generate_full(self, req: InferenceRequest) -> Completion:
        """The whole answer in one reply: one Ray round trip instead of one per delta."""
        deltas = [d async for d in self._deltas(req)]
        return Completion.from_deltas(deltas, self.variant)

    async def stats(self) -> dict:
        s = self.engine.stats().as_dict()
        s["max_model_len"] = self.engine.max_model_len
        s["load_time_s"] = getattr(self.engine, "load_time_s", None)
        s["warm_up"] = getattr(self.engine, "warm_up", None)  # the hf engine's compiles and graphs, if any
        s["gpu_util_pct"] = self.gpu.util_pct
        s["tensor_parallel_size"] = self.engine.parallel.tensor_parallel_size
        s["placement"] = self.placement
        s["replica_node_id"] = ray.get_runtime_context().get_node_id()
        s["replica_actor_id"] = ray.get_runtime_context().get_actor_id()
        s["gpu_source"] = self.gpu.source.name
        s["gpu_unavailable_reason"] = self.gpu.source.unavailable_reason
        last = self.gpu.last
        s["gpu_memory_used_bytes"] = last.memory_used_bytes if last else None
        s["gpu_memory_total_bytes"] = last.memory_total_bytes if last else None
        s["gc"] = self._gc.snapshot()
        # server.user_code_loop: Serve's own user-code thread ('separate') or the replica's main loop ('shared')
        s["user_code_thread"] = threading.current_thread().name
        if hasattr(self.engine, "process_gc"):  # engine.process "separate": the engine's own process
            s["engine_process_gc"] = self.engine.process_gc
        return s

    async def update_engine_options(self, changes: dict) -> dict:
        """Changes engine options on this live replica (:meth:`Engine.update_options`: validated, all or
        nothing, and only those the engine reads while running) and returns them as set. Reachable through a Serve
        handle only, not HTTP: for a benchmark's compare of such options on one deployment."""
        return self.engine.update_options(changes)

    async def check_health(self) -> None:
        await self.engine.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        s = self.engine.stats()
        out = {QUEUE_METRIC: float(s.num_waiting)}
        batch = getattr(self.engine.options, "max_num_seqs", None)
        if batch:
            out[OCCUPANCY_METRIC] = s.num_running / batch
        if self.gpu.util_pct is not None:  # a missing signal is left out, not reported as 0
            out[GPU_METRIC] = float(self.gpu.util_pct)
        return out

    async def __del__(self):
        self.gpu.stop()
        self._stats_task.cancel()
        try:
            await self.engine.shutdown()
        except Exception:  # shutting down anyway
            pass


class _ReplicaTrace:
    """Spans of one request inside the replica: llm_server.generate with the
    engine's queue wait, prefill and decode as children (times as measured)."""

    def __init__(self, tracer, req: InferenceRequest, variant: str):
        self.tracer = tracer
        if tracer is None:
            return
        self.t0_ns = time.time_ns()
        self.span = tracer.start_span("llm_server.generate", context=extract(req.trace_context),
                                      start_time=self.t0_ns)
        self.span.set_attribute("seekserve.variant", variant)
        self.first_ns = None

    def _child(self, name: str, start_ns: int, end_ns: int) -> None:
        from opentelemetry import trace

        s = self.tracer.start_span(name, context=trace.set_span_in_context(self.span), start_time=start_ns)
        s.end(end_time=max(start_ns, end_ns))

    def first_chunk(self, queue_time_s: float | None) -> None:
        if self.tracer is None:
            return
        self.first_ns = time.time_ns()
        queue_end = self.t0_ns + int((queue_time_s or 0.0) * 1e9)
        self._child("engine.queue", self.t0_ns, queue_end)
        self._child("engine.prefill", queue_end, self.first_ns)

    def end(self) -> None:
        if self.tracer is None:
            return
        now = time.time_ns()
        if self.first_ns is not None:
            self._child("engine.decode", self.first_ns, now)
        self.span.end(end_time=now)
