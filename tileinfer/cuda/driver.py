"""Checked CUDA driver calls, the device and its primary context.

Every `cuda.bindings` call returns `(err, *values)`. `call` is the one place that unwraps
that tuple: it raises `CudaError` naming the call and the driver's error string, so no
result is ever ignored and no error code leaks into the rest of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from cuda.bindings import driver, nvrtc


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call failed. `call` names it, `code` is the error enum.

    Errors a kernel causes (an illegal address, say) are reported by whatever call synchronises
    next, not by the launch; for those the message also names the last work enqueued (a kernel
    and its grid, or a graph), which is where to look first."""

    def __init__(self, call_name: str, code, detail: str = ""):
        self.call_name, self.code = call_name, code
        message = f"{call_name} failed: {_error_string(code)}"
        if detail:
            message += f" ({detail})"
        if _is_async_kernel_error(code) and last_work[0] is not None:
            message += f"; the last work enqueued before it: {last_work[0]}"
        super().__init__(message)


# What was enqueued last (set by Kernel.launch and Graph.launch, read only when an error is raised).
last_work: list = [None]

_ASYNC_KERNEL_ERRORS = {"CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_MISALIGNED_ADDRESS",
                        "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT",
                        "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_LAUNCH_TIMEOUT"}


def _is_async_kernel_error(code) -> bool:
    return getattr(code, "name", None) in _ASYNC_KERNEL_ERRORS


MIN_COMPUTE_CAPABILITY = (9, 0)  # the kernels use Hopper's TMA, wgmma and clusters
NO_GPU_MESSAGE = ("an NVIDIA GPU with compute capability 9.0 (Hopper) and its driver are needed; "
                  'device="cpu" (--device cpu on the command line) runs on the CPU, slowly')


class NoDeviceError(CudaError):
    """No usable CUDA device: no driver, no GPU, or one older than Hopper. Tests skip on it.

    Every entry point (load_model, LLM, the CLI) reports the same one line: NO_GPU_MESSAGE, then
    what was found in parentheses (`reason`, e.g. the driver's own error)."""

    def __init__(self, call_name: str, code, reason: str):
        self.call_name, self.code, self.reason = call_name, code, reason
        RuntimeError.__init__(self, f"{NO_GPU_MESSAGE} ({reason})")


def _short(text: str, limit: int = 120) -> str:
    """The first sentence of a library's message, on one line, at most `limit` characters."""
    first = " ".join(str(text).split()).split(". ", 1)[0].rstrip(".")
    return first if len(first) <= limit else first[:limit - 3] + "..."


def _error_string(code) -> str:
    try:
        if isinstance(code, driver.CUresult):
            err, name = driver.cuGetErrorName(code)
            err2, text = driver.cuGetErrorString(code)
            if err == driver.CUresult.CUDA_SUCCESS and err2 == driver.CUresult.CUDA_SUCCESS:
                return f"{name.decode()}: {text.decode()}"
        if isinstance(code, nvrtc.nvrtcResult):
            err, text = nvrtc.nvrtcGetErrorString(code)
            if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
                return text.decode()
    except Exception:  # no driver library to ask (the enum's name still says what happened)
        pass
    return getattr(code, "name", None) or str(code)


_SUCCESS = (driver.CUresult.CUDA_SUCCESS, nvrtc.nvrtcResult.NVRTC_SUCCESS)


def call(fn, *args, detail: str = ""):
    """Run one binding call; return its values (None, one value, or a tuple); raise on error."""
    err, *values = fn(*args)
    if err not in _SUCCESS:
        raise CudaError(fn.__name__, err, detail)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    num_sms: int
    total_memory: int
    max_shared_per_block_optin: int
    l2_bytes: int

    @property
    def arch(self) -> str:
        """The NVRTC target for this device's own architecture, e.g. 'sm_90'."""
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


def init_driver() -> None:
    """cuInit, the first call into the driver: NoDeviceError (not a traceback from the bindings) when
    there is no driver library or no GPU."""
    try:
        call(driver.cuInit, 0)
    except CudaError as e:
        raise NoDeviceError("cuInit", e.code, f"cuInit: {getattr(e.code, 'name', e.code)}") from None
    except Exception as e:  # cuda.pathfinder raises DynamicLibNotFoundError without a driver
        raise NoDeviceError("cuInit", type(e).__name__, f"{type(e).__name__}: {_short(e)}") from None


def device_handle(ordinal: int = 0):
    """The driver's handle of CUDA device `ordinal` (initialising the driver); NoDeviceError if absent."""
    init_driver()
    count = call(driver.cuDeviceGetCount)
    if not 0 <= ordinal < count:
        raise NoDeviceError("cuDeviceGet", driver.CUresult.CUDA_ERROR_NO_DEVICE,
                            f"CUDA device {ordinal} requested, {count} present")
    return call(driver.cuDeviceGet, ordinal)


class Device:
    """One GPU with its primary context made current on this thread."""

    def __init__(self, ordinal: int = 0):
        self.handle = device_handle(ordinal)
        self.info = self._read_info(ordinal)
        if self.info.compute_capability < MIN_COMPUTE_CAPABILITY:
            major, minor = self.info.compute_capability
            raise NoDeviceError("cuDeviceGetAttribute", driver.CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU,
                                f"GPU {ordinal} ({self.info.name}) has compute capability {major}.{minor}")
        self.context = call(driver.cuDevicePrimaryCtxRetain, self.handle)
        call(driver.cuCtxSetCurrent, self.context)

    def _attr(self, attr) -> int:
        return call(driver.cuDeviceGetAttribute, attr, self.handle)

    def _read_info(self, ordinal: int) -> DeviceInfo:
        A = driver.CUdevice_attribute
        name = call(driver.cuDeviceGetName, 256, self.handle)
        return DeviceInfo(
            ordinal=ordinal,
            name=name.split(b"\0", 1)[0].decode(),
            compute_capability=compute_capability(ordinal),
            num_sms=self._attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            total_memory=call(driver.cuDeviceTotalMem, self.handle),
            max_shared_per_block_optin=self._attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            l2_bytes=self._attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        )

    def synchronize(self) -> None:
        call(driver.cuCtxSynchronize)


def compute_capability(ordinal: int = 0) -> tuple[int, int]:
    """CUDA device `ordinal`'s compute capability, read without a context (what the kernels compile for can be
    known before the device opens); raises NoDeviceError without a GPU."""
    handle = device_handle(ordinal)
    A = driver.CUdevice_attribute
    return (call(driver.cuDeviceGetAttribute, A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle),
            call(driver.cuDeviceGetAttribute, A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle))


def pci_bus_id(ordinal: int = 0) -> str:
    """The PCI bus id of CUDA device `ordinal`, e.g. "0000:19:00.0": how NVML names the same GPU
    whatever CUDA_VISIBLE_DEVICES says. Creates no context; raises NoDeviceError without a GPU."""
    handle = device_handle(ordinal)
    raw = call(driver.cuDeviceGetPCIBusId, 32, handle)
    return (raw if isinstance(raw, (bytes, bytearray)) else str(raw).encode()).split(b"\0", 1)[0].decode()


@cache
def get_device(ordinal: int = 0) -> Device:
    """The process-wide Device for `ordinal` (created once; raises NoDeviceError without a GPU)."""
    return Device(ordinal)


def gpu_available() -> tuple[bool, str]:
    """(True, name) when a CUDA device can be used, else (False, why). Never raises."""
    try:
        dev = get_device()
    except NoDeviceError as e:
        return False, str(e)
    except Exception as e:  # anything else the bindings throw without a driver
        return False, f"{type(e).__name__}: {e}"
    return True, dev.info.name
