"""Fixtures of the GPU tests (the `stream` and `device` fixtures are in tests/conftest.py)."""
from __future__ import annotations

import pytest

from gpu_helpers import Buffers


@pytest.fixture
def buf(stream):
    b = Buffers(stream)
    yield b
    stream.synchronize()
    b.free()
