"""OpenTelemetry tracing of one process: off unless an OTLP endpoint is given.

Each process owns one ``Tracing`` (no global tracer provider is installed):
with ``--otlp-traces-endpoint URL`` spans go through a batch processor to an
OTLP/gRPC collector; without it there is no processor (nothing is exported)
and the sampler records nothing of its own, only honouring a caller's sampled
flag so that traced callees still join the caller's trace. W3C trace
context travels in gRPC metadata through OpenTelemetry's
``TraceContextTextMapPropagator`` either way: callees join the caller's trace
(an incoming ``traceparent``, or a fresh trace) even when nothing is traced.
Torch-free: the router imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Metadata = tuple[tuple[str, str], ...]
Attrs = dict[str, Any] | None


class Tracing:
    """Tracer and propagator of one process; ``enabled`` is False when nothing is exported."""

    def __init__(self, service_name: str, endpoint: str | None = None) -> None:
        self.enabled = bool(endpoint)
        self.propagator = TraceContextTextMapPropagator()
        resource = Resource.create({"service.name": service_name})
        if not self.enabled:
            self._provider = TracerProvider(resource=resource, sampler=ParentBased(ALWAYS_OFF))
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            insecure = not str(endpoint).startswith("https://")
            self._provider = TracerProvider(resource=resource)
            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
            self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._provider.get_tracer("cleave")

    def extract(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
        """The remote parent carried by incoming gRPC metadata or HTTP headers (empty context if none)."""
        carrier = {key.lower(): value for key, value in (metadata or ()) if isinstance(value, str)}
        return self.propagator.extract(carrier)

    def inject(self, span: Span | None, context: Context | None = None) -> Metadata:
        """Metadata pairs that make ``span`` (or the span in ``context``) the parent of the callee's spans."""
        carrier: dict[str, str] = {}
        ctx = trace.set_span_in_context(span, context) if span is not None else context
        self.propagator.inject(carrier, ctx)
        return tuple(carrier.items())

    @contextmanager
    def span(
        self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL, attributes: Attrs = None
    ) -> Iterator[Span]:
        """A span ended on exit; an exception escaping it marks the span as an error."""
        with self.tracer.start_as_current_span(
            name, context=parent, kind=kind, attributes=attributes, record_exception=True, set_status_on_exception=True
        ) as span:
            yield span

    def start(
        self, name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL, attributes: Attrs = None
    ) -> Span:
        """A span the caller ends (it outlives one ``with`` block)."""
        return self.tracer.start_span(name, context=parent, kind=kind, attributes=attributes)

    def shutdown(self) -> None:
        """Flush what is queued; call once at exit."""
        self._provider.shutdown()


def mark_error(span: Span, error: BaseException | None, description: str) -> None:
    """Status ERROR, with an exception event when there is an exception."""
    if error is not None:
        span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, description))
