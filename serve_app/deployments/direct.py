"""Direct streaming: the model's LLMServer replicas serve the API themselves.

With ``server.direct_streaming`` the app has one deployment. Each replica runs
the Ingress's HTTP routes, gRPC methods and admin API in front of the
LLMServer it hosts in the same process, so a request and every message of its
stream skip the Ray hop between the two deployments (Ray Serve LLM's
``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING`` does the same for its OpenAiIngress
and LLMServer). With Serve's HAProxy data path (direct ingress) HAProxy hands
the connection straight to a replica, and Serve's Python proxy is gone too.

The InferenceCore is unchanged: it gets a :class:`LocalHandle`, the part of a
DeploymentHandle it calls (``generate``, ``generate_full``, ``stats``), over
the in-process LLMServer.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from serve_app.config import parse_config
from serve_app.deployments.ingress import Ingress
from serve_app.deployments.llm_server import LLMServer
from serve_app.errors import OverloadedError


class _Call:
    """``handle.method.remote(...)`` for a coroutine or async-generator method of the local server."""

    def __init__(self, start):
        self.remote = start


class _LocalStream:
    """What ``handle.options(stream=True).generate.remote()`` returns, over a local async generator:
    ``__anext__`` and a ``cancel()`` that stops the generator (and so the engine's request)."""

    def __init__(self, agen: AsyncIterator):
        self._agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._agen.__anext__()

    def cancel(self) -> None:
        # a consumer that stops between messages leaves the generator suspended at a yield: close it now,
        # not when it is collected. One that stops inside __anext__ cancels that await, which already ends it
        if self._agen.ag_frame is not None and not self._agen.ag_running:
            asyncio.get_running_loop().create_task(self._agen.aclose())


class LocalHandle:
    """A DeploymentHandle's surface over an LLMServer in this process, with its admission bound.

    Serve bounds a separate LLMServer deployment at ``max_ongoing_requests`` running plus as many queued,
    and refuses past that with a 429; here the same count of requests in flight is refused the same way."""

    def __init__(self, server: LLMServer, max_in_flight: int, retry_after_s: float):
        self.server = server
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.generate = _Call(lambda req: _LocalStream(self._stream(req)))
        self.generate_full = _Call(lambda req: asyncio.ensure_future(self._full(req)))
        self.stats = _Call(lambda: asyncio.ensure_future(self.server.stats()))

    def options(self, stream: bool = False) -> "LocalHandle":
        return self

    def _admit(self) -> None:
        if self.in_flight >= self.max_in_flight:
            raise OverloadedError(f"too many requests in flight for this model ({self.max_in_flight})",
                                  retry_after_s=self.retry_after_s)
        self.in_flight += 1

    async def _stream(self, req) -> AsyncIterator[list]:
        self._admit()
        try:
            async for wire in self.server.generate(req):
                yield wire
        finally:
            self.in_flight -= 1

    async def _full(self, req):
        self._admit()
        try:
            return await self.server.generate_full(req)
        finally:
            self.in_flight -= 1


class DirectServer(Ingress):
    """The Ingress with its one variant's LLMServer in the same replica (``server.direct_streaming``).

    The methods Serve and the benchmarks call on an LLMServer replica (``generate``, ``stats``, health,
    autoscaling metrics) are the hosted server's, so the deployment stands where the LLMServer one would,
    under the same name."""

    async def __init__(self, config: dict, server_kwargs: dict):
        cfg = parse_config(config)
        model, variant = cfg.models[0], cfg.models[0].variants[0]
        # the engine first: a replica reports ready only once it can answer, as an LLMServer does
        self.server = await LLMServer.create(**server_kwargs)
        max_ongoing = variant.effective_max_ongoing_requests()
        handle = LocalHandle(self.server, 2 * max_ongoing, cfg.timeouts.retry_after_s)
        await super().__init__(config, {model.name: {variant.name: handle}})

    # ---- the LLMServer's replica surface ---------------------------------------
    async def generate(self, req) -> AsyncIterator[list]:
        async for wire in self.server.generate(req):
            yield wire

    async def generate_full(self, req):
        return await self.server.generate_full(req)

    async def stats(self) -> dict:
        return await self.server.stats()

    async def update_engine_options(self, changes: dict) -> dict:
        return await self.server.update_engine_options(changes)

    async def check_health(self) -> None:
        await self.server.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.server.record_autoscaling_stats()

    async def __del__(self):
        server = getattr(self, "server", None)  # absent when the engine failed to start
        if server is not None:
            await server.__del__()
        await super().__del__()
