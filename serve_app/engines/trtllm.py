"""TensorRT-LLM backend on its LLM API (production engine on GPU nodes).

UNTESTED ON GPU HARDWARE. TensorRT-LLM cannot be installed where this project
is developed and tested (GB-sized wheels, GPU only). This adapter is written
against the documented LLM API and checked by ``tests/test_trtllm_contract.py``
with a fake ``tensorrt_llm`` module that records the arguments we pass and
replays outputs in the documented shapes. See docs/engines.md.

Mapping:

* ``LLM(model, tensor_parallel_size, max_batch_size, max_num_tokens, max_seq_len,
  kv_cache_config=KvCacheConfig(free_gpu_memory_fraction, enable_block_reuse, dtype),
  cuda_graph_config=CudaGraphConfig(batch_sizes, enable_padding),
  enable_chunked_prefill, lora_config=LoraConfig(...), orchestrator_type="ray")``.
  Its Ray workers go into this replica's placement group through
  ``TRTLLM_RAY_BUNDLE_INDICES`` (one bundle per rank).
* ``generate_async(prompt_token_ids, SamplingParams(...), streaming=True,
  lora_request=LoRARequest(...))`` yields ``RequestOutput``; ``outputs[0]`` has
  ``token_ids_diff``, ``text_diff``, ``logprobs_diff`` (one ``{token_id: Logprob}``
  dict per new token, which must contain the sampled token) and ``finish_reason``.
* ``get_stats_async(timeout)`` iteration stats feed waiting / running / KV usage.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import AsyncIterator

from serve_app.errors import (
    ContextLengthExceededError,
    EngineError,
    EngineNotReadyError,
    InvalidRequestError,
    OverloadedError,
)

from .base import Engine, EngineChunk, EngineStats, GenerationRequest
from .options import TRTLLMEngineOptions

log = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}


class TRTLLMEngine(Engine):
    name = "trtllm"
    options_model = TRTLLMEngineOptions
    max_tensor_parallel_size = 64
    places_own_workers = True

    def __init__(self, options: TRTLLMEngineOptions, parallel=None):
        super().__init__(options, parallel)
        self.options: TRTLLMEngineOptions = options
        self._llm = None
        self._tokenizer = None
        self._lora_ids: dict[str, int] = {}
        self._in_flight: dict[str, object] = {}
        self._stats = EngineStats()
        self._stats_task: asyncio.Task | None = None
        self._max_seq_len = options.max_seq_len or 0

    # ---- construction ----------------------------------------------------
    def llm_kwargs(self) -> dict:
        """Everything passed to ``tensorrt_llm.LLM`` (kept apart for the contract test)."""
        from tensorrt_llm.llmapi import CudaGraphConfig, KvCacheConfig

        o = self.options
        kv = {"free_gpu_memory_fraction": o.kv_cache_free_gpu_memory_fraction,
              "enable_block_reuse": o.enable_block_reuse}
        if o.kv_cache_dtype != "auto":
            kv["dtype"] = o.kv_cache_dtype
        kwargs = dict(
            model=o.model,
            tokenizer=o.tokenizer or o.model,
            backend=o.backend,
            tensor_parallel_size=self.parallel.tensor_parallel_size,
            max_batch_size=o.max_batch_size,
            max_num_tokens=o.max_num_tokens,
            kv_cache_config=KvCacheConfig(**kv),
            cuda_graph_config=CudaGraphConfig(batch_sizes=list(o.cuda_graph_batch_sizes),
                                              enable_padding=o.cuda_graph_padding),
            enable_chunked_prefill=o.enable_chunked_prefill,
            orchestrator_type="ray",
        )
        if o.max_seq_len is not None:
            kwargs["max_seq_len"] = o.max_seq_len
        if o.lora is not None:
            LoraConfig = _lora_config_class()
            kwargs["lora_config"] = LoraConfig(
                lora_dir=list(o.lora.adapters.values()),
                max_lora_rank=o.lora.max_lora_rank,
                max_loras=o.lora.max_loras,
                max_cpu_loras=o.lora.max_cpu_loras,
            )
            self._lora_ids = {name: i for i, name in enumerate(sorted(o.lora.adapters))}
        return kwargs

    async def start(self) -> None:
        try:
            import tensorrt_llm
        except ImportError as e:
            raise EngineNotReadyError(
                "the trtllm backend needs TensorRT-LLM on a GPU node: pip install 'seekserve[trtllm]'"
            ) from e
        # TRT-LLM's Ray executor places rank i on bundle i of the current placement group
        os.environ["TRTLLM_RAY_BUNDLE_INDICES"] = ",".join(str(i) for i in self.parallel.bundle_indices)
        os.environ.update(self.parallel.env)
        kwargs = self.llm_kwargs()
        self._llm = await asyncio.to_thread(tensorrt_llm.LLM, **kwargs)
        self._tokenizer = getattr(self._llm, "tokenizer", None)
        if not self._max_seq_len:
            self._max_seq_len = int(getattr(getattr(self._llm, "args", None), "max_seq_len", 0) or 8192)
        self._stats_task = asyncio.get_running_loop().create_task(self._poll_stats())

    @property
    def max_model_len(self) -> int:
        return self._max_seq_len

    def encode_chat(self, messages):
        try:
            return list(self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        except Exception as e:
            raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from e

    def encode_text(self, prompt: str):
        return list(self._tokenizer.encode(prompt, add_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def sampling_params(self, request: GenerationRequest):
        from tensorrt_llm import SamplingParams

        sp = request.sampling
        kwargs = dict(
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            # always ask for the sampled token's logprob: rollouts use it as confidence
            logprobs=max(1, sp.top_logprobs),
            ignore_eos=sp.ignore_eos,
        )
        if sp.seed is not None:
            kwargs["seed"] = sp.seed
        if sp.stop:
            kwargs["stop"] = list(sp.stop)
        return SamplingParams(**kwargs)

    def lora_request(self, adapter: str | None):
        if adapter is None:
            return None
        if adapter not in self._lora_ids:
            raise InvalidRequestError(f"unknown LoRA adapter {adapter!r}", param="model")
        from tensorrt_llm.executor.request import LoRARequest

        return LoRARequest(adapter, self._lora_ids[adapter], self.options.lora.adapters[adapter])

    # ---- requests ----------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineChunk]:
        if self._llm is None:
            raise EngineNotReadyError("engine is not started")
        n_prompt = len(request.prompt_token_ids)
        if n_prompt + request.sampling.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n_prompt + request.sampling.max_tokens} tokens.", param="messages")
        if len(self._in_flight) >= self.options.max_batch_size + self.options.max_waiting_requests:
            raise OverloadedError("the engine's queue is full")
        result = self._llm.generate_async(
            request.prompt_token_ids,
            self.sampling_params(request),
            streaming=True,
            lora_request=self.lora_request(request.adapter),
        )
        self._in_flight[request.request_id] = result
        done, n = False, 0
        try:
            async for out in result:
                o = out.outputs[0]
                ids = list(o.token_ids_diff)
                lps, tops = _map_logprobs(ids, o.logprobs_diff, request.sampling.top_logprobs)
                n += len(ids)
                finish = _FINISH.get(o.finish_reason) if o.finish_reason else None
                done = finish is not None
                yield EngineChunk(
                    request_id=request.request_id,
                    token_ids=ids,
                    text=o.text_diff,
                    logprobs=lps,
                    top_logprobs=tops,
                    finish_reason=finish,
                    num_prompt_tokens=n_prompt,
                    num_generated_tokens=n,
                )
                if done:
                    return
        except (EngineError, InvalidRequestError):
            raise
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise EngineError(f"TensorRT-LLM failed: {e}") from e
        finally:
            self._in_flight.pop(request.request_id, None)
            if not done:
                self._stats.aborted_requests += 1
                try:
                    result.abort()
                except Exception:  # already finished
                    pass

    async def abort(self, request_id: str) -> None:
        result = self._in_flight.get(request_id)
        if result is not None:
            result.abort()

    async def _poll_stats(self) -> None:
        o = self.options
        while True:
            try:
                async for it in self._llm.get_stats_async(timeout=o.stats_interval_s):
                    s = it if isinstance(it, dict) else {}
                    self._stats.num_running = int(s.get("numActiveRequests", 0))
                    self._stats.num_waiting = int(s.get("numQueuedRequests", 0))
                    kv = s.get("kvCacheStats") or {}
                    if kv.get("maxNumBlocks"):
                        self._stats.kv_cache_usage = float(kv.get("usedNumBlocks", 0)) / float(kv["maxNumBlocks"])
                    self._stats.forward_passes = int(s.get("iter", self._stats.forward_passes))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # stats are best effort; serving goes on
                log.debug("get_stats_async failed: %s", e)
            await asyncio.sleep(o.stats_interval_s)

    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            kv_cache_usage=s.kv_cache_usage,
            forward_passes=s.forward_passes,
            prompt_tokens=s.prompt_tokens,
            generated_tokens=s.generated_tokens,
            aborted_requests=s.aborted_requests,
            healthy=self._llm is not None,
        )

    async def check_health(self) -> None:
        if self._llm is None:
            raise EngineNotReadyError("engine is not started")

    async def shutdown(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
            self._llm = None


def _map_logprobs(ids: list[int], diff, top_k: int):
    """TRT-LLM gives one {token_id: Logprob} dict per new token; the sampled token must be in it."""
    if not diff:
        raise EngineError("TensorRT-LLM returned no logprobs although they were requested")
    if len(diff) != len(ids):
        raise EngineError(f"TensorRT-LLM returned {len(diff)} logprob entries for {len(ids)} tokens")
    lps, tops = [], []
    for tok, d in zip(ids, diff):
        if tok not in d:
            raise EngineError(f"sampled token {tok} is missing from its logprob entry {sorted(d)}")
        lps.append(float(getattr(d[tok], "logprob", d[tok])))
        if top_k:
            ranked = sorted(d.items(), key=lambda kv: -float(getattr(kv[1], "logprob", kv[1])))[:top_k]
            tops.append({int(t): float(getattr(v, "logprob", v)) for t, v in ranked})
    return lps, (tops if top_k else None)


def _lora_config_class():
    try:
        from tensorrt_llm.lora_manager import LoraConfig
    except ImportError:  # newer releases moved it
        from tensorrt_llm._torch.peft.lora.config import LoraConfig
    return LoraConfig
