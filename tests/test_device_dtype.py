"""`train_dtype: auto`, the default: bfloat16 where every GPU of the machine computes it natively, float32 on older
GPUs and on the CPU, decided without creating a CUDA context (the launcher validates the config too)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from test_config import MINIMAL

from ot_dist.config import device_dtype
from ot_dist.config.load import validate
from ot_dist.launcher import reconcile_with_launcher


def test_a_cpu_machine_trains_in_float32_by_default_and_an_explicit_dtype_is_kept():
    assert not torch.cuda.is_available()  # this suite's machines
    assert validate(MINIMAL).train_dtype == "float32"
    for dtype in ("float32", "bfloat16", "float16"):
        assert validate({**MINIMAL, "train_dtype": dtype}).train_dtype == dtype


@pytest.mark.parametrize(("capabilities", "expected"), [
    ([(9, 0)] * 8, "bfloat16"),  # H100 / H200 node
    ([(8, 0), (8, 6)], "bfloat16"),  # A100 + RTX 3090
    ([(8, 9)], "bfloat16"),  # Ada
    ([(7, 0)] * 4, "float32"),  # V100: bfloat16 only emulated
    ([(9, 0), (7, 5)], "float32"),  # one T4 among H100s: every rank must resolve alike
    ([], "float32"),  # no GPU
])
def test_auto_is_bfloat16_only_where_every_gpu_computes_it_natively(monkeypatch, capabilities, expected):
    monkeypatch.setattr(device_dtype, "cuda_capabilities", lambda: capabilities)
    config = validate(MINIMAL)
    assert config.train_dtype == expected
    assert validate({**MINIMAL, "train_dtype": "float16"}).train_dtype == "float16"  # explicit wins


def test_auto_with_bfloat16_weights_validates_only_where_it_resolves_to_bfloat16(monkeypatch):
    """The checks that depend on train_dtype see the resolved value."""
    raw = {**MINIMAL, "trained_weight_dtype": "bfloat16"}
    monkeypatch.setattr(device_dtype, "cuda_capabilities", lambda: [(9, 0)])
    assert validate(raw).train_dtype == "bfloat16"
    monkeypatch.setattr(device_dtype, "cuda_capabilities", lambda: [])
    with pytest.raises(Exception, match="trained_weight_dtype: bfloat16 weights need train_dtype: bfloat16"):
        validate(raw)


def test_the_launcher_takes_accelerates_mixed_precision_when_the_config_leaves_train_dtype_at_auto(monkeypatch):
    monkeypatch.setattr(device_dtype, "cuda_capabilities", lambda: [(9, 0)])
    config = validate({**MINIMAL, "strategy": "ddp"})
    env = {"ACCELERATE_MIXED_PRECISION": "fp16", "WORLD_SIZE": "2"}
    assert reconcile_with_launcher(config, env).train_dtype == "float16"


class FakeNVML:
    """libnvidia-ml's calls as ctypes makes them: out-parameters through byref()."""

    def __init__(self, capabilities, failing: str | None = None):
        self.capabilities, self.failing, self.calls = capabilities, failing, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == self.failing:
                return 999  # NVML_ERROR_UNKNOWN
            if name == "nvmlDeviceGetCount_v2":
                args[0]._obj.value = len(self.capabilities)
            elif name == "nvmlDeviceGetHandleByIndex_v2":
                args[1]._obj.value = 0x1000 + args[0].value
            elif name == "nvmlDeviceGetCudaComputeCapability":
                major, minor = self.capabilities[args[0].value - 0x1000]
                args[1]._obj.value, args[2]._obj.value = major, minor
            return 0
        return call


def test_nvml_reads_every_devices_capability_and_shuts_down(monkeypatch):
    fake = FakeNVML([(9, 0), (8, 6)])
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    assert device_dtype.nvml_capabilities() == [(9, 0), (8, 6)]
    assert fake.calls[0] == "nvmlInit_v2" and fake.calls[-1] == "nvmlShutdown"


@pytest.mark.parametrize("failing", ["nvmlInit_v2", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
                                     "nvmlDeviceGetCudaComputeCapability"])
def test_nvml_that_cannot_answer_gives_none(monkeypatch, failing):
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeNVML([(9, 0)], failing=failing))
    assert device_dtype.nvml_capabilities() is None


def test_no_nvml_library_gives_none():
    assert device_dtype.nvml_capabilities("libno-such-nvml.so.1") is None


def test_on_a_gpu_machine_cuda_is_not_initialised_when_nvml_answers(monkeypatch):
    """The launcher validates the config: a CUDA context there would sit on GPU 0 for the whole run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(device_dtype, "nvml_capabilities", lambda: [(9, 0), (9, 0)])

    def initialises_cuda(*_):
        raise AssertionError("asked CUDA, which creates a context")

    monkeypatch.setattr(torch.cuda, "get_device_capability", initialises_cuda)
    assert device_dtype.cuda_capabilities() == [(9, 0), (9, 0)]
    monkeypatch.setattr(device_dtype, "nvml_capabilities", lambda: None)  # no NVML: CUDA must answer
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    assert device_dtype.cuda_capabilities() == [(8, 0), (8, 0)]
