"""The ingress deployment: OpenAI HTTP routes over the shared InferenceCore."""



import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from ray import serve

from rollout.router import Router, TrafficSplit
from serve_app.config import parse_config
from serve_app.errors import EngineNotReadyError
from serve_app.frontend.core import InferenceCore
from serve_app.frontend.http import error_response, make_app, run_request
from serve_app.frontend.openai_protocol import ChatCompletionRequest, CompletionRequest

app = make_app()


@app.middleware("http")
async def _limit_body(request: Request, call_next):
    # Reject oversized bodies before FastAPI reads them into memory.
    limit = request.app.state.max_body_bytes if hasattr(request.app.state, "max_body_bytes") else None
    length = request.headers.get("content-length")
    if limit and length and length.isdigit() and int(length) > limit:
        return JSONResponse(
            {
                "error": {
                    "message": f"request body is {length} bytes; the limit is {limit}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            },
            status_code=413,
        )
    return await call_next(request)


@serve.ingress(app)
class Ingress:
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
        app.state.max_body_bytes = self.config.limits.max_body_bytes

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
