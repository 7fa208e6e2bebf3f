"""CudaError messages (no GPU needed: the error enums name themselves without a driver)."""
from __future__ import annotations

from cuda.bindings import driver

import pytest

from tileinfer.cuda.driver import CudaError, last_work


@pytest.fixture
def enqueued():
    """Pretend a kernel was launched last (restored afterwards)."""
    saved = last_work[0]

    def set_(what: str) -> None:
        last_work[0] = what
    yield set_
    last_work[0] = saved


def test_kernel_faults_name_the_last_work_enqueued(enqueued):
    enqueued("kernel embedding grid=(3, 1, 1) block=(128, 1, 1) smem=0")
    e = CudaError("cuStreamSynchronize", driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    assert str(e).startswith("cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS")
    assert "the last work enqueued before it: kernel embedding grid=(3, 1, 1)" in str(e)
    assert e.call_name == "cuStreamSynchronize" and e.code == driver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS


def test_other_errors_do_not_blame_a_kernel(enqueued):
    enqueued("kernel rmsnorm grid=(1, 1, 1) block=(256, 1, 1) smem=0")
    e = CudaError("cuMemAlloc", driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, "4096 bytes")
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(e) and "(4096 bytes)" in str(e)
    assert "rmsnorm" not in str(e)
