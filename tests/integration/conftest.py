"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    """The tiny Llama checkpoint every integration test serves."""
    return checkpoint_factory("llama")
