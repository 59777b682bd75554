"""The one request path behind every front end (HTTP now, gRPC too).

Given a normalised :class:`InferenceRequest`, it picks the variant, calls its
LLMServer, enforces timeouts, and turns every failure into exactly one
:class:`~serve_app.errors.SeekserveError`. Front ends only translate wire
formats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from ray import exceptions as ray_exceptions
from ray.serve import exceptions as serve_exceptions

from rollout.router import Router
from serve_app.config import AppConfig, SamplingDefaults
from rollout.signals import RequestTelemetry
from serve_app import metrics
from serve_app.errors import (
    EngineError,
    EngineNotReadyError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    RequestTimeoutError,
    SeekserveError,
)
from serve_app.internal import Completion, Delta, InferenceRequest

log = logging.getLogger("seekserve.frontend")


def to_seekserve_error(e: BaseException, retry_after_s: float = 1.0) -> SeekserveError:
    """Map any exception from the replica call to our one exception per failure."""
    if isinstance(e, SeekserveError) and not isinstance(e, ray_exceptions.RayTaskError):
        if isinstance(e, OverloadedError):
            # the deployment's configured back-off, not the engine's default
            e.retry_after_s = retry_after_s
        return e
    cause = getattr(e, "cause", None)
    if isinstance(e, ray_exceptions.RayTaskError) and isinstance(cause, BaseException):
        return to_seekserve_error(cause, retry_after_s)
    if isinstance(e, serve_exceptions.BackPressureError):
        return OverloadedError("too many requests queued for this model", retry_after_s=retry_after_s)
    if isinstance(e, (ray_exceptions.RayActorError, serve_exceptions.DeploymentUnavailableError)):
        return EngineNotReadyError("no replica of this model is available right now")
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return RequestTimeoutError("the request timed out")
    return EngineError(f"{type(e).__name__}: {e}")


def replica_lost(e: BaseException) -> bool:
    """The replica process died or became unreachable (not an error the request caused)."""
    if isinstance(e, ray_exceptions.RayTaskError) and isinstance(getattr(e, "cause", None), BaseException):
        return replica_lost(e.cause)
    return isinstance(e, ray_exceptions.RayActorError)


@dataclass
class StreamHandle:
    variant: str
    first: Delta
    rest: AsyncIterator[Delta]


# a client that goes away is not the variant's failure (nginx's 499)
CLIENT_CLOSED = 499


class _NoSpan:
    def add_logprobs(self, lps) -> None:
        pass

    def first_chunk(self) -> None:
        pass

    def finish(self, **kw) -> None:
        pass


class _Recorded:
    """The request's span plus its ingress metrics (outcome counter, e2e latency)."""

    def __init__(self, span, model: str, variant: str, received_ns: int | None = None):
        self.span, self.model, self.variant = span, model, variant
        # e2e from the request's receipt where the front knows it (the span starts there too)
        self.t0 = time.monotonic() - (max(0, time.time_ns() - received_ns) / 1e9 if received_ns else 0.0)
        self.done = False

    def add_logprobs(self, lps) -> None:
        self.span.add_logprobs(lps)

    def first_chunk(self) -> None:
        self.span.first_chunk()

    def finish(self, status_code: int = 200, error_type: str | None = None, **kw) -> None:
        if self.done:
            return
        self.done = True
        self.span.finish(status_code=status_code, error_type=error_type, **kw)
        try:
            t = metrics.tags(self.model, self.variant)
            metrics.get("requests").inc(1.0, tags={**t, "status_code": str(status_code),
                                                   "error_type": error_type or ""})
            if status_code < 400:
                metrics.get("e2e").observe(time.monotonic() - self.t0, tags=t)
        except Exception as e:  # metrics never break serving
            log.debug("request metrics failed: %s", e)


class InferenceCore:
    def __init__(self, config: AppConfig, handles: dict[str, dict[str, object]], router: Router,
                 telemetry: RequestTelemetry | None = None):
        self.config = config
        self.handles = handles
        self.router = router
        self.telemetry = telemetry

    def models(self) -> list[str]:
        return [m.name for m in self.config.models]

    def sampling_defaults(self, model: str) -> SamplingDefaults | None:
        """The model's sampling for fields a request leaves out; None for an unknown model (routing
        rejects it)."""
        return next((m.sampling_defaults for m in self.config.models if m.name == model), None)

    def route(self, model: str, user: str | None, override: str | None = None) -> tuple[str, object]:
        split = self.router.split(model)
        if split is None:
            raise ModelNotFoundError(f"The model '{model}' does not exist", param="model")
        if override is not None:
            if override not in self.handles[model]:
                raise InvalidRequestError(
                    f"variant {override!r} of {model!r} does not exist; variants: {sorted(self.handles[model])}",
                    param="x-seekserve-variant")
            variant = override
        else:
            variant = split.pick(user)
        return variant, self.handles[model][variant]

    def _span(self, req: InferenceRequest, variant: str, routed_from_ns: int, received_ns: int | None):
        span = _NoSpan()
        if self.telemetry is not None:
            op = "chat" if req.messages is not None else "text_completion"
            span = self.telemetry.start(op, req.model, variant, req.request_id, routed_from_ns, received_ns)
            req.trace_context = self.telemetry.context_of(span)
        return _Recorded(span, req.model, variant, received_ns)

    async def complete(self, req: InferenceRequest, user: str | None = None,
                       override: str | None = None, received_ns: int | None = None) -> Completion:
        """``received_ns``: when the front got the request (``time.time_ns()``), where it knows."""
        routed_from_ns = time.time_ns()
        variant, handle = self.route(req.model, user, override)
        span = self._span(req, variant, routed_from_ns, received_ns)
        t = self.config.timeouts
        deadline = time.monotonic() + t.request_timeout_s
        try:
            for attempt in range(t.replica_failure_retries + 1):
                response = handle.generate_full.remote(req)
                try:
                    result = await asyncio.wait_for(_await(response), timeout=max(0.0, deadline - time.monotonic()))
                    break
                except asyncio.TimeoutError:
                    response.cancel()
                    raise RequestTimeoutError(
                        f"the request did not finish within {t.request_timeout_s:g} s"
                    ) from None
                except asyncio.CancelledError:
                    response.cancel()
                    span.finish(status_code=CLIENT_CLOSED, error_type="cancelled")
                    raise
                except Exception as e:
                    # nothing reached the client yet, so a dead replica's request can be sent again
                    if not await self._may_retry(e, attempt, deadline, req):
                        raise to_seekserve_error(e, t.retry_after_s) from e
        except SeekserveError as e:
            span.finish(status_code=e.status_code, error_type=type(e).__name__)
            raise
        result.variant = variant
        span.add_logprobs(result.logprobs)
        span.finish(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                    finish_reason=result.finish_reason)
        return result

    async def _may_retry(self, e: BaseException, attempt: int, deadline: float, req: InferenceRequest) -> bool:
        t = self.config.timeouts
        if not replica_lost(e) or attempt >= t.replica_failure_retries:
            return False
        pause_s = t.replica_failure_backoff_s * (2 ** attempt)
        if time.monotonic() + pause_s >= deadline:
            return False
        log.warning("request %s: replica lost (%s); re-sending (retry %d of %d)", req.request_id,
                    type(e).__name__, attempt + 1, t.replica_failure_retries)
        try:
            metrics.get("replica_retries").inc(1.0, tags={"model": req.model})
        except Exception as me:  # metrics never break serving
            log.debug("retry metric failed: %s", me)
        await asyncio.sleep(pause_s)
        return True

    async def stream(self, req: InferenceRequest, user: str | None = None,
                     override: str | None = None, received_ns: int | None = None) -> StreamHandle:
        """Start a stream; admission errors surface here, before any byte is sent. ``received_ns`` as for
        :meth:`complete`."""
        routed_from_ns = time.time_ns()
        variant, handle = self.route(req.model, user, override)
        span = self._span(req, variant, routed_from_ns, received_ns)
        t = self.config.timeouts
        deadline = time.monotonic() + t.request_timeout_s
        first_timeout = min(t.first_token_timeout_s or t.request_timeout_s, t.request_timeout_s)
        first_deadline = time.monotonic() + first_timeout
        try:
            for attempt in range(t.replica_failure_retries + 1):
                gen = handle.options(stream=True).generate.remote(req)
                try:
                    first = Delta.from_wire(await asyncio.wait_for(
                        gen.__anext__(), timeout=max(0.0, first_deadline - time.monotonic())))
                    break
                except asyncio.TimeoutError:
                    gen.cancel()
                    raise RequestTimeoutError(f"no token within {first_timeout:g} s") from None
                except asyncio.CancelledError:
                    gen.cancel()
                    span.finish(status_code=CLIENT_CLOSED, error_type="cancelled")
                    raise
                except StopAsyncIteration:
                    raise EngineError("the engine ended the stream without output") from None
                except Exception as e:
                    # no byte has been sent: a dead replica's stream can start again elsewhere
                    if not await self._may_retry(e, attempt, first_deadline, req):
                        raise to_seekserve_error(e, t.retry_after_s) from e
        except SeekserveError as e:
            span.finish(status_code=e.status_code, error_type=type(e).__name__)
            raise
        span.first_chunk()
        span.add_logprobs(first.logprobs)
        return StreamHandle(variant, first, self._rest(gen, deadline, span, first))

    async def _rest(self, gen, deadline: float, span, last: Delta) -> AsyncIterator[Delta]:
        status, error_type = CLIENT_CLOSED, "cancelled"
        try:
            if last.finish_reason is not None:
                status, error_type = 200, None
                return
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeoutError("the request timed out while streaming")
                try:
                    last = Delta.from_wire(await asyncio.wait_for(gen.__anext__(), timeout=left))
                except StopAsyncIteration:
                    status, error_type = 200, None
                    return
                except asyncio.TimeoutError:
                    raise RequestTimeoutError("the request timed out while streaming") from None
                except Exception as e:
                    raise to_seekserve_error(e, self.config.timeouts.retry_after_s) from e
                span.add_logprobs(last.logprobs)
                yield last
        except SeekserveError as e:
            status, error_type = e.status_code, type(e).__name__
            raise
        finally:
            # the client went away, timed out or finished: stop the replica's generator
            gen.cancel()
            span.finish(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                        finish_reason=last.finish_reason, status_code=status, error_type=error_type)


async def _await(response):
    return await response
