"""The ingress deployment: OpenAI HTTP routes, gRPC methods and the admin API,
all over the shared InferenceCore."""

import asyncio
import hmac
import json
import logging
import os
import time

from fastapi import Request
from pydantic import ValidationError
from ray import serve

from rollout.controller import RolloutNotFound, get_or_create, read_split
from rollout.router import Router, TrafficSplit
from rollout.signals import RequestTelemetry, VariantWindowProcessor
from serve_app import tracing
from serve_app.auth import KeyStore
from rollout.state_machine import RolloutCommandError
from serve_app.config import format_errors, parse_config
from serve_app.errors import (
    ConflictError,
    EngineNotReadyError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    UnauthorizedError,
)
from serve_app.frontend.core import InferenceCore
from serve_app.frontend.grpc_front import GrpcFront
from serve_app.frontend.http import RECEIVED_NS_KEY, error_response, make_app, run_request
from serve_app.frontend.openai_protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("seekserve.ingress")

app = make_app()


SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


class BodyLimit:
    """Pure ASGI middleware (Starlette's BaseHTTPMiddleware costs a task per
    request): notes when the request came in (the request's span starts there,
    not after FastAPI has parsed and validated its body), refuses a declared body
    over the limit before it is read, and adds security headers to every
    response. No CORS middleware is installed, so browsers on other origins are
    refused by default."""

    # set by the Ingress from its config; one ingress app per replica process
    limit_bytes: int = 1 << 20

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope[RECEIVED_NS_KEY] = time.time_ns()
            for key, value in scope.get("headers", ()):
                if key == b"content-length" and value.isdigit() and int(value) > self.limit_bytes:
                    body = json.dumps({"error": {
                        "message": f"request body is {int(value)} bytes; the limit is {self.limit_bytes}",
                        "type": "invalid_request_error", "param": None, "code": "request_too_large",
                    }}).encode()
                    await send({"type": "http.response.start", "status": 413,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()), *SECURITY_HEADERS]})
                    await send({"type": "http.response.body", "body": body})
                    return

            async def send_with_headers(message):
                if message["type"] == "http.response.start":
                    names = {k.lower() for k, _ in message.get("headers", [])}
                    extra = [(k, v) for k, v in SECURITY_HEADERS if k not in names]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                await send(message)

            await self.app(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send)


app.add_middleware(BodyLimit)

_COMMANDS = {"promote": "promote", "promote-full": "promote_full", "abort": "abort", "retry": "retry"}


@serve.ingress(app)
class Ingress(GrpcFront):
    async def __init__(self, config: dict, handles: dict):
        # soak diagnostics (benchmarks/soak.py --tracemalloc): Python allocations by line
        self._memory_mark = None
        frames = int(os.environ.get("SEEKSERVE_TRACEMALLOC", "0") or 0)
        if frames > 0:
            import tracemalloc

            tracemalloc.start(frames)
        self.config = parse_config(config)
        router = Router(
            {
                m.name: TrafficSplit(m.name, tuple((v.name, v.weight) for v in m.variants))
                for m in self.config.models
            }
        )
        self.app_name = serve.get_replica_context().app_name
        self._admin_token = os.environ.get(self.config.admin.token_env) or None
        self.keys = None
        if self.config.auth.mode == "api_keys":
            self.keys = KeyStore.from_settings(self.config.auth, replicas=self.config.ingress_replica_count())
            if not self.keys.keys:
                # refuse to start open when keys are required but none are configured
                raise RuntimeError("auth.mode is 'api_keys' but no API key is configured")
        self.controller = None
        processors = []
        if self.config.rollout.enabled:
            variants = {m.name: [v.name for v in m.variants] for m in self.config.models}
            # replicas a canary gets back when a rollout (re)starts; None: Serve autoscales it
            replicas = {f"{m.name}/{v.name}": (None if v.autoscaling else v.num_replicas)
                        for m in self.config.models for v in m.variants}
            db_path = self.config.rollout.db_path.replace("{app}", self.app_name)
            self.controller = get_or_create(self.app_name, db_path, variants, self.config.rollout.tick_s,
                                            replicas=replicas)
            controller = self.controller
            processors.append(VariantWindowProcessor(lambda batch: controller.ingest.remote(batch)))
        telemetry = None
        if processors or self.config.tracing.exporter != "none":
            telemetry = RequestTelemetry(tracing.make_provider(self.config.tracing, "seekserve-ingress", processors))
        self.core = InferenceCore(self.config, handles, router, telemetry)
        self.started = int(time.time())
        self._split_versions: dict[str, int] = {}
        BodyLimit.limit_bytes = self.config.limits.max_body_bytes
        if self.controller is not None:
            self._poll_task = asyncio.get_running_loop().create_task(self._poll_splits())
        self._warm_routes: list[str] = []
        self._warm_task = asyncio.get_running_loop().create_task(self._warm_handles())

    async def _warm_handles(self, retry_s: float = 1.0, give_up_s: float = 3600.0) -> None:
        """One cheap call to each variant, in the background, so that this replica's first real request
        does not pay for setting up its route to the LLM servers (CPU box, `benchmarks/idle_ttft.py`:
        50-80 ms more for the first request each ingress replica served). Does not hold readiness back:
        the LLM servers may take minutes to compile while the ingress is already up."""
        pending = {(m, v): h for m, variants in self.core.handles.items() for v, h in variants.items()}
        deadline = time.monotonic() + give_up_s
        while pending and time.monotonic() < deadline:
            for key, handle in list(pending.items()):
                try:
                    await asyncio.wait_for(handle.stats.remote(), timeout=30)
                    del pending[key]
                    self._warm_routes.append("/".join(key))
                except Exception as e:  # not up yet: try again; a request before then sets the route up itself
                    log.debug("warming the route to %s/%s: %s", *key, e)
            if pending:
                await asyncio.sleep(retry_s)

    async def _poll_splits(self) -> None:
        """Adopt the weights the rollout controller publishes (one reference swap each)."""
        while True:
            for m in self.config.models:
                try:
                    got = await asyncio.to_thread(read_split, self.app_name, m.name)
                    if got and got["version"] != self._split_versions.get(m.name):
                        self.core.router.set_weights(m.name, got["weights"])
                        self._split_versions[m.name] = got["version"]
                        log.info("traffic split of %s now %s (%s)", m.name, got["weights"], got.get("rollout"))
                except Exception as e:  # keep serving on the last split
                    log.warning("cannot read the traffic split of %s: %s", m.name, e)
            await asyncio.sleep(self.config.rollout.split_poll_s)

    # ---- auth for admin calls ------------------------------------------------
    def check_admin(self, request: Request) -> str:
        if self._admin_token is None:
            raise ForbiddenError(f"the admin API is disabled: set {self.config.admin.token_env} on the cluster")
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer "):
            raise UnauthorizedError("missing admin bearer token")
        if not hmac.compare_digest(auth[7:].strip().encode(), self._admin_token.encode()):
            raise ForbiddenError("the admin token is not valid")
        return "admin"

    # ---- OpenAI API -----------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await run_request(self.core, request, body, chat=True, check_admin=self.check_admin, keys=self.keys)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await run_request(self.core, request, body, chat=False, check_admin=self.check_admin, keys=self.keys)

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

    def warm_routes(self) -> list[str]:
        """The variants ("model/variant") this replica's start-up call has reached (handle call only)."""
        return list(self._warm_routes)

    def memory_mark(self) -> bool:
        """Take the baseline for :meth:`memory_growth` (handle call only, not HTTP)."""
        import tracemalloc

        if not tracemalloc.is_tracing():
            return False
        self._memory_mark = tracemalloc.take_snapshot()
        return True

    def memory_growth(self, limit: int = 15) -> list[str]:
        """Python allocations grown since :meth:`memory_mark`, largest first, by traceback."""
        import tracemalloc

        if self._memory_mark is None:
            return []
        now = tracemalloc.take_snapshot()
        stats = now.compare_to(self._memory_mark, "traceback")
        out = [f"total traced {sum(s.size for s in now.statistics('filename')) / 1e6:.1f} MB"]
        for st in stats[:limit]:
            frames = " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in st.traceback[:6])
            out.append(f"{st.size_diff / 1e3:+.1f} kB ({st.count_diff:+d} blocks): {frames}")
        return out

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

    @app.get("/admin/traffic")
    async def traffic(self):
        return {m: self.core.router.split(m).as_dict() for m in self.core.models()}

    # ---- rollouts ------------------------------------------------------------
    async def _call(self, method: str, *args):
        if self.controller is None:
            raise ConflictError("rollouts are disabled in this app's config (rollout.enabled)")
        try:
            return await getattr(self.controller, method).remote(*args)
        except Exception as e:
            cause = getattr(e, "cause", e)
            if isinstance(cause, RolloutNotFound):
                raise NotFoundError(f"rollout {cause.args[0]!r} does not exist") from e
            if isinstance(cause, RolloutCommandError):
                raise ConflictError(str(cause)) from e
            if isinstance(cause, ValidationError):
                raise InvalidRequestError(format_errors(cause)) from e
            if isinstance(cause, ValueError):
                raise InvalidRequestError(str(cause)) from e
            raise

    @app.post("/admin/rollouts", status_code=201)
    async def start_rollout(self, request: Request):
        who = self.check_admin(request)
        try:
            plan = await request.json()
        except ValueError as e:
            raise InvalidRequestError(f"the body is not JSON: {e}") from e
        return await self._call("start_rollout", plan, who)

    @app.get("/admin/rollouts")
    async def list_rollouts(self, request: Request):
        self.check_admin(request)
        return await self._call("status")

    @app.get("/admin/rollouts/{name}")
    async def get_rollout(self, name: str, request: Request):
        self.check_admin(request)
        return (await self._call("status", name))[0]

    @app.get("/admin/rollouts/{name}/history")
    async def rollout_history(self, name: str, request: Request):
        self.check_admin(request)
        return await self._call("history", name)

    @app.post("/admin/rollouts/{name}/weights")
    async def rollout_weights(self, name: str, request: Request):
        who = self.check_admin(request)
        try:
            body = await request.json()
        except ValueError as e:
            raise InvalidRequestError(f"the body is not JSON: {e}") from e
        w = body.get("canary_weight") if isinstance(body, dict) else None
        if not isinstance(w, int) or not 0 <= w <= 100:
            raise InvalidRequestError("canary_weight must be an integer 0..100", param="canary_weight")
        return await self._call("command", name, "set_weight", who, w)

    @app.post("/admin/rollouts/{name}/{cmd}")
    async def rollout_command(self, name: str, cmd: str, request: Request):
        who = self.check_admin(request)
        if cmd not in _COMMANDS:
            raise NotFoundError(f"unknown rollout command {cmd!r}; valid: {', '.join(_COMMANDS)}")
        return await self._call("command", name, _COMMANDS[cmd], who)
