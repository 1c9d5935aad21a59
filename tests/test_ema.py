"""EMA in one process: OneTrainer's decay schedule and update interval, CPU placement, its state
round trip, and exports a user loads in diffusers (model_ema/ and the LoRA's lora_ema.safetensors).
The 2-rank sharded EMA is compared with this one in tests/test_sharded_prodigy_ema.py."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config

from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.parallel.ownership import Ownership, whole
from ot_dist.train.ema import ShardedEMA
from ot_dist.train.trainer import Trainer


def test_decay_schedule_and_interval_follow_onetrainer():
    weight = torch.nn.Parameter(torch.zeros(3))
    ema = ShardedEMA(Ownership([whole(weight, "w")], {"w": weight.shape}), decay=0.95, update_interval=3)
    expected = torch.zeros(3, dtype=torch.float64)
    for step in range(30):
        with torch.no_grad():
            weight.add_(1.0)  # the optimizer step
        moved = ema.update(step)
        assert moved == ((step + 1) % 3 == 0)
        if moved:
            decay = min((1 + step) / (10 + step), 0.95)
            expected = decay * expected + (1 - decay) * weight.detach().double()
    assert torch.allclose(ema.values[0].double(), expected, rtol=1e-6)
    assert ema.current_decay(0) == pytest.approx(0.1) and ema.current_decay(10_000) == 0.95


def test_cpu_placement_and_state_round_trip():
    weight = torch.nn.Parameter(torch.randn(4, 5))
    ownership = Ownership([whole(weight, "w")], {"w": weight.shape})
    ema = ShardedEMA(ownership, 0.9, 1, device=torch.device("cpu"))
    assert ema.values[0].device.type == "cpu" and ema.values[0].data_ptr() != weight.data_ptr()  # its own copy
    for step in range(3):
        with torch.no_grad():
            weight.add_(1.0)
        ema.update(50 + step)
    restored = ShardedEMA(ownership, 0.9, 1)  # starts from the current weights, which the average is not
    assert not torch.equal(restored.values[0], ema.values[0])
    restored.load_state_dict(ema.state_dict())
    assert torch.equal(restored.values[0], ema.values[0])
    other = ShardedEMA(Ownership([whole(torch.nn.Parameter(torch.zeros(2)), "w")], {}), 0.9, 1)
    with pytest.raises(ValueError, match="ema: the saved averages do not match"):
        other.load_state_dict(ema.state_dict())


def test_staged_updates_copy_without_waiting_and_give_the_same_average_bit_for_bit(monkeypatch):
    """ema.device: cpu with weights on a GPU stages each update: the weights go into host buffers with non_blocking
    copies, and the lerp runs at the next update or read. Forced here on the CPU: no `.to()` (a blocking copy on a GPU)
    and no lerp during an update, only non-blocking copies; every read (values, state_dict, full_weights) sees the
    same average as the immediate path, bit for bit, and a checkpoint's averages replace a pending update."""
    weights = [torch.nn.Parameter(torch.randn(4, 5)), torch.nn.Parameter(torch.randn(7))]
    ownership = Ownership([whole(w, f"w{i}") for i, w in enumerate(weights)], {f"w{i}": w.shape for i, w in enumerate(weights)})
    immediate = ShardedEMA(ownership, 0.9, 2, device=torch.device("cpu"), staged=False)
    staged = ShardedEMA(ownership, 0.9, 2, device=torch.device("cpu"), staged=True)
    copies, lerps = [], []
    copy_, lerp_ = torch.Tensor.copy_, torch._foreach_lerp_
    for step in range(9):
        with torch.no_grad():
            for w in weights:
                w.mul_(1.1).add_(0.3)  # the optimizer step
        immediate.update(step)
        monkeypatch.setattr(torch.Tensor, "to", lambda *a, **k: pytest.fail("a blocking .to() in a staged update"))
        monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, non_blocking=False: copies.append(non_blocking) or copy_(t, src, non_blocking))
        monkeypatch.setattr(torch, "_foreach_lerp_", lambda *a: lerps.append(step) or lerp_(*a))
        staged.update(step)
        monkeypatch.undo()
        if step == 4:
            assert staged._pending is not None  # the update of step 3 is still staged
            assert all(torch.equal(a, b) for a, b in zip(staged.state_dict()["values"], immediate.state_dict()["values"]))
    assert copies == [True] * 8  # 4 updates x 2 tensors, all non_blocking
    # each update's lerp ran at the next one: step 1's at step 3, step 5's at step 7 (step 3's ran at the read after
    # step 4, outside an update)
    assert lerps == [3, 7]
    assert all(torch.equal(a, b) for a, b in zip(staged.values, immediate.values))
    assert all(torch.equal(a, b) for a, b in zip(staged.full_weights().values(), immediate.full_weights().values()))
    saved = immediate.state_dict()
    weights[0].data.add_(1.0)
    staged.update(9)  # pending, then replaced by the checkpoint's averages
    staged.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(staged.values, saved["values"]))


def test_full_finetune_exports_an_ema_model_diffusers_loads(tiny_models, shapes_data, tmp_path):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, max_steps=6, epochs=2, learning_rate=1e-3,
                      **{"ema.enabled": True, "ema.decay": 0.9, "ema.update_step_interval": 1})
    trainer = Trainer(validate(raw), log=lambda *_: None)
    result = trainer.train()
    assert tmp_path / "model_ema" in result.exported and tmp_path / "model_ema.safetensors" in result.exported
    pipeline = StableDiffusionPipeline.from_pretrained(tmp_path / "model_ema", local_files_only=True)
    trained = UNet2DConditionModel.from_pretrained(tmp_path / "model", subfolder="unet")
    base = UNet2DConditionModel.from_pretrained(tiny_models["sd1"], subfolder="unet")
    averaged, final, start = (dict(m.named_parameters()) for m in (pipeline.unet, trained, base))
    name = "conv_in.weight"
    # The average lies between the start and the final weights: neither of them
    assert not torch.equal(averaged[name], final[name]) and not torch.equal(averaged[name], start[name])
    # ... and it is the average the run kept, gathered into the export
    assert torch.allclose(averaged[name], trainer.ema.full_weights()[f"unet.{name}"], atol=0)
    assert (tmp_path / "model_ema.safetensors").stat().st_size > 0


def test_lora_exports_an_ema_adapter_diffusers_loads(tiny_models, shapes_data, tmp_path):
    from diffusers import StableDiffusionPipeline

    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, method="lora", max_steps=4, learning_rate=1e-2,
                      **{"lora.rank": 4, "ema.enabled": True, "ema.update_step_interval": 1})
    Trainer(validate(raw), log=lambda *_: None).train()
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_models["sd1"], local_files_only=True)
    pipeline.load_lora_weights(tmp_path, weight_name="lora_ema.safetensors", adapter_name="ema")
    assert "ema" in pipeline.get_active_adapters()
    # the file holds the average: not the trained adapter, not its zero start
    from safetensors.torch import load_file

    averaged, trained = load_file(tmp_path / "lora_ema.safetensors"), load_file(tmp_path / "lora.safetensors")
    assert averaged.keys() == trained.keys()
    ups = [k for k in averaged if "lora_up" in k or "lora_B" in k]
    assert any(averaged[k].abs().max() > 0 for k in ups)
    assert not all(torch.equal(averaged[k], trained[k]) for k in ups)


def test_ema_settings_are_validated(tiny_models, shapes_data, tmp_path):
    raw = base_config(tiny_models["sd1"], shapes_data, tmp_path, **{"ema.decay": 1.5})
    with pytest.raises(ConfigError, match="ema.decay"):
        validate(raw)
