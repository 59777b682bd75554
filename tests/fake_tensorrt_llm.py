"""FAKE ``tensorrt_llm`` for the TensorRT-LLM adapter's contract test.

TensorRT-LLM cannot be installed or run here. This fake records what the
adapter passes to the documented LLM API (``LLM``, ``SamplingParams``,
``KvCacheConfig``, ``CudaGraphConfig``, ``LoraConfig``, ``LoRARequest``) and
replays outputs in the documented shapes (``RequestOutput.outputs[0]`` with
``token_ids_diff``, ``text_diff``, ``logprobs_diff``, ``finish_reason``;
``get_stats_async`` iteration-stat dicts). It proves the mapping, not the engine.
"""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass, field


class _Recorded:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        for k, v in kwargs.items():
            setattr(self, k, v)


class KvCacheConfig(_Recorded):
    pass


class CudaGraphConfig(_Recorded):
    pass


class LoraConfig(_Recorded):
    pass


class SamplingParams(_Recorded):
    pass


class LoRARequest:
    def __init__(self, lora_name, lora_int_id, lora_path):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class FakeCompletionOutput:
    token_ids_diff: list
    text_diff: str
    logprobs_diff: list
    finish_reason: str | None = None


@dataclass
class FakeRequestOutput:
    outputs: list


class FakeTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self.encode("".join(m["content"] for m in messages))


class FakeResult:
    """What generate_async returns: an async iterator of RequestOutput with abort()."""

    def __init__(self, script, delay_s):
        self.script, self.delay_s = script, delay_s
        self.aborted = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for step in self.script:
            await asyncio.sleep(self.delay_s)
            if self.aborted:
                return
            yield FakeRequestOutput([step])

    def abort(self):
        self.aborted = True


@dataclass
class FakeLLM:
    """Records constructor kwargs and every generate_async call."""

    init_kwargs: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)
    results: list = field(default_factory=list)
    script: list = field(default_factory=list)
    stats: list = field(default_factory=list)
    delay_s: float = 0.0
    shut_down: bool = False

    def __post_init__(self):
        self.tokenizer = FakeTokenizer()
        self.args = types.SimpleNamespace(max_seq_len=4096)

    def generate_async(self, inputs, sampling_params, streaming=False, lora_request=None):
        self.calls.append({"inputs": inputs, "sampling_params": sampling_params, "streaming": streaming,
                           "lora_request": lora_request})
        r = FakeResult(list(self.script), self.delay_s)
        self.results.append(r)
        return r

    async def get_stats_async(self, timeout=2):
        for s in self.stats:
            yield s

    def shutdown(self):
        self.shut_down = True


class _Module:
    last_llm: FakeLLM | None = None


def install() -> types.SimpleNamespace:
    """Put the fake under the name ``tensorrt_llm`` in sys.modules; returns a handle."""
    state = types.SimpleNamespace(llm=None, environ_at_init=None)

    def LLM(**kwargs):
        import os

        state.environ_at_init = dict(os.environ)
        state.llm = FakeLLM(init_kwargs=kwargs)
        return state.llm

    root = types.ModuleType("tensorrt_llm")
    root.LLM, root.SamplingParams = LLM, SamplingParams
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig, llmapi.CudaGraphConfig = KvCacheConfig, CudaGraphConfig
    lora_manager = types.ModuleType("tensorrt_llm.lora_manager")
    lora_manager.LoraConfig = LoraConfig
    executor = types.ModuleType("tensorrt_llm.executor")
    request = types.ModuleType("tensorrt_llm.executor.request")
    request.LoRARequest = LoRARequest
    root.llmapi, root.lora_manager, root.executor, executor.request = llmapi, lora_manager, executor, request
    for name, mod in {"tensorrt_llm": root, "tensorrt_llm.llmapi": llmapi,
                      "tensorrt_llm.lora_manager": lora_manager, "tensorrt_llm.executor": executor,
                      "tensorrt_llm.executor.request": request}.items():
        sys.modules[name] = mod
    return state


def uninstall() -> None:
    for name in list(sys.modules):
        if name == "tensorrt_llm" or name.startswith("tensorrt_llm."):
            del sys.modules[name]
