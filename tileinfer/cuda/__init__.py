"""The CUDA driver-API runtime: checked calls, device/context, memory, streams, NVRTC, launches."""
from .compiler import CompileError, compile_file, compile_source
from .driver import CudaError, Device, NoDeviceError, call, get_device, gpu_available, pci_bus_id
from .memory import DeviceArray, PinnedBuffer, allocated_bytes
from .module import F32, I32, I64, U32, U64, Kernel, Module, kernel, load_module
from .stream import Event, Graph, Stream

__all__ = [
    "CompileError", "compile_file", "compile_source", "CudaError", "Device", "NoDeviceError", "call",
    "get_device", "gpu_available", "pci_bus_id", "DeviceArray", "PinnedBuffer", "allocated_bytes",
    "F32", "I32", "I64", "U32", "U64",
    "Kernel", "Module", "kernel", "load_module", "Event", "Graph", "Stream",
]
