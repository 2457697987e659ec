"""Shared fixtures for the whole test tree."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory) -> Callable[..., Path]:
    """``checkpoint_factory(arch, **kwargs)`` -> directory of a tiny checkpoint, written once per session."""
    made: dict[str, Path] = {}

    def factory(arch: str, **kwargs) -> Path:
        key = f"{arch}:{sorted(kwargs.items())!r}"
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, **kwargs)
        return made[key]

    return factory


@pytest.fixture()
def redis_server():
    """A real redis-server on a free port, stopped after the test."""
    from tests.helpers.redis_server import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()
