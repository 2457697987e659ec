"""The router's request span, named and filled by the OpenTelemetry GenAI conventions.

One span per HTTP generation request, ``{gen_ai.operation.name} {model}``
(``chat m`` or ``text_completion m``), parent of the ``route`` spans and, via
gRPC metadata, of the workers' ``prefill``, ``kv_transfer`` and ``decode``
spans. With tracing off the span records nothing but still carries ids.
"""

from __future__ import annotations

from fastapi import Request
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from shared.tracing import Tracing

# Route id prefix -> gen_ai.operation.name
OPERATIONS = {"chatcmpl": "chat", "cmpl": "text_completion"}


def start_request_span(tracing: Tracing, request: Request, id_prefix: str, model: str, request_id: str) -> Span:
    operation = OPERATIONS.get(id_prefix, id_prefix)
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.response.id": request_id,
        "http.route": request.url.path,
    }
    parent = tracing.extract(request.headers.items())
    return tracing.start(f"{operation} {model}", parent, SpanKind.SERVER, attributes=attributes)


def end_request_span(
    span: Span, status: int, input_tokens: int, output_tokens: int, finish_reasons: list[str], ttft_s: float | None
) -> None:
    """Usage, finish reasons, TTFT and the HTTP status; 5xx marks the span as an error."""
    if span.is_recording():
        span.set_attributes({
            "http.response.status_code": status,
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": finish_reasons,
        })  # fmt: skip
        if ttft_s is not None:
            span.set_attribute("gen_ai.server.time_to_first_token", ttft_s)
        if status >= 400:
            span.set_attribute("error.type", str(status))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
    span.end()
