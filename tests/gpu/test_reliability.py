"""Reliability on the GPU: engines leave no device memory behind, and a kernel fault surfaces as a
CudaError naming the kernel (in a child process: a faulted CUDA context cannot be used again)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tileinfer import LLM, SamplingParams
from tileinfer.cuda import pci_bus_id
from tileinfer.kv import sizing

pytestmark = pytest.mark.gpu


def test_twenty_engines_leave_nvml_free_memory_where_it_started(tiny_checkpoint):
    bus = pci_bus_id(0)

    def run_one():
        with LLM(tiny_checkpoint, max_num_seqs=8, max_context=512, num_pages=32, progress=False) as llm:
            out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            assert len(out[0].token_ids) == 4

    run_one()  # loads every kernel module once: they stay loaded for the process, by design
    free0, total, _ = sizing.nvml_memory(pci_bus_id=bus)
    for _ in range(20):
        run_one()
    free1, _, _ = sizing.nvml_memory(pci_bus_id=bus)
    print(f"NVML free before {free0 / 2**30:.3f} GiB, after 20 engines {free1 / 2**30:.3f} GiB")
    assert abs(free1 - free0) <= 0.01 * total


def test_an_illegal_address_names_the_kernel():
    script = textwrap.dedent("""
        import numpy as np
        from tileinfer.cuda import CudaError, DeviceArray, Stream, get_device
        from tileinfer.kernels import embedding
        get_device()
        s = Stream()
        tokens = DeviceArray.from_host(np.array([5, 6, 7], np.int32))
        import ml_dtypes
        table = DeviceArray((1 << 20, 1024), ml_dtypes.bfloat16, ptr=16)  # an address nothing is mapped at
        out = DeviceArray((3, 1024), np.float32)
        try:
            embedding(tokens, table, out, s)
            s.synchronize()
        except CudaError as e:
            print("CAUGHT", e)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    print(proc.stdout, proc.stderr[-2000:])
    assert "CAUGHT" in proc.stdout
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in proc.stdout and "kernel embedding" in proc.stdout
