"""scripts/host_launches.py: a step's launches recorded without a GPU, their host time and a digest that names
exactly what was launched."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import tileinfer.cuda.driver as cuda_driver
import tileinfer.cuda.memory as cuda_memory
import tileinfer.cuda.module as cuda_module
from tileinfer.cuda.kernel_units import FIRST, PART_OF
from tileinfer.cuda.module import LATER_FILES
from tileinfer.kernels.routing import default_path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "host_launches.py"


def load():
    if "host_launches" not in sys.modules:
        spec = importlib.util.spec_from_file_location("host_launches", SCRIPT)
        sys.modules["host_launches"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["host_launches"])
    return sys.modules["host_launches"]


def test_the_same_step_launches_the_same_and_another_step_differs():
    h = load()
    first = h.measure("tiny", 48, 1, 1, repeats=2)
    again = h.measure("tiny", 48, 1, 1, repeats=2)
    assert first["digest"] == again["digest"] and first["launches"] == again["launches"]
    names = [launch[0] for launch in first["launches"]]
    assert names[:2] == ["resolve_tokens", "embedding"] and names.count("attention_wg") == 2  # a prefill, 2 layers
    assert all(min(launch[1]) >= 1 and min(launch[2]) >= 1 for launch in first["launches"])
    assert first["step_us"] > 0 and first["launch_us"] == first["step_us"] / len(names)
    decode = h.measure("tiny", 8, 8, 4, repeats=2)  # eight sequences' decode step, keys split 4 ways
    assert decode["digest"] != first["digest"] and decode["launches"] != first["launches"]


def test_the_driver_facing_pieces_are_restored_after():
    h = load()
    before = (cuda_module.load_module, cuda_driver.Device, cuda_memory.call, cuda_driver.gpu_available())
    h.measure("tiny", 16, 2, 1, repeats=1)
    # gpu_available: the process's device (get_device's cached one) is not the recording's stand-in
    assert (cuda_module.load_module, cuda_driver.Device, cuda_memory.call, cuda_driver.gpu_available()) == before


def test_the_command_prints_each_model_and_refuses_a_step_it_cannot_split(capsys):
    h = load()
    assert h.main(["--models", "tiny", "--tokens", "32", "--seqs", "2", "--repeats", "2", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny: 32 tokens in 2 sequences, ") and "launches digest " in out
    assert "\n  resolve_tokens grid=(1, 1, 1)" in out
    assert h.main(["--models", "tiny", "--tokens", "33", "--seqs", "2"]) == 2
    assert "--tokens must be a positive multiple of --seqs" in capsys.readouterr().err


def test_a_buffer_more_leaves_the_digest_of_a_step_that_does_not_use_it(monkeypatch):
    # Pointers enter the digest by allocation (size, and count of that size before it), not by address: another
    # workspace array of its own size moves every later address, not the digest.
    import numpy as np

    from tileinfer.model import forward as F
    h = load()
    before = h.measure("tiny", 48, 1, 1, repeats=1)
    made = F.Workspace.__init__

    def with_another_array(self, *args, **kwargs):
        self.unused = cuda_memory.DeviceArray((12345,), np.int8)
        made(self, *args, **kwargs)
    monkeypatch.setattr(F.Workspace, "__init__", with_another_array)
    after = h.measure("tiny", 48, 1, 1, repeats=1)
    assert after["digest"] == before["digest"] and after["launches"] == before["launches"]
    assert all(b"<" in launch[4] for launch in after["launches"])  # every launch has a pointer, named


def test_the_digest_names_a_pointer_by_its_allocation_and_tells_offsets_apart():
    h = load()
    r = h.Recorder()
    a, b, c = (r.call(cuda_driver.driver.cuMemAlloc, n) for n in (100, 200, 100))
    assert r.where(a) == b"<100 bytes #0 +0>" and r.where(c + 8) == b"<100 bytes #1 +8>" and r.where(b) != r.where(a)
    assert r.where(a + 100) is None and r.where(a - 1) is None  # past its end (its page padding), before the first


def test_a_step_whose_rows_read_each_others_new_keys_stores_them_before_attention():
    # A DFlash block pass (runner/step.py token_rows_shape): 16 one-token sequences, but the block tokens of a
    # request attend to each other's new keys. Its attention must not store them itself (the fused input, which a
    # decode step of 16 sequences takes): another block of the launch could read a key before it is stored.
    from tileinfer.model import forward as F
    from tileinfer.model.inputs import StepShape
    from tileinfer.runner.step import token_rows_shape
    h = load()

    def attention_launches(shape):
        with h.recording() as recorder:
            weights, ws, cache, inputs = h.step_objects("tiny", 16, 16)
            F.forward(weights, ws, cache, inputs, shape, all_logits=True, num_splits=2, stream=h._Stream())
        names = [launch[0] for launch in recorder.launches]
        return [n for n in names if n.startswith(("attention", "attn_input"))]

    decode = attention_launches(StepShape(num_tokens=16, num_seqs=16, max_q_len=1))
    assert decode and all(n.endswith("_fused") or n == "attention_combine" for n in decode), decode
    block = attention_launches(token_rows_shape(16))
    assert block.count("attn_input") == 2 and not any(n.endswith("_fused") for n in block), block
    assert block.index("attn_input") < min(i for i, n in enumerate(block) if n.startswith("attention_decode"))


# module.LATER_FILES, compiled after every other file of cuda_src/ (start_compiling), must hold no
# kernel that a short step launches: a prompt of up to 64 tokens in one sequence, a decode step of one sequence (its
# keys split or not), for the shapes kernel_units.FIRST is recorded for; a new route into one of those files fails
# here, not as a slower first token. The one route there: a gate/up product of 33-64 rows whose swap-AB grid is
# beyond a wave of blocks (routing.TMA_GATE_UP_ROWS; qwen3-4b and larger, whose weights take longer to load than
# a unit to compile) runs on gemm_tma.cu.
# (token rows, sequences, key splits): prompts of awkward and bucket sizes up to 64 rows, and decode steps of one
# sequence.
SHORT_STEPS = [(1, 1, 1), (1, 1, 33), (7, 1, 1), (16, 1, 1), (33, 1, 1), (50, 1, 1), (64, 1, 1)]


def kernel_units():
    """scripts/kernel_units.py, which writes kernel_units.FIRST from these recordings (it imports host_launches)."""
    if "kernel_units_script" not in sys.modules:
        load()
        spec = importlib.util.spec_from_file_location("kernel_units_script", SCRIPT.with_name("kernel_units.py"))
        sys.modules["kernel_units_script"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["kernel_units_script"])
    return sys.modules["kernel_units_script"]


@pytest.mark.parametrize("model", list(kernel_units().first_models()))
def test_short_steps_launch_no_kernel_of_a_file_compiled_later(model):
    h = load()
    config = kernel_units().first_models()[model]
    for step in SHORT_STEPS:
        files = h.step_kernels(config, *step)
        later = set(files) & set(LATER_FILES)
        if config.mlp == "gated_silu" and default_path(step[0], 2 * config.intermediate_size, config.hidden_size,
                                                       "silu_mul") == "gemm":
            assert later == {"gemm_tma.cu"} and any(n.endswith("_e2") for n in files["gemm_tma.cu"]), (step, files)
            later = set()
        assert "rmsnorm.cu" in files and not later, (step, files)
    assert "gemm_tma.cu" in h.step_kernels(config, 256, 1, 1)  # a longer prompt's products run there


def test_the_units_started_first_are_those_of_a_short_first_request():
    assert list(FIRST) == kernel_units().first_units(PART_OF), \
        "tileinfer/cuda/kernel_units.py's FIRST is out of date: run python3 scripts/kernel_units.py"
    assert "gemm_swap.cu:0" in FIRST and "sampling.cu" in FIRST and not any(u.startswith("gemm_tma") for u in FIRST)

