"""The running batch of the hf backend's dynamic-cache path, and the runners that
step it: :class:`LocalRunner` (the model in this process) and, for
tensor_parallel_size > 1, :class:`serve_app.engines.hf_tp.TensorParallelRunner`
(one shard per rank worker, each holding its own copy of the batch's layout).

A runner keeps the KV cache of every running row; rows are appended by
``prefill`` in the order the prompts are given and removed by ``keep``. The
engine keeps the sampled tokens and hands them to ``decode`` in row order, so
a runner never sees sampling, requests or text.
"""

from __future__ import annotations

from serve_app.errors import EngineNotReadyError


def resolve_device(device: str) -> str:
    """What an ``HFEngineOptions.device`` stands for in this process: 'auto' is cuda where a GPU is
    visible (``is_available()`` makes no CUDA context), else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device_dtype(opts) -> tuple[str, str]:
    """The device ('cuda' or 'cpu') and torch dtype name that ``HFEngineOptions``
    stand for in this process (a replica, or one tensor-parallel rank)."""
    import torch

    device = resolve_device(opts.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineNotReadyError("engine.options.device is 'cuda' but no GPU is visible")
    dtype_name = opts.dtype if opts.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return device, dtype_name


class _Batch:
    """Running rows: a left-padded KV cache and its attention mask."""

    def __init__(self, cache, mask):
        self.cache = cache
        self.mask = mask  # [B, L] 1 = real token in the cache

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def _pad_left(self, n: int) -> None:
        import torch
        import torch.nn.functional as F

        if n <= 0:
            return
        for layer in self.cache.layers:
            layer.keys = F.pad(layer.keys, (0, 0, n, 0))
            layer.values = F.pad(layer.values, (0, 0, n, 0))
        self.mask = torch.cat([self.mask.new_zeros(self.mask.shape[0], n), self.mask], dim=1)

    def merge(self, other: "_Batch") -> None:
        import torch

        la, lb = self.mask.shape[1], other.mask.shape[1]
        self._pad_left(lb - la)
        other._pad_left(la - lb)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask = torch.cat([self.mask, other.mask], dim=0)

    def keep(self, rows: list[int]) -> None:
        import torch

        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(idx)
        self.mask = self.mask.index_select(0, idx)
        # drop columns that are padding in every remaining row
        used = self.mask.sum(dim=0).nonzero()
        first = int(used[0]) if used.numel() else self.mask.shape[1]
        if first > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]
            self.mask = self.mask[:, first:]


class LocalRunner:
    """Steps the batch on a model held by this process (any device)."""

    def __init__(self, model, device, pad_id: int):
        self.model = model
        self.device = device
        self.pad_id = pad_id
        self.batch: _Batch | None = None
        self.broken: BaseException | None = None  # a local model fails per step, never for good

    async def check(self) -> None:
        """A model in this process has nothing to lose between steps."""

    def prefill(self, prompts: list[list[int]]):
        """Append one row per prompt; returns their last-position logits ``[n, vocab]``."""
        import torch
        from transformers import DynamicCache

        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, longest - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=DynamicCache(config=self.model.config),
            use_cache=True,
            logits_to_keep=1,
        )
        new = _Batch(out.past_key_values, mask)
        if self.batch is None:
            self.batch = new
        else:
            self.batch.merge(new)
        return _local(out.logits[:, -1, :])

    def decode(self, tokens):
        """Feed one token per row (``[B, 1]``, row order); returns logits ``[B, vocab]``."""
        import torch

        b = self.batch
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1, 1).to(self.device)
        b.mask = torch.cat([b.mask, b.mask.new_ones(b.size, 1)], dim=1)
        pos = b.mask.sum(dim=-1, keepdim=True) - 1
        out = self.model(
            input_ids=tokens,
            attention_mask=b.mask,
            position_ids=pos,
            past_key_values=b.cache,
            use_cache=True,
        )
        b.cache = out.past_key_values
        return _local(out.logits[:, -1, :])

    def keep(self, rows: list[int]) -> None:
        if not rows:
            self.batch = None
        elif self.batch is not None:
            self.batch.keep(rows)

    def clear(self) -> None:
        self.batch = None


def _local(t):
    # under a tensor-parallel plan the logits may come back as a (replicated) DTensor
    return t.full_tensor() if hasattr(t, "full_tensor") else t
