"""A new user's first contact: `tileinfer --version`, `python -m tileinfer`, the CLI's checks of its
arguments and checkpoints (made before the GPU is touched), and the one no-GPU message that
load_model, LLM, the driver helpers and the CLI all give on a machine without a GPU."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tileinfer
from tileinfer import cli
from tileinfer.cuda import driver as cuda_driver
from tileinfer.cuda import NoDeviceError, get_device, gpu_available, pci_bus_id
from tileinfer.model.config import Qwen3Config
from tileinfer.model.safetensors_io import SafetensorsFile, write_safetensors
from tileinfer.model.synthetic import write_checkpoint

NO_GPU_START = "an NVIDIA GPU with compute capability 9.0 (Hopper) and its driver are needed; "
HAVE_GPU, GPU_WHY = gpu_available()
needs_no_gpu = pytest.mark.skipif(HAVE_GPU, reason=f"a GPU is present ({GPU_WHY}): the no-GPU message cannot be seen")

MICRO = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A valid (tiny, random) checkpoint directory."""
    out = tmp_path_factory.mktemp("micro")
    write_checkpoint(MICRO, out, seed=1, progress=False)
    return out


@pytest.fixture
def no_gpu_calls(monkeypatch):
    """Fail the test if the CLI reaches for the GPU or loads a model; records load_model's arguments."""
    loads = []

    def touched(*args, **kwargs):
        raise AssertionError("the CLI touched the GPU before checking its arguments")

    def fake_load_model(path, **kwargs):
        loads.append((path, kwargs))
        raise RuntimeError("fake load_model called")
    monkeypatch.setattr("tileinfer.cuda.get_device", touched)
    monkeypatch.setattr("tileinfer.cuda.module.start_compiling", touched)
    monkeypatch.setattr(tileinfer, "load_model", fake_load_model)
    return loads


def run_cli(capsys, *argv) -> tuple[int, str]:
    """(exit status, stderr) of the CLI; stderr must be one line starting 'tileinfer: error: '."""
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tileinfer: error: "), err
    return rc, err


# ---------------------------------------------------------------------------- version

def test_version_is_read_from_one_place(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"tileinfer {tileinfer.__version__}\n"
    assert importlib.metadata.version("tileinfer") == tileinfer.__version__  # pyproject.toml reads __version__


def test_python_dash_m_is_the_same_cli():
    result = subprocess.run([sys.executable, "-m", "tileinfer", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"tileinfer {tileinfer.__version__}\n"


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"], ["size", "qwen3-4b"], ["serve"]])
def test_an_unknown_option_is_named_by_its_command(capsys, command):
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--bogus", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"tileinfer {command[0]}: error: unrecognized arguments: --bogus 1 "
                                         f"(see tileinfer {command[0]} --help)\n"), err


# ---------------------------------------------------------------------------- checks before the GPU

@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "--temperature: temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature: temperature must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p: top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p: top_p must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k: top_k must be an integer >= 1, or 0 / -1 for off"),
    (["--max-new-tokens", "0"], "--max-new-tokens: max_tokens must be an integer >= 1, got 0"),
    (["--seed", "-1"], "--seed: seed must be None or an integer in [0, 2**64)"),
    (["--max-context", "0"], "--max-context must be an integer >= 1, got 0"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens must be an integer >= 1, got 0"),
    (["--model", "/nonexistent/dir"], "--model /nonexistent/dir: no such checkpoint directory"),
    (["--draft-model", "/nonexistent/dir"], "--draft-model /nonexistent/dir: no such checkpoint directory"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an integer >= 1, got 0"),
])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_bad_arguments_get_their_own_error(capsys, no_gpu_calls, command, argv, message, device):
    prompt = ["--prompt", "hi"] if command == "generate" else []
    rc, err = run_cli(capsys, command, *prompt, "--device", device, *argv)
    assert rc == 1 and message in err, err
    assert not no_gpu_calls


@pytest.mark.parametrize("option", ["--model", "--draft-model"])
def test_malformed_checkpoints_are_named_before_the_gpu(capsys, no_gpu_calls, tmp_path, micro, option):
    def expect(directory, message):
        rc, err = run_cli(capsys, "generate", "--prompt", "hi", option, str(directory))
        assert rc == 1 and err.startswith(f"tileinfer: error: {option}: ") and message in err, err

    empty = tmp_path / "empty"
    empty.mkdir()
    expect(empty, "config.json: no such file")

    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    expect(bad_json, "config.json: not valid JSON")

    missing = tmp_path / "missing-tensor"
    write_checkpoint(MICRO, missing, seed=1, progress=False)
    file = SafetensorsFile(missing / "model.safetensors")
    tensors = {name: np.array(file.read(name)) for name in file.tensors if name != "model.norm.weight"}
    del file
    write_safetensors(missing / "model.safetensors", tensors)
    expect(missing, "missing tensor 'model.norm.weight'")
    assert not no_gpu_calls


def test_sampling_is_checked_before_the_checkpoint(capsys, no_gpu_calls, tmp_path):
    rc, err = run_cli(capsys, "generate", "--prompt", "hi", "--top-p", "0", "--model", str(tmp_path))
    assert rc == 1 and "--top-p" in err, err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_device_cpu_is_passed_through_without_asking_for_a_gpu(capsys, no_gpu_calls, micro, command):
    prompt = ["--prompt", "hi"] if command == "generate" else []
    rc, err = run_cli(capsys, command, *prompt, "--device", "cpu", "--model", str(micro))
    assert rc == 1 and "fake load_model called" in err, err
    assert no_gpu_calls == [(micro, {"device": "cpu", "progress": True})]


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu"], "--tensor-parallel-size > 1 splits a model over GPUs; the CPU runner runs it whole"),
    (["--draft-model", "DRAFT"], "speculative decoding (--draft-model) is not supported with --tensor-parallel-size > 1"),
])
def test_tensor_parallel_generate_and_chat_check_their_options_first(capsys, no_gpu_calls, micro, command, argv,
                                                                     message):
    prompt = ["--prompt", "hi"] if command == "generate" else []
    argv = [str(micro) if a == "DRAFT" else a for a in argv]
    rc, err = run_cli(capsys, command, *prompt, "--model", str(micro), "--tensor-parallel-size", "2", *argv)
    assert rc == 1 and message in err, err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_start_compiling_before_the_model_loads(capsys, monkeypatch, micro, command):
    """On one GPU the kernels the cache lacks start compiling at the device check, so that they compile beside the
    checkpoint's and weights' loads (each file loads at its first use, once its compile is done)."""
    calls = []
    monkeypatch.setattr("tileinfer.cuda.module.start_compiling", lambda *a, **k: calls.append(("compile", a, k)))
    monkeypatch.setattr("tileinfer.cuda.get_device", lambda *a, **k: calls.append(("device",)))

    def fake_load_model(path, **kwargs):
        calls.append(("load", path))
        raise RuntimeError("fake load_model")
    monkeypatch.setattr(tileinfer, "load_model", fake_load_model)
    prompt = ["--prompt", "hi"] if command == "generate" else []
    rc, err = run_cli(capsys, command, *prompt, "--model", str(micro))
    assert rc == 1 and "fake load_model" in err, err
    assert calls == [("compile", (0,), dict(progress=True)), ("device",), ("load", micro)], calls


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_tensor_parallel_generate_and_chat_run_an_llm_over_the_gpus(capsys, monkeypatch, micro, command):
    """With --tensor-parallel-size N > 1, generate and chat make an LLM over N GPUs (what it runs the one request
    with: generate() and ChatSession take an idle LLM), with --max-context and --kv-int8 as its options."""
    made = []

    def fake_llm(path, **options):
        made.append((path, options))
        raise RuntimeError("fake LLM")
    monkeypatch.setattr("tileinfer.cuda.get_device", lambda *a, **k: None)
    monkeypatch.setattr(tileinfer, "LLM", fake_llm)
    prompt = ["--prompt", "hi"] if command == "generate" else []
    rc, err = run_cli(capsys, command, *prompt, "--model", str(micro), "--tensor-parallel-size", "4", "--kv-int8",
                      "--max-context", "1000")
    assert rc == 1 and "fake LLM" in err, err
    assert made == [(micro, dict(tensor_parallel_size=4, max_num_seqs=1, max_context=1000, kv_quantize="int8",
                                 progress=True))]


@pytest.mark.parametrize("argv, message", [
    (["--page-size", "0"], "--page-size must be an integer >= 1, got 0"),
    (["--num-pages", "0"], "--num-pages must be an integer >= 1, got 0"),
    (["--max-num-batched-tokens", "-4"], "--max-num-batched-tokens must be an integer >= 1, got -4"),
    (["--max-waiting", "0"], "--max-waiting must be an integer >= 1, got 0"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens must be an integer >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: utilization must be in (0, 1]"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds >= 0, got -1.0"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout must be a number of seconds >= 0, got inf"),
    (["--draft-model", "/nonexistent/dir"], "--draft-model /nonexistent/dir: no such checkpoint directory"),
])
def test_serve_checks_its_engine_options_before_the_gpu(capsys, no_gpu_calls, micro, argv, message):
    rc, err = run_cli(capsys, "serve", "--model", str(micro), *argv)
    assert rc == 1 and message in err, err


def test_serve_passes_its_engine_options_to_the_llm(capsys, monkeypatch, micro):
    """The engine process makes tileinfer.LLM(model, **options) of the options EngineClient is given."""
    from tileinfer.server.engine_client import EngineClient
    made = []

    def fake_start(self):
        made.append((Path(self.model), self.options))
        raise RuntimeError("fake engine start")
    monkeypatch.setattr(EngineClient, "start", fake_start)
    rc, err = run_cli(capsys, "serve", "--device", "cpu", "--model", str(micro), "--page-size", "16",
                      "--num-pages", "80", "--no-prefix-caching", "--max-num-batched-tokens", "256",
                      "--gpu-memory-utilization", "0.5", "--draft-model", str(micro), "--num-draft-tokens", "3",
                      "--kv-int8", "--max-context", "1024")
    assert rc == 1 and "fake engine start" in err, err
    assert made == [(micro, dict(device="cpu", max_num_seqs=8, max_context=1024, page_size=16,
                                      enable_prefix_caching=False, max_num_batched_tokens=256,
                                      gpu_memory_utilization=0.5, num_pages=80, kv_quantize="int8", batch_invariant=False,
                                      draft_model=str(micro), num_draft_tokens=3, load_format="auto",
                                      tensor_parallel_size=1, tensor_parallel_address=None, progress=True))]
    tileinfer.config.EngineConfig(model=micro, **made[0][1])  # every one is a field


def test_device_is_cuda_or_cpu(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "--prompt", "x"]).device == "cuda"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["chat", "--device", "tpu"])
    assert e.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- one no-GPU message

@needs_no_gpu
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"]])
def test_cli_without_a_gpu_says_what_is_needed(capsys, micro, command):
    rc, err = run_cli(capsys, *command, "--model", str(micro))
    assert rc == 1 and err.startswith(f"tileinfer: error: {NO_GPU_START}"), err
    assert 'device="cpu" (--device cpu on the command line) runs on the CPU, slowly' in err


@needs_no_gpu
@pytest.mark.parametrize("entry", ["load_model", "LLM", "get_device", "pci_bus_id"])
def test_every_entry_point_gives_the_same_no_gpu_error(tiny_checkpoint, entry):
    calls = {"load_model": lambda: tileinfer.load_model(tiny_checkpoint, progress=False),
             "LLM": lambda: tileinfer.LLM(tiny_checkpoint, progress=False),
             "get_device": get_device, "pci_bus_id": pci_bus_id}
    with pytest.raises(NoDeviceError) as caught:
        calls[entry]()
    message = str(caught.value)
    assert message.startswith(NO_GPU_START) and "\n" not in message, message
    assert message == cuda_driver.NO_GPU_MESSAGE + f" ({caught.value.reason})"
    assert 0 < len(caught.value.reason) <= 160, caught.value.reason  # the driver's own reason, kept short
    assert gpu_available() == (False, message)


def test_a_gpu_older_than_hopper_is_refused(monkeypatch):
    info = cuda_driver.DeviceInfo(ordinal=0, name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0), num_sms=108,
                                  total_memory=80 << 30, max_shared_per_block_optin=166912, l2_bytes=40 << 20)
    monkeypatch.setattr(cuda_driver, "device_handle", lambda ordinal: "handle")
    monkeypatch.setattr(cuda_driver.Device, "_read_info", lambda self, ordinal: info)
    with pytest.raises(NoDeviceError) as caught:
        cuda_driver.Device(0)
    assert str(caught.value) == (cuda_driver.NO_GPU_MESSAGE +
                                 " (GPU 0 (NVIDIA A100-SXM4-80GB) has compute capability 8.0)")


def test_generate_says_when_it_waits_at_its_exit_for_compiles_a_later_run_needs(capsys, monkeypatch):
    """A first run's start_compiling may still be compiling kernels the run did not launch when its output ends: the
    process waits for them at its exit (the next run finds them cached), and says so rather than seem to hang."""
    from tileinfer.cuda import compiler
    argv = ["generate", "--device", "cpu", "--prompt", "Hello", "--max-new-tokens", "2"]  # the demo model
    assert cli.main(argv) == 0
    assert "kernel compiles" not in capsys.readouterr().err
    monkeypatch.setattr(compiler, "_in_flight", {"a": None, "b": None})
    assert cli.main(argv) == 0
    assert capsys.readouterr().err.splitlines()[-1] == \
        "tileinfer: finishing 2 kernel compiles for later runs (once; then cached)"


def test_compile_fills_the_kernel_cache_without_a_gpu_and_then_compiles_nothing(capsys, monkeypatch, tmp_path):
    """`tileinfer compile` compiles every unit of cuda_src/ (here two small files) into the kernel cache, as a first
    start on a GPU would; a second run finds them cached. Without a GPU it compiles for sm_90a and says so."""
    from tileinfer.cuda import compiler
    from tileinfer.cuda.driver import NoDeviceError
    src = tmp_path / "src"
    src.mkdir()
    for name in ("one.cu", "two.cu"):
        (src / name).write_text(f'extern "C" __global__ void {name[:3]}(float *x) {{ x[threadIdx.x] = 1.0f; }}\n')
    monkeypatch.setenv("TILEINFER_CUDA_SRC", str(src))
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compiler, "_memory_cache", {})
    monkeypatch.setattr(compiler, "STATS", compiler.CompileStats())

    def no_gpu(ordinal=0):
        raise NoDeviceError("no CUDA device")
    monkeypatch.setattr("tileinfer.cuda.driver.compute_capability", no_gpu)
    assert cli.main(["compile"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "tileinfer: no GPU here: compiling for sm_90a (an H100 or H200); --arch chooses another", err
    assert err[-1] == f"tileinfer: 2 kernel units for sm_90a in {tmp_path / 'cache' / 'kernels'}: 2 compiled now, " \
                      "0 cached already", err
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "kernels").glob("*.cubin")) == ["one", "two"]
    compiler._memory_cache.clear()  # as a new process
    assert cli.main(["compile", "--arch", "sm_90a"]) == 0
    assert capsys.readouterr().err.splitlines()[-1].endswith(": 0 compiled now, 2 cached already")
    rc, err = run_cli(capsys, "compile", "--arch", "sm_80")
    assert rc == 1 and "--arch must name a GPU arch of sm_90 or newer" in err and "'sm_80'" in err, err
