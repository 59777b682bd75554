"""Backends by name. An unknown name raises and lists the valid ones: no fallback."""

from __future__ import annotations

import importlib

from .base import Engine

# name -> "module:Class"; imported lazily so that importing the registry does
# not import torch (the ingress never needs it).
_BUILTIN: dict[str, str] = {
    "hf": "serve_app.engines.hf:HFEngine",
    "null": "serve_app.engines.null:NullEngine",
    "trtllm": "serve_app.engines.trtllm:TRTLLMEngine",
}
_REGISTERED: dict[str, type[Engine]] = {}


class UnknownEngineError(ValueError):
    pass


def register_engine(name: str, cls: type[Engine]) -> None:
    _REGISTERED[name] = cls


def engine_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTERED))


def get_engine_class(name: str) -> type[Engine]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise UnknownEngineError(
            f"unknown engine backend {name!r}; valid backends: {', '.join(engine_names())}"
        )
    module_name, cls_name = _BUILTIN[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    _REGISTERED[name] = cls
    return cls


def auto_engine_process(name: str, options, parallel=None) -> str:
    """What engine.process "auto" stands for: "separate" for an hf engine of one rank that runs on a
    GPU, where the engine's own process measured 99 % of the engine alone's throughput at 64 streams
    against 86 % inline (docs/gpu_notes.md runs 41-42); "inline" for everything else, the CPU included,
    where the child's process competes with the replica's for few cores."""
    tp = parallel.tensor_parallel_size if parallel is not None else 1
    if name != "hf" or tp > 1:
        return "inline"
    from .hf_batch import resolve_device

    return "separate" if resolve_device(options.device) == "cuda" else "inline"


def options_model_for(name: str):
    """The options schema of a backend, without importing the backend itself."""
    from .options import OPTIONS_BY_BACKEND

    if name in OPTIONS_BY_BACKEND:
        return OPTIONS_BY_BACKEND[name]
    return get_engine_class(name).options_model


def create_engine(name: str, options: dict | None = None, parallel=None, process: str = "inline") -> Engine:
    """``process``: "inline" runs the engine in this process; "separate" in a child process of its
    own, this process keeping the backend's tokenization (:mod:`serve_app.engines.process`); "auto"
    picks one (:func:`auto_engine_process`)."""
    cls = get_engine_class(name)
    validated = options_model_for(name).model_validate(options or {})
    if process == "auto":
        process = auto_engine_process(name, validated, parallel)
    if process == "inline":
        return cls(validated, parallel)
    if process == "separate":
        from .process import SeparateProcessEngine

        return SeparateProcessEngine(name, validated, parallel)
    from .options import ENGINE_PROCESSES

    raise ValueError(f"unknown engine process {process!r}; valid: {', '.join(ENGINE_PROCESSES)}")
