"""Request spans with GenAI semantic-convention attributes, and the sliding
windows the rollout gates read.

Every routed request gets a span (``gen_ai.*`` attributes plus
``seekserve.variant``, ``inference.confidence`` = exp(mean sampled-token
logprob) and ``inference.category``). :class:`VariantWindowProcessor` is an
OpenTelemetry ``SpanProcessor`` whose ``on_end`` only turns the span into a
small :class:`~rollout.analysis.Sample` and appends it to a buffer; a thread
ships the buffer to a sink (the rollout controller) every ``flush_s``.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Callable


from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from rollout.analysis import Sample, category

log = logging.getLogger("seekserve.signals")

VARIANT_ATTR = "seekserve.variant"
FIRST_CHUNK_EVENT = "seekserve.first_chunk"


class SampleWindows:
    """Per (model, variant) samples, oldest dropped past ``max_age_s``."""

    def __init__(self, max_age_s: float = 3600.0, max_per_variant: int = 200_000):
        self.max_age_s = max_age_s
        self._w: dict[tuple[str, str], collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=max_per_variant))
        self._lock = threading.Lock()

    def add(self, model: str, variant: str, s: Sample) -> None:
        with self._lock:
            self._w[(model, variant)].append(s)

    def samples(self, model: str, variant: str, since: float) -> list[Sample]:
        with self._lock:
            d = self._w.get((model, variant))
            if not d:
                return []
            horizon = time.time() - self.max_age_s
            while d and d[0].t < horizon:
                d.popleft()
            return [s for s in d if s.t >= since]


def sample_from_span(span: ReadableSpan) -> tuple[str, str, Sample] | None:
    a = span.attributes or {}
    variant = a.get(VARIANT_ATTR)
    model = a.get("gen_ai.request.model")
    if not variant or not model or span.end_time is None:
        return None
    status = int(a.get("http.response.status_code", 200))
    return model, variant, Sample(
        t=span.end_time / 1e9,
        latency_ms=(span.end_time - span.start_time) / 1e6,
        # only server-side failures count against a variant; 4xx are the client's
        error=status >= 500,
        confidence=a.get("inference.confidence"),
        category=a.get("inference.category"),
    )


class VariantWindowProcessor(SpanProcessor):
    def __init__(self, sink: Callable[[list[tuple]], None], flush_s: float = 0.5):
        self._sink = sink
        self.flush_s = flush_s
        self._buf: list[tuple] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="seekserve-signals", daemon=True)
        self._thread.start()

    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        got = sample_from_span(span)
        if got is None:
            return
        model, variant, s = got
        with self._lock:
            self._buf.append((model, variant, s.t, s.latency_ms, s.error, s.confidence, s.category))

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.force_flush()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            batch, self._buf = self._buf, []
        if batch:
            try:
                self._sink(batch)
            except Exception as e:  # signals are best effort: never break serving
                log.debug("signal sink failed: %s", e)
        return True

    def shutdown(self) -> None:
        self._stop.set()
        self.force_flush()


class RequestTelemetry:
    """Creates one span per routed request and fills it as the answer arrives."""

    def __init__(self, provider: TracerProvider):
        self.tracer = provider.get_tracer("seekserve")

    def start(self, operation: str, model: str, variant: str, request_id: str,
              routed_from_ns: int | None = None, received_ns: int | None = None) -> "RequestSpan":
        """The request's span; with ``routed_from_ns`` it gets a ``router.route`` child covering the variant
        choice. It starts at ``received_ns`` (when the front got the request, before its body was parsed and
        validated) where the front knows it, else at the routing: the latency a rollout gate compares is the
        server's, not what is left of it after the web framework."""
        start_ns = received_ns if received_ns is not None else routed_from_ns
        span = self.tracer.start_span(f"{operation} {model}", kind=SpanKind.SERVER, start_time=start_ns)
        if routed_from_ns is not None:
            from opentelemetry import trace

            route = self.tracer.start_span("router.route", context=trace.set_span_in_context(span),
                                           start_time=routed_from_ns)
            route.set_attribute(VARIANT_ATTR + ".chosen", variant)
            route.end()
        span.set_attribute("gen_ai.operation.name", operation)
        span.set_attribute("gen_ai.system", "seekserve")
        span.set_attribute("gen_ai.request.model", model)
        span.set_attribute(VARIANT_ATTR, variant)
        span.set_attribute("seekserve.request_id", request_id)
        return RequestSpan(span, model)

    def context_of(self, rs: "RequestSpan") -> dict[str, str]:
        from serve_app.tracing import inject

        return inject(rs.span)


class RequestSpan:
    def __init__(self, span, model: str):
        self.span = span
        self.model = model
        self._lp_sum = 0.0
        self._lp_n = 0
        self._done = False

    def first_chunk(self) -> None:
        """The first delta reached the ingress: the request's time to first token, minus the proxy."""
        self.span.add_event(FIRST_CHUNK_EVENT)

    def add_logprobs(self, logprobs: list[float]) -> None:
        self._lp_sum += sum(logprobs)
        self._lp_n += len(logprobs)

    def finish(self, *, prompt_tokens: int = 0, completion_tokens: int = 0, finish_reason: str | None = None,
               status_code: int = 200, error_type: str | None = None) -> None:
        if self._done:
            return
        self._done = True
        s = self.span
        s.set_attribute("gen_ai.response.model", self.model)
        s.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        s.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        s.set_attribute("http.response.status_code", status_code)
        if finish_reason:
            s.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        if self._lp_n:
            s.set_attribute("inference.confidence", math.exp(self._lp_sum / self._lp_n))
        if status_code < 400:
            s.set_attribute("inference.category", category(finish_reason, completion_tokens))
        if error_type:
            s.set_attribute("error.type", error_type)
            s.set_status(Status(StatusCode.ERROR, error_type))
        s.end()


def samples_from_batch(batch: list[tuple]):
    for model, variant, *rest in batch:
        yield model, variant, Sample(*rest)


