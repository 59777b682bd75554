"""The ingress deployment: OpenAI HTTP routes over the shared InferenceCore."""



import asyncio
import json
import time

from fastapi import Request
from ray import serve

from rollout.router import Router, TrafficSplit
from serve_app.config import parse_config
from serve_app.errors import EngineNotReadyError
from serve_app.frontend.core import InferenceCore
from serve_app.frontend.grpc_front import GrpcFront
from serve_app.frontend.http import error_response, make_app, run_request
from serve_app.frontend.openai_protocol import ChatCompletionRequest, CompletionRequest

app = make_app()


class BodyLimit:
    """Pure ASGI middleware (Starlette's BaseHTTPMiddleware costs a task per
    request): refuses a declared body over the limit before it is read."""

    # set by the Ingress from its config; one ingress app per replica process
    limit_bytes: int = 1 << 20

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for key, value in scope.get("headers", ()):
                if key == b"content-length" and value.isdigit() and int(value) > self.limit_bytes:
                    body = json.dumps({"error": {
                        "message": f"request body is {int(value)} bytes; the limit is {self.limit_bytes}",
                        "type": "invalid_request_error", "param": None, "code": "request_too_large",
                    }}).encode()
                    await send({"type": "http.response.start", "status": 413,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                    return
        await self.app(scope, receive, send)


app.add_middleware(BodyLimit)


@serve.ingress(app)
class Ingress(GrpcFront):
    def __init__(self, config: dict, handles: dict):
        self.config = parse_config(config)
        router = Router(
            {
                m.name: TrafficSplit(m.name, tuple((v.name, v.weight) for v in m.variants))
                for m in self.config.models
            }
        )
        self.core = InferenceCore(self.config, handles, router)
        self.started = int(time.time())
        BodyLimit.limit_bytes = self.config.limits.max_body_bytes

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await run_request(self.core, request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await run_request(self.core, request, body, chat=False)

    @app.get("/v1/models")
    async def models(self):
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": self.started, "owned_by": "seekserve"}
                for name in self.core.models()
            ],
        }

    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self):
        try:
            stats = await self._variant_stats(timeout_s=5.0)
        except EngineNotReadyError as e:
            return error_response(e)
        return {"status": "ready", "variants": sorted(stats)}

    @app.get("/admin/engine-stats")
    async def engine_stats(self):
        return await self._variant_stats(timeout_s=10.0)

    async def _variant_stats(self, timeout_s: float) -> dict:
        keys, calls = [], []
        for model, variants in self.core.handles.items():
            for variant, handle in variants.items():
                keys.append(f"{model}/{variant}")
                calls.append(handle.stats.remote())
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls), timeout=timeout_s)
        except Exception as e:
            raise EngineNotReadyError(f"a model variant is not ready: {type(e).__name__}") from e
        return dict(zip(keys, results))
