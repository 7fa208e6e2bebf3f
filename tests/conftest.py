"""Shared pytest fixtures, the GPU tests' skip and the one-line-per-reason skip summary."""
from __future__ import annotations

from collections import Counter
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


@pytest.fixture(scope="session")
def dflash_tiny_checkpoint(tmp_path_factory) -> Path:
    """The "dflash-tiny" preset (a two-layer DFlash drafter for the tiny preset, reading both its layers) written
    once per session. Treat it as read-only."""
    from tileinfer.model.dflash_config import DFLASH_PRESETS
    out = tmp_path_factory.mktemp("dflash-tiny-checkpoint")
    write_checkpoint(DFLASH_PRESETS["dflash-tiny"][1], out, seed=0, progress=False)
    return out


@pytest.fixture(scope="session")
def apertus_tiny_checkpoint(tmp_path_factory) -> Path:
    """The "apertus-tiny" preset (its own 384-token byte-level tokenizer with Apertus' special tokens, 2 small
    layers) written once per session. Treat it as read-only; copy it before changing anything."""
    out = tmp_path_factory.mktemp("apertus-tiny-checkpoint")
    write_checkpoint(preset("apertus-tiny"), out, seed=0, progress=False)
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


# ---------------------------------------------------------------------------- skip summary
# pyproject.toml's -r leaves skips out (without a GPU, a thousand tests skip for one reason, and -rs
# lists them once per test location); this prints one line per distinct reason with its count.

def _skip_reason(report) -> str:
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: reason")
        reason = report.longrepr[2]
        return reason.removeprefix("Skipped: ")
    return str(report.longrepr)


def pytest_terminal_summary(terminalreporter):
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "skipped", False)]
    if not skipped:
        return
    terminalreporter.write_sep("=", "skips by reason")
    for reason, count in Counter(_skip_reason(r) for r in skipped).most_common():
        terminalreporter.write_line(f"SKIPPED {count} test{'s' if count != 1 else ''}: {reason}")
