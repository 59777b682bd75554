"""A backend's engine in a process of its own (vLLM V1's engine-core layout).

Why: inline, the engine's thread shares the replica's interpreter, and so one
GIL, with the replica's event loop, which carries every stream's messages to
the ingress. The engine thread drops the GIL around each kernel launch and each
wait on the GPU, and takes it back behind whatever the event loop is doing. On
the H200 this layout made 6 % more tokens than inline at 64 concurrent streams
(10 % while all 64 were in flight), and cut TTFT p50 from 137 to 109 ms
(docs/gpu_notes.md run 39). On a host short of cores the extra process costs
instead (docs/engines.md).

The replica keeps the backend's tokenization (:meth:`Engine.frontend`, no
model) and :class:`SeparateProcessEngine`, which implements the engine
contract by relaying. The child (``python -m serve_app.engines.process FD``)
runs the backend exactly as a replica runs it inline, beside an event loop
that only relays. One socket pair carries pickled messages:

* parent -> child: ``("start", backend, options)``, ``("generate", request)``,
  ``("abort", request_id)``, ``("health", n)``, ``("shutdown",)``;
* child -> parent: ``("ready", info)``, ``("failed", text)``,
  ``("health", n, error_text_or_None)``, and
  ``("out", [(request_id, EngineChunk | SeekserveError), ...], EngineStats | None, gc | None)``:
  what the engine produced since the child's last send, as one message (under
  load, one per engine step rather than one per token or per stream).

The child collects and freezes its objects once its engine has started, as
Ray Serve does for each replica (``RAY_SERVE_FREEZE_GC_ON_STARTUP``): after a
compile a full collection of them held the GIL for ~1 s (docs/gpu_notes.md
run 27). Its collections come back with the stats (``process_gc``).

A child that exits (a crash, the OOM killer) ends every open stream with
:class:`~serve_app.errors.EngineError` (a request it had not answered yet with
:class:`~serve_app.errors.EngineNotReadyError`, which a client may retry) and
fails health checks from then on,
so Ray Serve replaces the replica. A replica that dies closes the socket,
and the child shuts its engine down on the end of file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, AsyncIterator

from pydantic import BaseModel

from serve_app.errors import EngineError, EngineNotReadyError, InvalidRequestError, SeekserveError

from .base import Engine, EngineChunk, EngineStats, GenerationRequest, ParallelConfig, ends_stream

log = logging.getLogger(__name__)

#: how often the child reports its engine's stats when nothing else is sent
_STATS_IDLE_INTERVAL_S = 0.5
#: and at most how often along with outputs (stats walk the batch; once per step is wasted work)
_STATS_BUSY_INTERVAL_S = 0.05
_HEALTH_TIMEOUT_S = 10.0
_SHUTDOWN_TIMEOUT_S = 30.0


class _Route:
    """Where one request's items from the child go (a ``generate`` stream's queue, or a ``submit`` sink);
    ``started`` once the child sent anything for it."""

    __slots__ = ("sink", "started")

    def __init__(self, sink):
        self.sink, self.started = sink, False


class SeparateProcessEngine(Engine):
    """The engine contract, served by a registered backend running in a child process."""

    name = "separate-process"
    supports_submit = True  # whatever the backend: the child relays either way
    options_model = BaseModel  # not registered by name: it wraps a backend that is

    def __init__(self, backend: str, options: BaseModel, parallel: ParallelConfig | None = None):
        super().__init__(options, parallel)
        from .registry import get_engine_class

        if self.parallel.tensor_parallel_size != 1:
            raise ValueError("an engine in a separate process runs one rank (tensor_parallel_size 1)")
        self.backend = backend
        self._cls = get_engine_class(backend)
        self._frontend = None
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready_fut: asyncio.Future | None = None
        self._routes: dict[str, _Route] = {}
        self._health: dict[int, asyncio.Future] = {}
        self._health_seq = 0
        self._stats = EngineStats()
        self._child_gc: dict | None = None
        self._info: dict[str, Any] = {}
        self._gone: str | None = None  # why the child can no longer serve
        self._started = False

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        # the tokenizer first: a bad model path fails here in seconds, not after the child's load
        self._frontend = await asyncio.to_thread(self._cls.frontend, self.options)
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the child imports what this process can (Ray's working_dir and runtime env live in sys.path)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "serve_app.engines.process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, close_fds=True,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._loop = asyncio.get_running_loop()
        self._ready_fut = self._loop.create_future()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)
        self._send(("start", self.backend, self.options.model_dump()))
        self._info = await self._ready_fut
        self._started = True
        log.info("engine %s running in process %d", self.backend, self._proc.pid)

    async def shutdown(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if self._gone is None:
            try:
                self._send(("shutdown",))
            except EngineNotReadyError:
                pass
        try:
            await asyncio.to_thread(proc.wait, _SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("engine process %d did not stop in %.0f s; killing it", proc.pid, _SHUTDOWN_TIMEOUT_S)
            proc.kill()
            await asyncio.to_thread(proc.wait)
        self._child_gone("the engine was shut down")

    async def check_health(self) -> None:
        if not self._started:
            raise EngineNotReadyError("engine is not started")
        if self._gone is not None:
            raise EngineNotReadyError(self._gone)
        self._health_seq += 1
        n = self._health_seq
        fut = self._loop.create_future()
        self._health[n] = fut
        try:
            self._send(("health", n))
            error = await asyncio.wait_for(fut, _HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError as e:
            raise EngineNotReadyError(
                f"the engine process did not answer a health check in {_HEALTH_TIMEOUT_S:.0f} s") from e
        finally:
            self._health.pop(n, None)
        if error is not None:
            raise EngineNotReadyError(error)

    # ---- what the replica reads without a round trip ----------------------
    @property
    def max_model_len(self) -> int:
        return int(self._info["max_model_len"])

    @property
    def load_time_s(self) -> float | None:
        return self._info.get("load_time_s")

    @property
    def warm_up(self) -> dict | None:
        w = self._info.get("warm_up")
        if w is None:
            return None
        w = {**w, "engine_process_pid": self._proc.pid if self._proc else None}
        if "prefill_eager_passes" in w:
            # the child sent its warm-up once, at its start; this count moves while serving
            w["prefill_eager_passes"] = self._stats.prefill_eager_passes
        return w

    @property
    def process_gc(self) -> dict | None:
        """The child's garbage-collector pauses (:mod:`serve_app.gcpause`), as of its last stats."""
        return self._child_gc

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self._frontend.encode_chat(messages)

    def encode_text(self, prompt: str) -> list[int]:
        return self._frontend.encode_text(prompt)

    def token_text(self, token_id: int) -> str:
        return self._frontend.token_text(token_id)

    def stats(self) -> EngineStats:
        """The child's latest snapshot (at most ~50 ms old under load, 0.5 s when idle)."""
        s = EngineStats(**self._stats.as_dict())
        s.healthy = s.healthy and self._gone is None
        return s

    # ---- requests ---------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineChunk]:
        rid = request.request_id
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(request, queue)
        ended = False
        try:
            while True:
                item = await queue.get()
                ended = ends_stream(item)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if ended:
                    return
        finally:
            self._routes.pop(rid, None)
            if not ended and self._gone is None:
                try:
                    self._send(("abort", rid))
                except EngineNotReadyError:
                    pass

    def submit(self, request: GenerationRequest, sink) -> None:
        if not self._started or self._gone is not None:
            raise EngineNotReadyError(self._gone or "engine is not ready")
        rid = request.request_id
        if rid in self._routes:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        self._routes[rid] = _Route(sink)
        try:
            self._send(("generate", request))
        except EngineNotReadyError:
            self._routes.pop(rid, None)
            raise

    async def abort(self, request_id: str) -> None:
        if self._gone is None:
            self._send(("abort", request_id))

    def update_options(self, changes: dict[str, Any]) -> dict[str, Any]:
        """As :meth:`Engine.update_options`, here and in the child; requests sent after this call see them."""
        applied = super().update_options(changes)
        self._send(("options", applied))
        return applied

    # ---- the socket --------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except (OSError, ValueError) as e:  # closed socket, or the child went away mid-send
            self._child_gone(f"the engine process is gone: {e}")
            raise EngineNotReadyError(self._gone) from e

    def _on_readable(self) -> None:
        try:
            while self._conn is not None and self._conn.poll():
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            code = None
            if self._proc is not None:
                try:  # the socket closes a moment before the exit is reaped; the code tells kill from crash
                    code = self._proc.wait(0.2)
                except subprocess.TimeoutExpired:
                    pass
            self._child_gone(f"the engine process exited (exit code {code})")

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            _, items, stats, child_gc = msg
            routes = self._routes
            for rid, item in items:
                route = routes.get(rid)
                if route is not None:  # else: the consumer left; its abort is on the way
                    route.started = True
                    route.sink.put_nowait(item)
                    if ends_stream(item):
                        del routes[rid]  # a submitted request has no generator to remove its route
            if stats is not None:
                self._stats = stats
            if child_gc is not None:
                self._child_gc = child_gc
        elif kind == "health":
            fut = self._health.get(msg[1])
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "ready":
            self._ready_fut.set_result(msg[1])
        elif kind == "failed":
            if not self._ready_fut.done():
                # the engine's own error where it has one (a KV cache too large, a GPU without FP8), so the
                # replica fails with the same type as with the engine inside its own process
                err = msg[1] if isinstance(msg[1], SeekserveError) else EngineError(
                    f"the engine process failed to start: {msg[1]}")
                self._ready_fut.set_exception(err)

    def _child_gone(self, reason: str) -> None:
        if self._gone is not None:
            return
        self._gone = reason
        if self._conn is not None:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except (OSError, ValueError):
                pass
            self._conn.close()
            self._conn = None
        routes, self._routes = self._routes, {}
        for route in routes.values():
            # a request the child sent nothing for never started (it may have been sent after the child
            # died, before its socket's end was read): not ready, and retryable, like one that arrives later
            route.sink.put_nowait(EngineError(reason) if route.started else EngineNotReadyError(reason))
        for fut in self._health.values():
            if not fut.done():
                fut.set_result(reason)
        if self._ready_fut is not None and not self._ready_fut.done():
            self._ready_fut.set_exception(EngineError(reason))


# ---- the child --------------------------------------------------------------
def _request_error(e: BaseException) -> SeekserveError:
    """One request's failure as the replica raises it: ours as they are, anything else an EngineError (that
    request's error, not the child's end)."""
    return e if isinstance(e, SeekserveError) else EngineError(f"generation failed: {e}")


class _RelaySink:
    """One request's chunks from :meth:`Engine.submit` into the relay's next message."""

    __slots__ = ("relay", "rid")

    def __init__(self, relay: "_Relay", rid: str):
        self.relay, self.rid = relay, rid

    def put_nowait(self, item: Any) -> None:
        self.relay._out(self.rid, _request_error(item) if isinstance(item, BaseException) else item)


class _Relay:
    """Runs in the child: requests in, the engine's chunks out, batched per event-loop turn."""

    def __init__(self, conn: Connection, engine: Engine, gc_pauses=None):
        self.conn = conn
        self.engine = engine
        self.gc_pauses = gc_pauses
        self.loop = asyncio.get_running_loop()
        self.stopped = self.loop.create_future()
        self.tasks: dict[str, asyncio.Task] = {}
        self._pending: list[tuple[str, Any]] = []
        self._flush_scheduled = False
        self._stats_sent_at = 0.0
        self._trailing_stats: asyncio.TimerHandle | None = None

    def on_readable(self) -> None:
        try:
            while self.conn.poll():
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):  # the replica is gone
            self._stop()

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "generate":
            req: GenerationRequest = msg[1]
            if self.engine.supports_submit:
                self._submit(req)
            else:
                self.tasks[req.request_id] = self.loop.create_task(self._run(req))
        elif kind == "abort":
            self.loop.create_task(self.engine.abort(msg[1]))
        elif kind == "health":
            self.loop.create_task(self._health(msg[1]))
        elif kind == "options":  # checked by the parent (update_options)
            for key, value in msg[1].items():
                setattr(self.engine.options, key, value)
        elif kind == "shutdown":
            self._stop()

    def _stop(self) -> None:
        if not self.stopped.done():
            self.stopped.set_result(None)

    def _submit(self, req: GenerationRequest) -> None:
        # the engine's chunks go straight into the next message: a task per request wakes once per chunk, 64
        # times an engine step at 64 streams (the relay's CPU per step 1.35-1.43 ms that way on the CPU box,
        # 0.74-0.83 this way: benchmarks/relay_cpu.py), and all of it is GIL the engine's thread waits for
        try:
            self.engine.submit(req, _RelaySink(self, req.request_id))
        except Exception as e:
            self._fail(req.request_id, e)

    async def _run(self, req: GenerationRequest) -> None:
        try:
            async for chunk in self.engine.generate(req):
                self._out(req.request_id, chunk)
        except Exception as e:
            self._fail(req.request_id, e)
        finally:
            self.tasks.pop(req.request_id, None)

    def _fail(self, rid: str, e: Exception) -> None:
        """In an except block: the request's error to the replica; a failure not of ours logged with its
        traceback."""
        if not isinstance(e, SeekserveError):
            log.exception("request %s failed", rid)
        self._out(rid, _request_error(e))

    async def _health(self, n: int) -> None:
        try:
            await self.engine.check_health()
            error = None
        except Exception as e:
            error = str(e) or type(e).__name__
        self._send(("health", n, error))

    def _out(self, rid: str, item: Any) -> None:
        self._pending.append((rid, item))
        if not self._flush_scheduled:
            # after the wake-ups already queued in this turn (an engine step wakes every stream at
            # once), so that one message carries the whole step
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        items, self._pending = self._pending, []
        now = time.monotonic()
        stats = child_gc = None
        if now - self._stats_sent_at >= _STATS_BUSY_INTERVAL_S:
            stats, child_gc, self._stats_sent_at = self.engine.stats(), self._gc(), now
        elif self._trailing_stats is None:
            # the last step of a burst must not leave the replica a stale count (autoscaling reads it)
            self._trailing_stats = self.loop.call_later(_STATS_BUSY_INTERVAL_S, self._send_stats)
        self._send(("out", items, stats, child_gc))

    def _gc(self) -> dict | None:
        return self.gc_pauses.snapshot() if self.gc_pauses is not None else None

    def _send_stats(self) -> None:
        self._trailing_stats = None
        self._stats_sent_at = time.monotonic()
        self._send(("out", [], self.engine.stats(), self._gc()))

    async def report_stats(self) -> None:
        while True:
            await asyncio.sleep(_STATS_IDLE_INTERVAL_S)
            if time.monotonic() - self._stats_sent_at >= _STATS_IDLE_INTERVAL_S:
                self._send_stats()

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            self._stop()


async def _serve(conn: Connection) -> int:
    from .registry import create_engine

    msg = conn.recv()
    if msg[0] != "start":
        raise RuntimeError(f"expected a start message, got {msg[0]!r}")
    _, backend, options = msg
    try:
        engine = create_engine(backend, options)
        await engine.start()
    except BaseException as e:  # the replica reports it; a traceback in this log helps the operator
        log.exception("engine %s failed to start", backend)
        conn.send(("failed", e if isinstance(e, SeekserveError) else f"{type(e).__name__}: {e}"))
        return 1
    conn.send(("ready", {
        "max_model_len": engine.max_model_len,
        "load_time_s": getattr(engine, "load_time_s", None),
        "warm_up": getattr(engine, "warm_up", None),
    }))
    import gc

    from serve_app import gcpause

    gc.collect()
    gc.freeze()  # later collections walk what requests allocate, not the load's and compile's objects
    relay = _Relay(conn, engine, gcpause.pauses())
    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), relay.on_readable)
    stats_task = loop.create_task(relay.report_stats())
    await relay.stopped
    loop.remove_reader(conn.fileno())
    stats_task.cancel()
    await engine.shutdown()
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    conn = Connection(int(argv[0]))
    try:
        return asyncio.run(_serve(conn))
    except EOFError:  # the replica went away before the start message
        return 1
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
