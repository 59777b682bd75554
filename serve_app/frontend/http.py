"""The OpenAI-compatible HTTP front end (FastAPI inside a Ray Serve ingress)."""

from __future__ import annotations

import asyncio
import json
import logging
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.errors import SeekserveError
from serve_app.frontend.core import InferenceCore, to_seekserve_error
from serve_app.frontend.openai_protocol import (
    ChunkFormatter,
    chat_response,
    chat_to_internal,
    completion_response,
    completion_to_internal,
    invalid_request,
)
from serve_app.internal import InferenceRequest

log = logging.getLogger("seekserve.http")

VARIANT_HEADER = "x-seekserve-variant"
# the ASGI scope key under which the app's own middleware (the ingress's BodyLimit) notes when a request came in
# (time.time_ns()), before FastAPI reads and validates its body
RECEIVED_NS_KEY = "seekserve.received_ns"
USER_HEADER = "x-seekserve-user"


def error_response(err: SeekserveError) -> JSONResponse:
    return JSONResponse(err.to_body(), status_code=err.status_code, headers=err.headers())


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SeekserveError)
    async def _seekserve(_: Request, exc: SeekserveError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return error_response(invalid_request(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        body = {
            "error": {
                "message": str(exc.detail),
                "type": "invalid_request_error",
                "param": None,
                "code": kinds.get(exc.status_code),
            }
        }
        return JSONResponse(body, status_code=exc.status_code)


def _user_key(request: Request, body_user: str | None) -> str | None:
    return body_user or request.headers.get(USER_HEADER) or None


OVERRIDE_HEADER = "x-seekserve-variant"


async def _sse(core: InferenceCore, req: InferenceRequest, fmt: ChunkFormatter, include_usage: bool, handle,
               on_end=None):
    def event(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    last = handle.first
    try:
        out = fmt.delta(handle.first)
        if out is not None:
            yield event(out)
        async for d in handle.rest:
            last = d
            out = fmt.delta(d)
            if out is not None:
                yield event(out)
        if include_usage:
            yield event(fmt.usage_chunk(last.prompt_tokens, last.completion_tokens))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # headers are gone: report in-band, then end the stream properly
        err = to_seekserve_error(e)
        log.warning("stream %s failed: %s", req.request_id, err.message)
        yield event(err.to_body())
    finally:
        await handle.rest.aclose()
        if on_end is not None:
            on_end()
    yield "data: [DONE]\n\n"


async def run_request(core: InferenceCore, request: Request, body, chat: bool, check_admin=None, keys=None):
    """``keys``: a KeyStore when API keys are required (401 without one, 429 over its limits)."""
    principal = keys.authenticate(request.headers.get("authorization")) if keys is not None else None
    limits = core.config.limits
    defaults = core.sampling_defaults(body.model)
    req = chat_to_internal(body, limits, defaults) if chat else completion_to_internal(body, limits, defaults)
    user = _user_key(request, body.user)
    override = request.headers.get(OVERRIDE_HEADER)
    if override is not None and check_admin is not None:
        check_admin(request)  # pinning a variant is for testing, admins only
    release = (lambda: keys.release(principal)) if principal is not None else (lambda: None)
    if principal is not None:
        keys.acquire(principal)
    streaming = False
    try:
        if body.stream:
            handle = await core.stream(req, user, override, request.scope.get(RECEIVED_NS_KEY))
            fmt = ChunkFormatter(req, body.model, chat)
            streaming = True  # the stream releases the slot when it ends
            return StreamingResponse(
                _sse(core, req, fmt, body.include_usage(), handle, on_end=release),
                media_type="text/event-stream",
                headers={VARIANT_HEADER: handle.variant, "Cache-Control": "no-cache"},
            )
        result = await core.complete(req, user, override, request.scope.get(RECEIVED_NS_KEY))
    finally:
        if not streaming:
            release()
    payload = chat_response(req, result, body.model) if chat else completion_response(req, result, body.model)
    return JSONResponse(payload, headers={VARIANT_HEADER: result.variant})


def make_app() -> FastAPI:
    app = FastAPI(
        title="seekserve",
        description="OpenAI-compatible inference API for private LLM deployments.",
        version="0.1.0",
    )
    install_error_handlers(app)
    return app
