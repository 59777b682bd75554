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
from serve_app.config import AppConfig
from serve_app.errors import (
    EngineError,
    EngineNotReadyError,
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


@dataclass
class StreamHandle:
    variant: str
    first: Delta
    rest: AsyncIterator[Delta]


class InferenceCore:
    def __init__(self, config: AppConfig, handles: dict[str, dict[str, object]], router: Router):
        self.config = config
        self.handles = handles
        self.router = router

    def models(self) -> list[str]:
        return [m.name for m in self.config.models]

    def route(self, model: str, user: str | None) -> tuple[str, object]:
        split = self.router.split(model)
        if split is None:
            raise ModelNotFoundError(f"The model '{model}' does not exist", param="model")
        variant = split.pick(user)
        return variant, self.handles[model][variant]

    async def complete(self, req: InferenceRequest, user: str | None = None) -> Completion:
        variant, handle = self.route(req.model, user)
        t = self.config.timeouts
        response = handle.generate_full.remote(req)
        try:
            result = await asyncio.wait_for(_await(response), timeout=t.request_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise RequestTimeoutError(
                f"the request did not finish within {t.request_timeout_s:g} s"
            ) from None
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as e:
            raise to_seekserve_error(e, t.retry_after_s) from e
        result.variant = variant
        return result

    async def stream(self, req: InferenceRequest, user: str | None = None) -> StreamHandle:
        """Start a stream; admission errors surface here, before any byte is sent."""
        variant, handle = self.route(req.model, user)
        t = self.config.timeouts
        deadline = time.monotonic() + t.request_timeout_s
        gen = handle.options(stream=True).generate.remote(req)
        first_timeout = min(t.first_token_timeout_s or t.request_timeout_s, t.request_timeout_s)
        try:
            first = await asyncio.wait_for(gen.__anext__(), timeout=first_timeout)
        except asyncio.TimeoutError:
            gen.cancel()
            raise RequestTimeoutError(f"no token within {first_timeout:g} s") from None
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except StopAsyncIteration:
            raise EngineError("the engine ended the stream without output") from None
        except Exception as e:
            raise to_seekserve_error(e, t.retry_after_s) from e
        return StreamHandle(variant, first, self._rest(gen, deadline))

    async def _rest(self, gen, deadline: float) -> AsyncIterator[Delta]:
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeoutError("the request timed out while streaming")
                try:
                    yield await asyncio.wait_for(gen.__anext__(), timeout=left)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise RequestTimeoutError("the request timed out while streaming") from None
                except Exception as e:
                    raise to_seekserve_error(e, self.config.timeouts.retry_after_s) from e
        finally:
            # the client went away, timed out or finished: stop the replica's generator
            gen.cancel()


async def _await(response):
    return await response
