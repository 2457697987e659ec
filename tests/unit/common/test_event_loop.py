import asyncio

import pytest

from services.common import event_loop


async def running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_where_installed(monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.delenv("CLEAVE_EVENT_LOOP", raising=False)
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(running_loop_module(), "uvloop").startswith("uvloop")


def test_asyncio_keeps_the_standard_loop(monkeypatch):
    monkeypatch.setenv("CLEAVE_EVENT_LOOP", "asyncio")
    assert event_loop.loop_name() == "asyncio"
    assert event_loop.run(running_loop_module(), "asyncio").startswith("asyncio")


def test_an_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv("CLEAVE_EVENT_LOOP", "tokio")
    with pytest.raises(ValueError, match="auto, uvloop, asyncio"):
        event_loop.loop_name()


def test_uvloop_asked_for_but_missing_is_refused(monkeypatch):
    monkeypatch.setenv("CLEAVE_EVENT_LOOP", "uvloop")
    monkeypatch.setitem(__import__("sys").modules, "uvloop", None)  # import fails
    with pytest.raises(ValueError, match="not installed"):
        event_loop.loop_name()
