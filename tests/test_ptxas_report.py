"""scripts/ptxas_report.py: the assembler's verbose log read into entry points (registers, stack frame, spills,
performance notes given to the function they name), and a real compile of a small kernel file. CPU only (NVRTC)."""
import importlib.util
import sys
from pathlib import Path

from tileinfer.cuda.compiler import compile_file
from tileinfer.cuda.module import entry_points

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ptxas_report.py"
spec = importlib.util.spec_from_file_location("ptxas_report", SCRIPT)
R = sys.modules["ptxas_report"] = importlib.util.module_from_spec(spec)  # (dataclasses look their module up)
spec.loader.exec_module(R)

# Lines as NVRTC 13.5 writes them with --ptxas-options=-v (gemm_tma.cu part 1 and gemv.cu), trimmed.
LOG = """ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma \
instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function \
'gemm_tma_s2_e4' in line 12983
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gemm_tma_s2_e4' for 'sm_90a'
ptxas info    : Function properties for gemm_tma_s2_e4
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers
ptxas info    : Compile time = 912.3 ms
ptxas info    : Compiling entry function 'gemv_m4_e0' for 'sm_90a'
ptxas info    : Function properties for gemv_m4_e0
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 256 bytes smem
ptxas info    : Compiling entry function 'gemv_m1_e0' for 'sm_90a'
ptxas info    : Function properties for gemv_m1_e0
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem
"""


def test_the_log_is_read_into_entry_points_with_their_notes():
    entries = {e.name: e for e in R.parse_log("x.cu", LOG)}
    assert list(entries) == ["gemm_tma_s2_e4", "gemv_m4_e0", "gemv_m1_e0"]
    wide = entries["gemm_tma_s2_e4"]
    assert (wide.registers, wide.stack, wide.spill_stores, wide.smem) == (168, 0, 0, 0)
    assert len(wide.notes) == 1 and wide.notes[0].startswith("C7515: Potential Performance Loss: wgmma.mma_async")
    assert "in the function" not in wide.notes[0] and wide.notable
    m4 = entries["gemv_m4_e0"]
    assert (m4.registers, m4.stack, m4.spill_stores, m4.spill_loads, m4.smem) == (80, 8, 4, 4, 256) and m4.notable
    assert not entries["gemv_m1_e0"].notable
    table = R.render(list(entries.values()), everything=False)
    assert "gemv_m1_e0" not in table and "| x.cu | gemv_m4_e0 | 80 | 8 | 4 / 4 | 256 | - |" in table
    assert "3 entry points" in table and "1 with spills, 1 with a stack frame, 1 with a performance note" in table


def test_a_real_compile_reports_every_entry_point(capsys):
    assert R.main(["--files", "attention_combine.cu", "--all"]) == 0
    out = capsys.readouterr().out
    names = entry_points(compile_file("attention_combine.cu", "sm_90a"))
    rows = [line for line in out.splitlines() if line.startswith("| attention_combine.cu |")]
    assert sorted(line.split(" | ")[1] for line in rows) == sorted(names)
    assert all(int(line.split(" | ")[2]) > 0 for line in rows)  # registers
