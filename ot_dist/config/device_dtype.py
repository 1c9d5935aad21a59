"""`train_dtype: auto` (the default): bfloat16 where the training GPUs compute it natively, float32 elsewhere.

bfloat16 autocast runs the matmuls and convolutions on the tensor cores of Ampere and newer GPUs (compute
capability 8.0+) at about twice TF32's rate, with float32's range, so no loss scaling; the trained weights stay
float32 master weights (trained_weight_dtype). Older GPUs (V100, T4) only emulate bfloat16, slowly, and a CPU
run keeps float32: the demo, the tests and CPU debugging runs stay exact.

The config is validated in the launcher process too, before any rank starts: asking CUDA for a device's
capability there would create a CUDA context on GPU 0 that the launcher holds for the whole run. NVML answers
without one (the driver's library, loaded with ctypes); CUDA is asked only where NVML is missing or CUDA is
already initialised. Every GPU of the node counts: one pre-Ampere device keeps float32, so all ranks resolve
alike."""

from __future__ import annotations

import ctypes

NATIVE_BFLOAT16_MAJOR = 8  # compute capability 8.0 (Ampere) and newer


def resolve_train_dtype(value: str) -> str:
    if value != "auto":
        return value
    capabilities = cuda_capabilities()
    if capabilities and min(capabilities)[0] >= NATIVE_BFLOAT16_MAJOR:
        return "bfloat16"
    return "float32"


def cuda_capabilities() -> list[tuple[int, int]]:
    """(major, minor) compute capability of every CUDA device of this machine; [] without one. ROCm GPUs count
    as bfloat16-capable (torch.cuda.is_bf16_supported says so for every ROCm architecture)."""
    import torch

    if not torch.cuda.is_available():
        return []
    if torch.version.hip:
        return [(NATIVE_BFLOAT16_MAJOR, 0)] * torch.cuda.device_count()
    if not torch.cuda.is_initialized():
        found = nvml_capabilities()
        if found:
            return found
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def nvml_capabilities(library: str = "libnvidia-ml.so.1") -> list[tuple[int, int]] | None:
    """Every NVML device's compute capability, or None when NVML cannot tell (library missing, a call failing)."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        capabilities = []
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(0), ctypes.c_int(0)
            if (nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
                return None
            capabilities.append((major.value, minor.value))
        return capabilities or None
    finally:
        nvml.nvmlShutdown()
