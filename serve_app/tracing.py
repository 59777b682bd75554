"""Tracing: a TracerProvider per process configured from the app config, W3C
context carried inside requests across Ray actor calls, and an OTLP JSON-lines
file exporter for local use.

Every request span is *recorded* (the rollout gates read all of them) but only
``sampling_ratio`` of traces are *exported*: :class:`RecordAllSampler` returns
RECORD_ONLY for the rest, which span processors see and exporters skip.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


class RecordAllSampler(Sampler):
    def __init__(self, ratio: float):
        self._ratio = TraceIdRatioBased(ratio)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        from opentelemetry import trace

        parent = trace.get_current_span(parent_context).get_span_context()
        if parent.is_valid:
            sampled = parent.trace_flags.sampled
        else:
            sampled = self._ratio.should_sample(parent_context, trace_id, name).decision == Decision.RECORD_AND_SAMPLE
        return SamplingResult(Decision.RECORD_AND_SAMPLE if sampled else Decision.RECORD_ONLY, attributes)

    def get_description(self) -> str:
        return f"RecordAllSampler({self._ratio.get_description()})"


class JsonLinesSpanExporter(SpanExporter):
    """Appends each batch as one OTLP/JSON ``{"resourceSpans": [...]}`` line (the
    OpenTelemetry Collector file exporter's format). Several processes may append
    to one file: each line is written with one O_APPEND write."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        line = json.dumps(MessageToDict(encode_spans(spans)), separators=(",", ":")) + "\n"
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def make_exporter(settings) -> SpanExporter | None:
    kind = settings.exporter
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "file":
        return JsonLinesSpanExporter(settings.file_path)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=settings.otlp_endpoint) if settings.otlp_endpoint else OTLPSpanExporter()


def make_provider(settings, service: str, processors=()) -> TracerProvider:
    provider = TracerProvider(
        sampler=RecordAllSampler(settings.sampling_ratio),
        resource=Resource.create({"service.name": service}),
    )
    for p in processors:
        provider.add_span_processor(p)
    exporter = make_exporter(settings)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return provider


def inject(span) -> dict[str, str]:
    """W3C traceparent of ``span``, to carry inside a request across a Ray call."""
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: dict[str, str] | None):
    return _PROPAGATOR.extract(carrier or {})
