"""The gRPC front end (``seekserve.v1.Inference``) over the shared InferenceCore.

Requests are validated by the same OpenAI request models as HTTP, so limits
and error messages are identical; errors become gRPC status codes
(``SeekserveError.grpc_status``) with the message as details.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import grpc
from pydantic import ValidationError

from serve_app.errors import InvalidRequestError, ModelNotFoundError, SeekserveError
from serve_app.frontend.core import InferenceCore, to_seekserve_error
from serve_app.frontend.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_to_internal,
    completion_to_internal,
    invalid_request,
)
from serve_app.internal import Completion, Delta, InferenceRequest
from serve_app.protos import seekserve_pb2 as pb

log = logging.getLogger("seekserve.grpc")


def to_internal(req: pb.GenerateRequest, core: InferenceCore) -> tuple[InferenceRequest, str | None]:
    common: dict = {"model": req.model, "user": req.user or None}
    if req.stop:
        common["stop"] = list(req.stop)
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if req.HasField(name):
            common[name] = getattr(req, name)
    limits = core.config.limits
    defaults = core.sampling_defaults(req.model)
    try:
        if req.messages:
            body = ChatCompletionRequest(
                messages=[{"role": m.role, "content": m.content} for m in req.messages],
                logprobs=req.logprobs,
                top_logprobs=req.top_logprobs or None,
                **common,
            )
            return chat_to_internal(body, limits, defaults), body.user
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        body = CompletionRequest(
            prompt=req.prompt, logprobs=(req.top_logprobs if req.logprobs else None), **common
        )
        internal = completion_to_internal(body, limits, defaults)
        if not req.HasField("max_tokens"):
            internal.max_tokens = None  # gRPC callers get the server default, not OpenAI's legacy 16
        return internal, body.user
    except ValidationError as e:
        raise invalid_request(e.errors()) from e


def _logprobs(tokens, lps, tops) -> list[pb.TokenLogprob]:
    out = []
    for i, (tok, lp) in enumerate(zip(tokens or [], lps)):
        alts = tops[i] if tops and i < len(tops) else []
        out.append(pb.TokenLogprob(token=tok, logprob=lp,
                                   top_logprobs=[pb.TopLogprob(token=t, logprob=v) for t, v in alts]))
    return out


def _usage(prompt: int, completion: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_message(req: InferenceRequest, c: Completion) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        id=req.request_id,
        model=req.model,
        variant=c.variant,
        text=c.text,
        token_ids=c.token_ids,
        logprobs=_logprobs(c.tokens, c.logprobs, c.top_logprobs) if req.logprobs else [],
        finish_reason=c.finish_reason,
        usage=_usage(c.prompt_tokens, c.completion_tokens),
    )


def delta_message(req: InferenceRequest, d: Delta, variant: str) -> pb.GenerateStreamResponse:
    msg = pb.GenerateStreamResponse(
        id=req.request_id,
        variant=variant,
        text=d.text,
        token_ids=d.token_ids,
        logprobs=_logprobs(d.tokens, d.logprobs, d.top_logprobs) if req.logprobs else [],
        finish_reason=d.finish_reason or "",
    )
    if d.finish_reason is not None:
        msg.usage.CopyFrom(_usage(d.prompt_tokens, d.completion_tokens))
    return msg


def _fail(grpc_context, err: SeekserveError) -> SeekserveError:
    if grpc_context is not None:
        grpc_context.set_code(getattr(grpc.StatusCode, err.grpc_status))
        grpc_context.set_details(err.message)
    return err


class GrpcFront:
    """Mixed into the ingress deployment: Ray Serve's gRPC proxy calls methods by RPC name."""

    core: InferenceCore
    keys = None

    def _principal(self, grpc_context) -> str | None:
        """API key from the 'authorization' metadata when keys are required; takes a slot."""
        if self.keys is None:
            return None
        md = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        name = self.keys.authenticate(md.get("authorization"))
        self.keys.acquire(name)
        return name

    def _release(self, principal: str | None) -> None:
        if principal is not None:
            self.keys.release(principal)

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        principal = None
        try:
            principal = self._principal(grpc_context)
            req, user = to_internal(request, self.core)
            result = await self.core.complete(req, user)
        except Exception as e:
            raise _fail(grpc_context, to_seekserve_error(e)) from e
        finally:
            self._release(principal)
        return completion_message(req, result)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator:
        principal = None
        try:
            principal = self._principal(grpc_context)
            req, user = to_internal(request, self.core)
            handle = await self.core.stream(req, user)
        except Exception as e:
            self._release(principal)
            raise _fail(grpc_context, to_seekserve_error(e)) from e
        try:
            yield delta_message(req, handle.first, handle.variant)
            async for d in handle.rest:
                yield delta_message(req, d, handle.variant)
        except Exception as e:
            raise _fail(grpc_context, to_seekserve_error(e)) from e
        finally:
            await handle.rest.aclose()
            self._release(principal)

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1.Health/Check: SERVING when every variant of the service answers.

        ``service`` is "" (the whole server), "seekserve.v1.Inference", or a model name."""
        from grpc_health.v1 import health_pb2

        service = request.service
        known = {"", "seekserve.v1.Inference"} | {m.name for m in self.core.config.models}
        if service not in known:
            raise _fail(grpc_context, ModelNotFoundError(f"unknown service {service!r}"))
        try:
            await self._variant_stats(timeout_s=5.0)
            status = health_pb2.HealthCheckResponse.SERVING
        except SeekserveError:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context=None) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id=m.name, variants=[v.name for v in m.variants]) for m in self.core.config.models]
        )
