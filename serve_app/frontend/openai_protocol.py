"""OpenAI wire format: request schemas and response builders.

Requests reject unknown fields (a typo must not silently change behaviour)
and unsupported values with a 400 that names the parameter.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.config import LimitsConfig, SamplingDefaults
from serve_app.errors import InvalidRequestError
from serve_app.internal import Completion, Delta, InferenceRequest


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Req):
    include_usage: bool = Field(False, description="Send a last chunk with token usage.")


class ChatMessage(_Req):
    role: Literal["system", "user", "assistant", "developer", "tool"] = Field(description="Author role.")
    content: str | list[dict[str, Any]] | None = Field(description="Text, or text content parts.")
    name: str | None = Field(None, description="Optional author name.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"content part {i} has type {part.get('type')!r}; only text parts are supported",
                    param="messages",
                )
            parts.append(part["text"])
        return "".join(parts)


class _SamplingFields(_Req):
    model: str = Field(description="Served model name.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    n: int | None = Field(None, ge=1, le=1, description="Only 1 choice is supported.")
    stream: bool | None = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    stop: str | list[str] | None = Field(None, description="Stop strings.")
    seed: int | None = Field(None, description="Sampling seed for reproducible output.")
    user: str | None = Field(None, max_length=256, description="End-user id; keeps a user on one variant.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0 is supported.")
    ignore_eos: bool | None = Field(
        None, description="vLLM's extension: keep generating past end-of-sequence (fixed-length benchmarks)."
    )

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} other than 0 is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens.")
    logprobs: bool | None = Field(False, description="Return logprobs of the sampled tokens.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Alternatives per token.")

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] = Field(description="Prompt text (or one text, or token ids).")
    logprobs: int | None = Field(None, ge=0, le=5, description="Return this many alternatives per token.")
    echo: bool | None = Field(False, description="Only false is supported.")
    suffix: str | None = Field(None, description="Not supported.")

    @model_validator(mode="after")
    def _prompt(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ValueError("only one prompt per request is supported")
        return self


def invalid_request(errors: list[dict]) -> InvalidRequestError:
    """One 400 naming every bad parameter (``param`` = the first one's dotted path)."""
    msgs, first = [], None
    for e in errors:
        param = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or None
        first = first or param
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        msgs.append(f"{param}: {msg}" if param else msg)
    return InvalidRequestError("; ".join(msgs) or "invalid request", param=first)


def _check_limits(req: _SamplingFields, max_tokens: int | None, limits: LimitsConfig) -> None:
    if max_tokens is not None and max_tokens > limits.max_tokens_limit:
        raise InvalidRequestError(
            f"max_tokens is {max_tokens}, above this server's limit of {limits.max_tokens_limit}",
            param="max_tokens",
        )
    stops = req.stops()
    if len(stops) > limits.max_stop_sequences:
        raise InvalidRequestError(
            f"at most {limits.max_stop_sequences} stop sequences are allowed, got {len(stops)}", param="stop"
        )
    if any(len(s) > limits.max_stop_length for s in stops):
        raise InvalidRequestError(f"stop strings are limited to {limits.max_stop_length} characters", param="stop")
    if any(s == "" for s in stops):
        raise InvalidRequestError("stop strings must not be empty", param="stop")


def chat_to_internal(req: ChatCompletionRequest, limits: LimitsConfig,
                     defaults: SamplingDefaults | None = None) -> InferenceRequest:
    """``defaults``: the model's sampling for the fields the request leaves out (OpenAI's without)."""
    max_tokens = req.max_completion_tokens or req.max_tokens
    _check_limits(req, max_tokens, limits)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    if sum(len(m["content"]) for m in messages) > limits.max_prompt_chars:
        raise InvalidRequestError(f"the messages exceed {limits.max_prompt_chars} characters", param="messages")
    return InferenceRequest(
        request_id=new_id("chatcmpl"),
        model=req.model,
        messages=messages,
        max_tokens=max_tokens,
        **_sampling(req, defaults),
        seed=req.seed,
        stop=req.stops(),
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        ignore_eos=bool(req.ignore_eos),
    )


def completion_to_internal(req: CompletionRequest, limits: LimitsConfig,
                           defaults: SamplingDefaults | None = None) -> InferenceRequest:
    """``defaults``: as chat_to_internal's."""
    max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default here
    _check_limits(req, max_tokens, limits)
    prompt, ids = None, None
    if isinstance(req.prompt, str):
        prompt = req.prompt
    elif req.prompt and isinstance(req.prompt[0], str):
        prompt = req.prompt[0]
    else:
        ids = list(req.prompt)
    if prompt is not None and len(prompt) > limits.max_prompt_chars:
        raise InvalidRequestError(f"the prompt exceeds {limits.max_prompt_chars} characters", param="prompt")
    if prompt == "" or ids == []:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    want = req.logprobs is not None
    return InferenceRequest(
        request_id=new_id("cmpl"),
        model=req.model,
        prompt=prompt,
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        **_sampling(req, defaults),
        seed=req.seed,
        stop=req.stops(),
        logprobs=want,
        top_logprobs=req.logprobs or 0,
        ignore_eos=bool(req.ignore_eos),
    )


_OPENAI_SAMPLING = SamplingDefaults()


def _sampling(req, defaults: SamplingDefaults | None) -> dict:
    d = defaults or _OPENAI_SAMPLING
    return {"temperature": d.temperature if req.temperature is None else req.temperature,
            "top_p": d.top_p if req.top_p is None else req.top_p}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_logprobs(tokens, lps, tops) -> dict:
    content = []
    for i, (tok, lp) in enumerate(zip(tokens, lps)):
        alts = tops[i] if tops and i < len(tops) else []
        content.append(
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in alts],
            }
        )
    return {"content": content}


def _completion_logprobs(tokens, lps, tops, offset0: int = 0) -> dict:
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [dict(t) for t in tops] if tops else None,
        "text_offset": offsets,
    }


def chat_response(req: InferenceRequest, c: Completion, model: str) -> dict:
    return {
        "id": req.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c.tokens, c.logprobs, c.top_logprobs) if req.logprobs else None,
                "finish_reason": c.finish_reason,
            }
        ],
        "usage": usage(c.prompt_tokens, c.completion_tokens),
    }


def completion_response(req: InferenceRequest, c: Completion, model: str) -> dict:
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": c.text,
                "logprobs": _completion_logprobs(c.tokens, c.logprobs, c.top_logprobs) if req.logprobs else None,
                "finish_reason": c.finish_reason,
            }
        ],
        "usage": usage(c.prompt_tokens, c.completion_tokens),
    }


class ChunkFormatter:
    """Builds the SSE ``data:`` objects of one streamed response."""

    def __init__(self, req: InferenceRequest, model: str, chat: bool):
        self.req, self.model, self.chat = req, model, chat
        self.created = int(time.time())
        self._role_sent = False
        self._text_offset = 0

    def _base(self) -> dict:
        return {
            "id": self.req.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def delta(self, d: Delta) -> dict | None:
        if not d.text and d.finish_reason is None and not (self.req.logprobs and d.token_ids):
            return None
        choice: dict[str, Any] = {"index": 0, "finish_reason": d.finish_reason}
        if self.chat:
            delta: dict[str, Any] = {"content": d.text}
            if not self._role_sent:
                delta["role"] = "assistant"
                self._role_sent = True
            choice["delta"] = delta
            choice["logprobs"] = (
                _chat_logprobs(d.tokens or [], d.logprobs, d.top_logprobs) if self.req.logprobs else None
            )
        else:
            choice["text"] = d.text
            choice["logprobs"] = (
                _completion_logprobs(d.tokens or [], d.logprobs, d.top_logprobs, self._text_offset)
                if self.req.logprobs
                else None
            )
            self._text_offset += len(d.text)
        out = self._base()
        out["choices"] = [choice]
        return out

    def usage_chunk(self, prompt: int, completion: int) -> dict:
        out = self._base()
        out["choices"] = []
        out["usage"] = usage(prompt, completion)
        return out
