"""Messages between the ingress and LLMServer replicas.

Front ends (HTTP, gRPC) normalise client requests into :class:`InferenceRequest`;
replicas answer with :class:`Delta` items (streaming, sent as ``Delta.to_wire``
lists, which Ray packs with msgpack) or one :class:`Completion` (the request and
the completion, one each per request, are pickled by Ray).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class InferenceRequest:
    request_id: str
    model: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    # W3C trace context of the ingress span, so replica spans join the same trace
    trace_context: dict[str, str] | None = None


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    # readable token texts and alternatives, only when the client asked for logprobs
    tokens: list[str] | None
    top_logprobs: list[list[tuple[str, float]]] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int

    def to_wire(self) -> list:
        """The delta as a list of plain values, for the replica -> ingress stream.

        Why: Ray packs lists, dicts, strings and numbers with msgpack (strict types) and pickles
        anything else, a tuple or a dataclass included; under 64 streams pickling the delta was
        ~15 % of the LLM server's GIL time (py-spy, CPU box).
        """
        top = self.top_logprobs
        if top is not None:
            top = [[[tok, lp] for tok, lp in alts] for alts in top]
        return [self.text, self.token_ids, self.logprobs, self.tokens, top,
                self.finish_reason, self.prompt_tokens, self.completion_tokens]

    @classmethod
    def from_wire(cls, wire: list) -> "Delta":
        text, ids, lps, tokens, top, finish, n_prompt, n_completion = wire
        if top is not None:
            top = [[(tok, lp) for tok, lp in alts] for alts in top]
        return cls(text, ids, lps, tokens, top, finish, n_prompt, n_completion)


def merge_deltas(ds: list[Delta]) -> Delta:
    """One delta carrying several consecutive ones (a whole answer, for Completion.from_deltas)."""
    if len(ds) == 1:
        return ds[0]
    want = ds[0].tokens is not None
    has_top = ds[0].top_logprobs is not None
    return Delta(
        text="".join(d.text for d in ds),
        token_ids=[t for d in ds for t in d.token_ids],
        logprobs=[x for d in ds for x in d.logprobs],
        tokens=[t for d in ds for t in (d.tokens or [])] if want else None,
        top_logprobs=[t for d in ds for t in (d.top_logprobs or [])] if has_top else None,
        finish_reason=ds[-1].finish_reason,
        prompt_tokens=ds[-1].prompt_tokens,
        completion_tokens=ds[-1].completion_tokens,
    )


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str] | None
    top_logprobs: list[list[tuple[str, float]]] | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    variant: str = ""

    @property
    def confidence(self) -> float | None:
        """exp(mean sampled-token logprob): the model's own certainty, 0..1."""
        if not self.logprobs:
            return None
        return math.exp(sum(self.logprobs) / len(self.logprobs))

    @classmethod
    def from_deltas(cls, deltas: list[Delta], variant: str = "") -> "Completion":
        d = merge_deltas(deltas)
        return cls(
            text=d.text,
            token_ids=d.token_ids,
            logprobs=d.logprobs,
            tokens=d.tokens,
            top_logprobs=d.top_logprobs,
            finish_reason=d.finish_reason or "stop",
            prompt_tokens=d.prompt_tokens,
            completion_tokens=d.completion_tokens,
            variant=variant,
        )
