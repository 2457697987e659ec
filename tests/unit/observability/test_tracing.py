"""Tracing off exports nothing yet keeps trace context flowing; on, spans reach an OTLP receiver."""

from __future__ import annotations

import time

from shared.tracing import Tracing
from tests.integration.otlp_receiver import OTLPReceiver

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_off_exports_nothing_and_continues_the_callers_trace():
    tracing = Tracing("test", None)
    assert not tracing.enabled
    parent = tracing.extract([("traceparent", PARENT)])
    span = tracing.start("work", parent)
    ((key, value),) = tracing.inject(span)
    span.end()
    assert key == "traceparent" and value.split("-")[1] == PARENT.split("-")[1]
    assert value.split("-")[2] != PARENT.split("-")[2]  # a span of its own
    tracing.shutdown()


def test_off_with_a_receiver_listening_sends_it_nothing():
    receiver = OTLPReceiver()
    try:
        tracing = Tracing("test", None)
        with tracing.span("work"):
            pass
        tracing.shutdown()
        assert receiver.snapshot() == []
    finally:
        receiver.stop()


def test_on_exports_spans_with_errors_marked():
    receiver = OTLPReceiver()
    try:
        tracing = Tracing("svc", receiver.endpoint)
        try:
            with tracing.span("failing", attributes={"k": 1}):
                raise ValueError("boom")
        except ValueError:
            pass
        tracing.shutdown()  # flushes
        deadline = time.monotonic() + 30
        while not receiver.snapshot() and time.monotonic() < deadline:
            time.sleep(0.1)
        (span,) = receiver.snapshot()
        assert (span.service, span.name, span.attributes["k"], span.status_code) == ("svc", "failing", 1, 2)
        assert "exception" in span.events
    finally:
        receiver.stop()
