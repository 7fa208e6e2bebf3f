"""The memory-sizing utility: the seed's table, exact byte counts, what fits, and bad inputs."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tileinfer import cli, sizing_cli
from tileinfer.kv import sizing
from tileinfer.model.config import PRESETS, preset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """Make every test see "no GPU" (deterministic on the GPU machine too); tests that want one patch again."""
    def fail(device_index=0):
        raise RuntimeError("NVML could not start: NVML Shared Library Not Found (test)")
    monkeypatch.setattr(sizing, "nvml_memory", fail)


def run_size(capsys, *argv) -> tuple[int, str, str]:
    rc = sizing_cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def table(out: str) -> dict[str, dict[str, str]]:
    """{'BF16': {column header: cell}, 'INT8': {...}} from the printed table (columns 2+ spaces apart)."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] in ("KV cache", "BF16", "INT8"):
            rows[cells[0]] = cells
    header = rows["KV cache"]
    assert len(rows["BF16"]) == len(rows["INT8"]) == len(header), out
    return {name: dict(zip(header, rows[name])) for name in ("BF16", "INT8")}


# ---------------------------------------------------------------------------- the seed's table

SEED_TABLE = [  # model, per position BF16, per position INT8, 4,096 positions BF16, 32,768 positions BF16
    ("qwen3-0.6b", "112 KiB", "58 KiB", "0.47 GB", "3.8 GB"),
    ("qwen3-4b", "144 KiB", "74 KiB", "0.60 GB", "4.8 GB"),
]


@pytest.mark.parametrize("model, bf16, int8, at_4k, at_32k", SEED_TABLE)
def test_table_reproduces_the_seed(capsys, model, bf16, int8, at_4k, at_32k):
    rc, out, err = run_size(capsys, model)
    assert rc == 0, err
    rows = table(out)
    assert rows["BF16"]["per position"] == bf16
    assert rows["INT8"]["per position"] == int8
    assert rows["BF16"]["4,096 positions"] == at_4k
    assert rows["BF16"]["32,768 positions"] == at_32k


@pytest.mark.parametrize("model, layers, bf16, int8", [
    ("qwen3-0.6b", 28, 114_688, 59_136),    # 112 KiB, 57.75 KiB
    ("qwen3-4b", 36, 147_456, 76_032),      # 144 KiB, 74.25 KiB
    ("qwen3-8b", 36, 147_456, 76_032),
    ("apertus-8b", 32, 131_072, 67_584),    # 128 KiB, 66 KiB
    ("apertus-70b", 80, 327_680, 168_960),  # 320 KiB, 165 KiB
])
def test_exact_bytes_per_position_and_page(model, layers, bf16, int8):
    cfg = preset(model)
    assert cfg.num_hidden_layers == layers
    assert sizing.bytes_per_position(cfg, "bf16") == bf16 == 2 * layers * 8 * 128 * 2
    assert sizing.bytes_per_position(cfg, "int8") == int8 == 2 * layers * 8 * (128 + 4)
    assert sizing.bytes_per_page(cfg, 64, "bf16") == 64 * bf16
    assert sizing.bytes_per_page(cfg, 16, "int8") == 16 * int8
    assert sizing.cache_bytes(cfg, 4096) == 4096 * bf16
    assert sizing.cache_bytes(cfg, 32768, kv_dtype="int8") == 32768 * int8


def test_tileinfer_size_apertus_8b(capsys):
    from tileinfer import cli
    rc = cli.main(["size", "apertus-8b"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith("apertus-8b (preset): 32 layers, 8 KV heads of 128, page size 64")
    rows = table(out)
    assert rows["BF16"]["per position"] == "128 KiB" and rows["INT8"]["per position"] == "66 KiB"
    assert rows["BF16"]["4,096 positions"] == "0.54 GB" and rows["INT8"]["32,768 positions"] == "2.2 GB"
    assert "weights: 16 GB (8.05 B parameters in bf16)" in out   # untied head, two MLP matrices a layer


def test_cache_is_whole_pages():
    cfg = preset("qwen3-0.6b")
    page = 64 * 114_688
    assert sizing.cache_bytes(cfg, 1) == page
    assert sizing.cache_bytes(cfg, 64) == page
    assert sizing.cache_bytes(cfg, 65) == 2 * page
    assert sizing.cache_bytes(cfg, 65, page_size=16) == 5 * 16 * 114_688


def test_weight_bytes_count_a_tied_embedding_once():
    tied, untied = preset("qwen3-4b"), preset("qwen3-8b")
    assert sizing.weight_bytes(tied) == 2 * tied.num_parameters() == 8_044_936_192
    assert sizing.weight_bytes(untied) == 2 * 8_190_735_360  # the 8B's LM head is its own matrix
    embedding = 151_936 * 4096
    per_layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    assert untied.num_parameters() == 2 * embedding + 36 * per_layer + 4096


def test_rounding_as_the_seed_rounds():
    assert sizing_cli.format_kib(59_136) == "58 KiB"    # 57.75
    assert sizing_cli.format_kib(76_032) == "74 KiB"    # 74.25
    assert sizing_cli.format_kib(1536) == "2 KiB"       # halves round up
    assert sizing_cli.format_kib(7_340_032) == "7,168 KiB"
    assert sizing_cli.format_gb(469_762_048) == "0.47 GB"
    assert sizing_cli.format_gb(603_979_776) == "0.60 GB"   # the trailing zero stays
    assert sizing_cli.format_gb(3_758_096_384) == "3.8 GB"
    assert sizing_cli.format_gb(16_381_470_720) == "16 GB"
    assert sizing_cli.format_gb(9_960_000_000) == "10 GB"
    assert sizing_cli.format_gb(141_000_000_000) == "141 GB"
    assert sizing_cli.format_gb(0) == "0 GB"


# ---------------------------------------------------------------------------- what fits

# Qwen3-8B on 141 GB at 0.9, worked by hand: 126.9e9 usable - 16,381,470,720 B of weights - 1e9 reserve.
BUDGET_8B = 126_900_000_000 - 16_381_470_720 - 1_000_000_000     # 109,518,529,280 B
BF16_PAGE_8B, INT8_PAGE_8B = 64 * 147_456, 64 * 76_032              # 9,437,184 and 4,866,048 B
BF16_PAGES_8B, INT8_PAGES_8B = 11_605, 22_506                       # floor(budget / page)


def test_hand_computation_agrees():
    assert BUDGET_8B // BF16_PAGE_8B == BF16_PAGES_8B
    assert BUDGET_8B // INT8_PAGE_8B == INT8_PAGES_8B


def test_fit_on_141_gb_for_qwen3_8b(capsys):
    rc, out, err = run_size(capsys, "qwen3-8b", "--gpu-memory", "141", "--utilization", "0.9", "--reserve-gb", "1")
    assert rc == 0, err
    rows = table(out)
    assert rows["BF16"]["positions that fit"] == f"{BF16_PAGES_8B * 64:,}" == "742,720"
    assert rows["BF16"]["seqs of 4,096"] == str(BF16_PAGES_8B // 64) == "181"
    assert rows["BF16"]["seqs of 32,768"] == str(BF16_PAGES_8B // 512) == "22"
    assert rows["INT8"]["positions that fit"] == "1,440,384"
    assert rows["INT8"]["seqs of 4,096"] == "351"
    assert rows["INT8"]["seqs of 32,768"] == "43"
    assert "110 GB for the cache" in out


def test_json_has_the_numbers(capsys):
    rc, out, err = run_size(capsys, "qwen3-8b", "--gpu-memory", "141", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["weight_bytes"] == 16_381_470_720
    assert report["kv"]["bf16"]["bytes_per_position"] == 147_456
    assert report["kv"]["int8"]["bytes_per_page"] == INT8_PAGE_8B
    assert report["kv"]["bf16"]["cache_bytes"] == {"4096": 4096 * 147_456, "32768": 32768 * 147_456}
    fit = report["fit"]
    assert fit["total_bytes"] == 141_000_000_000 and fit["used_bytes"] == 0
    assert fit["reserve_bytes"] == sizing.DEFAULT_RESERVE_BYTES == 1_000_000_000
    assert fit["cache_budget_bytes"] == BUDGET_8B
    assert fit["bf16"] == {"pages": BF16_PAGES_8B, "positions": BF16_PAGES_8B * 64,
                           "sequences": {"4096": 181, "32768": 22}}
    assert fit["int8"]["pages"] == INT8_PAGES_8B
    assert report["fit_note"] is None


def test_nvml_memory_in_use_is_subtracted(capsys, monkeypatch):
    # A 150 GB GPU with 10 GB taken by others: 0.9 x 150 - 10 = 125 GB usable.
    monkeypatch.setattr(sizing, "nvml_memory", lambda device_index=0: (140_000_000_000, 150_000_000_000,
                                                                       10_000_000_000))
    rc, out, err = run_size(capsys, "qwen3-0.6b", "--json", "--reserve-gb", "0")
    assert rc == 0, err
    fit = json.loads(out)["fit"]
    assert fit["memory_source"] == "GPU 0 (NVML)"
    assert fit["usable_bytes"] == 125_000_000_000
    budget = 125_000_000_000 - 2 * 596_049_920
    assert fit["cache_budget_bytes"] == budget
    assert fit["bf16"]["pages"] == budget // (64 * 114_688)


def test_plan_and_pages_that_fit():
    cfg = preset("qwen3-0.6b")
    page = 64 * 114_688
    assert sizing.pages_that_fit(10 * page + 5, 5, cfg) == 10
    assert sizing.pages_that_fit(10 * page + 4, 5, cfg) == 9
    assert sizing.pages_that_fit(100, 1000, cfg) == 0               # clamped, never negative
    p = sizing.plan(cfg, 10_000_000_000, used_bytes=0, utilization=1.0, reserve_bytes=0, weights=0,
                    contexts=[64, 65])
    assert p.pages == 10_000_000_000 // page and p.positions == p.pages * 64
    assert p.sequences == {64: p.pages, 65: p.pages // 2}
    # Weights already loaded are in `used`; weights=0 then avoids counting them twice.
    loaded = sizing.plan(cfg, 10_000_000_000, used_bytes=sizing.weight_bytes(cfg), reserve_bytes=0, weights=0)
    fresh = sizing.plan(cfg, 10_000_000_000, used_bytes=0, reserve_bytes=0)
    assert loaded.pages == fresh.pages
    assert sizing.plan(cfg, 1_000_000_000).pages == 0               # the weights alone exceed 0.9 GB


def test_no_gpu_still_prints_the_sizes(capsys):
    rc, out, err = run_size(capsys, "qwen3-4b")
    assert rc == 0 and "Traceback" not in out + err
    rows = table(out)
    assert rows["BF16"]["per position"] == "144 KiB" and "positions that fit" not in rows["BF16"]
    assert "--gpu-memory" in out and "NVML could not start" in out
    assert "weights: 8.0 GB" in out
    rc, out, _ = run_size(capsys, "qwen3-4b", "--json")
    report = json.loads(out)
    assert report["fit"] is None and "--gpu-memory" in report["fit_note"]


def test_nvml_without_a_gpu_raises_runtime_error(monkeypatch):
    monkeypatch.undo()   # the real reader
    try:
        free, total, used = sizing.nvml_memory()
    except RuntimeError as e:
        assert "NVML" in str(e)
    else:
        assert 0 <= used <= total and free + used == total


# ---------------------------------------------------------------------------- models from files

def test_checkpoint_directory(capsys, tiny_checkpoint):
    rc, out, err = run_size(capsys, str(tiny_checkpoint), "--json", "--gpu-memory", "1")
    assert rc == 0, err
    report = json.loads(out)
    tiny = PRESETS["tiny"]
    assert report["source"] == "checkpoint"
    assert report["kv"]["bf16"]["bytes_per_position"] == 2 * 2 * 2 * 128 * 2
    assert report["weight_bytes"] == 2 * tiny.num_parameters()


def test_directory_without_weights_points_to_config_json(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset("qwen3-4b").to_hf_dict()))
    err = one_line_error(capsys, str(tmp_path))
    assert "no weights" in err and "give its config.json" in err


def test_bare_config_json(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(preset("qwen3-4b").to_hf_dict()))
    rc, out, err = run_size(capsys, str(path))
    assert rc == 0, err
    assert "(config.json)" in out
    assert table(out)["INT8"]["per position"] == "74 KiB"


# ---------------------------------------------------------------------------- bad inputs

def one_line_error(capsys, *argv, main=sizing_cli.main) -> str:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_unknown_preset(capsys):
    err = one_line_error(capsys, "qwen3-70b")
    assert "unknown preset 'qwen3-70b'" in err and "qwen3-4b" in err and "config.json" in err


def test_missing_path(capsys, tmp_path):
    err = one_line_error(capsys, str(tmp_path / "nowhere" / "config.json"))
    assert "no such file or directory" in err


def test_config_missing_fields(capsys, tmp_path):
    raw = preset("qwen3-4b").to_hf_dict()
    del raw["num_hidden_layers"], raw["num_key_value_heads"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    err = one_line_error(capsys, str(path))
    assert "missing required field(s) num_hidden_layers, num_key_value_heads" in err


@pytest.mark.parametrize("argv, problem", [
    (["--context=-4096"], "--context: context lengths must be positive, got -4096"),
    (["--context", "0"], "--context: context lengths must be positive, got 0"),
    (["--context", "4096,lots"], "--context: 'lots' is not a whole number"),
    (["--utilization", "0"], "--utilization must be in (0, 1]"),
    (["--utilization", "1.5"], "--utilization must be in (0, 1]"),
    (["--gpu-memory", "-80"], "--gpu-memory must be a positive number of GB, got -80"),
    (["--reserve-gb", "-1"], "--reserve-gb must be a non-negative number of GB"),
    (["--page-size", "0"], "--page-size must be a positive number"),
])
def test_bad_arguments(capsys, argv, problem):
    assert problem in one_line_error(capsys, "qwen3-4b", *argv)


def test_library_validation_names_the_argument():
    cfg = preset("qwen3-0.6b")
    with pytest.raises(ValueError, match="kv_dtype must be one of bf16, int8, got 'fp8'"):
        sizing.bytes_per_position(cfg, "fp8")
    with pytest.raises(ValueError, match="positions must be a positive integer, got -1"):
        sizing.cache_bytes(cfg, -1)
    with pytest.raises(ValueError, match="context must be a positive integer, got 0"):
        sizing.sequences_that_fit(10, 0)
    for u in (0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"utilization must be in \(0, 1\]"):
            sizing.plan(cfg, 10**10, utilization=u)
    with pytest.raises(ValueError, match="total_bytes must be a positive integer"):
        sizing.plan(cfg, -5)
    with pytest.raises(ValueError, match="used_bytes must be a non-negative"):
        sizing.plan(cfg, 10**10, used_bytes=-1)
    with pytest.raises(ValueError, match="reserve_bytes must be a non-negative"):
        sizing.pages_that_fit(10**10, -1, cfg)
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        sizing.bytes_per_page(cfg, 0)


# ---------------------------------------------------------------------------- the two front doors

def test_tileinfer_size_is_the_same_command(capsys):
    argv = ["qwen3-4b", "--gpu-memory", "141", "--context", "4096,32768,131072"]
    assert sizing_cli.main(argv) == 0
    direct = capsys.readouterr().out
    assert cli.main(["size", *argv]) == 0
    assert capsys.readouterr().out == direct
    assert "131,072 positions" in direct


def test_tileinfer_size_errors_are_one_line(capsys):
    err = one_line_error(capsys, "size", "nope", main=cli.main)
    assert err.startswith("tileinfer: error: unknown preset 'nope'")
    err = one_line_error(capsys, "size", "qwen3-4b", "--utilization", "1.5", main=cli.main)
    assert "--utilization must be in (0, 1]" in err


def test_generate_subcommand_still_needs_a_prompt(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate"])                        # --model is optional (a synthetic default), --prompt is not
    assert exit_info.value.code == 2
    assert "--prompt" in capsys.readouterr().err


def test_script_runs(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "kv_sizing.py"), "qwen3-0.6b",
                             "--gpu-memory", "80", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["kv"]["int8"]["bytes_per_position"] == 59_136
    assert report["fit"]["bf16"]["positions"] > 0
