"""Shared pytest fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest

from tileinfer.model.config import preset
from tileinfer.model.synthetic import write_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The "tiny" preset (real vocabulary and tokenizer, 2 small layers) written once per session.

    Treat it as read-only; copy it before changing anything.
    """
    out = tmp_path_factory.mktemp("tiny-checkpoint")
    write_checkpoint(preset("tiny"), out, seed=0, progress=False)
    return out


# ---------------------------------------------------------------------------- GPU tests
# Tests marked `gpu` need a CUDA device. Without one (CI) they are skipped with the reason
# the driver gave, so a CPU-only run stays green and says why.

def pytest_collection_modifyitems(config, items):
    from tileinfer.cuda import gpu_available

    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    ok, why = gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no CUDA device: {why}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    from tileinfer.cuda import get_device
    return get_device()


@pytest.fixture
def stream(device):
    from tileinfer.cuda import Stream
    s = Stream()
    yield s
    s.synchronize()
    s.destroy()
