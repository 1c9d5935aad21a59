"""`performance.expandable_segments`: on CUDA the caching allocator grows segments in place, set once before the
model is placed, unless the user configured the allocator through the environment."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import base_config

from ot_dist.config.load import validate
from ot_dist.config.performance import PerformanceConfig
from ot_dist.train import cuda_allocator
from ot_dist.train.cuda_allocator import EXPANDABLE, allocator_settings

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("device, expandable, environ, expected", [
    (CUDA, True, {}, EXPANDABLE),
    (CUDA, True, {"PYTORCH_ALLOC_CONF": ""}, EXPANDABLE),  # set but empty: nothing chosen
    (torch.device("cpu"), True, {}, None),
    (CUDA, False, {}, None),
    # The user's allocator settings win, under either of torch's names for them.
    (CUDA, True, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}, None),
    (CUDA, True, {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}, None),
])
def test_the_setting_applies_on_cuda_unless_the_environment_chose(device, expandable, environ, expected):
    assert allocator_settings(PerformanceConfig(expandable_segments=expandable), device, environ) == expected


def test_expandable_segments_is_on_by_default_and_validated():
    assert PerformanceConfig().expandable_segments is True
    with pytest.raises(ValueError, match="expandable_segments"):
        PerformanceConfig(expandable_segments="sometimes")


def test_the_trainer_sets_it_before_the_model_is_loaded(tiny_models, shapes_data, tmp_path, monkeypatch):
    """The allocator's setting covers the segments created after it, so it must come before the model is placed."""
    from ot_dist.train import trainer as trainer_module

    events = []
    monkeypatch.setattr(cuda_allocator, "allocator_settings", lambda options, device: EXPANDABLE)
    monkeypatch.setattr(cuda_allocator, "set_allocator_settings", lambda settings: events.append(settings))
    real_load = trainer_module.load_model
    monkeypatch.setattr(trainer_module, "load_model",
                        lambda config, **kwargs: events.append("load_model") or real_load(config, **kwargs))
    config = validate(base_config(tiny_models["sd1"], shapes_data, tmp_path / "run"))
    trainer_module.Trainer(config, log=lambda *_: None)
    assert events == [EXPANDABLE, "load_model"]


def test_settings_go_through_the_accelerator_setter_without_a_deprecation_warning(monkeypatch):
    """torch 2.11+ warns on every call of the CUDA setter (seen on an H100, 2026-11-28); its accelerator-wide setter
    takes the same string. Before 2.11 only the CUDA one exists."""
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cuda_allocator.set_allocator_settings(EXPANDABLE)
    assert calls == [EXPANDABLE]
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda settings: calls.append(("cuda", settings)))
    cuda_allocator.set_allocator_settings(EXPANDABLE)
    assert calls[-1] == ("cuda", EXPANDABLE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_new_segments_are_expandable(monkeypatch):
    for name in cuda_allocator.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        assert cuda_allocator.configure_cuda_allocator(PerformanceConfig(), device) == EXPANDABLE
        tensor = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)  # a new segment of its own
        segments = torch.cuda.memory_snapshot()
        assert any(segment.get("is_expandable") for segment in segments), segments[:2]
        del tensor
    finally:
        cuda_allocator.set_allocator_settings("expandable_segments:False")
