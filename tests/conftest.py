"""Shared pytest fixtures, the model the server's tests serve (--serve-device, --serve-model), the GPU tests'
skip and the one-line-per-reason skip summary."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from tileinfer.kv.sizing import DEFAULT_PAGE_SIZE
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


# ---------------------------------------------------------------------------- the served model
# The server's tests (test_server, test_serve_process, test_bench_serve, and the server parts of
# test_structured and test_tools) serve the tiny checkpoint on the CPU runner. The same tests run against
# a GPU with `pytest --serve-device cuda --serve-model qwen3-0.6b` (scripts/serve_gpu_checks.sh).

def pytest_addoption(parser):
    group = parser.getgroup("tileinfer serve", "the model the server's tests serve")
    group.addoption("--serve-device", choices=("cpu", "cuda"), default="cpu",
                    help="the device of the served LLMs and of their references (default: cpu, the float32 runner)")
    group.addoption("--serve-model", default=None, metavar="DIR|PRESET",
                    help="the checkpoint served: a directory, or a synthetic preset's name, written once "
                         "(model/synthetic.py: cached_checkpoint); default: the tiny preset")


@dataclass(frozen=True)
class ServeTarget:
    """What the server's tests serve: a checkpoint on a device, and the engine options every served LLM and
    its reference get there."""
    device: str
    checkpoint: Path

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def startup_seconds(self) -> float:
        """How long a `tileinfer serve` process may take to answer /health (a GPU may compile kernels first)."""
        return 300.0 if self.on_gpu else 60.0

    def engine_options(self, max_num_seqs: int, max_context: int) -> dict:
        """tileinfer.LLM's options. On the GPU, batch-invariant kernels (a reply must not depend on the batch
        it ran in, so that it equals its reference's) and a pool of max_num_seqs sequences of max_context,
        as the CPU runner sizes it (several engines share the GPU: none may size its pool from free memory)."""
        options = dict(device=self.device, max_num_seqs=max_num_seqs, max_context=max_context, progress=False)
        if self.on_gpu:
            options.update(batch_invariant=True, num_pages=_pool_pages(max_num_seqs, max_context))
        return options

    def serve_options(self, max_num_seqs: int, max_context: int) -> list[str]:
        """The same as `tileinfer serve` options."""
        options = ["--device", self.device, "--max-num-seqs", str(max_num_seqs), "--max-context", str(max_context)]
        if self.on_gpu:
            options += ["--batch-invariant", "--num-pages", str(_pool_pages(max_num_seqs, max_context))]
        return options


def _pool_pages(max_num_seqs: int, max_context: int) -> int:
    return max_num_seqs * -(-max_context // DEFAULT_PAGE_SIZE)


@pytest.fixture(scope="session")
def serve_target(request) -> ServeTarget:
    device = request.config.getoption("--serve-device")
    model = request.config.getoption("--serve-model")
    if model is None:
        checkpoint = request.getfixturevalue("tiny_checkpoint")
    elif Path(model).is_dir():
        checkpoint = Path(model)
    else:
        from tileinfer.model.config import PRESETS
        from tileinfer.model.synthetic import cached_checkpoint
        if model not in PRESETS:
            raise pytest.UsageError(f"--serve-model {model}: neither a directory nor a synthetic preset "
                                    f"({', '.join(sorted(PRESETS))})")
        checkpoint = cached_checkpoint(model, progress=True)
    return ServeTarget(device, checkpoint)


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
