"""Under fsdp the trained modules reach the device a sharding unit at a time, as FSDP2 shards them, never whole
(Strategy.shards_while_placing; docs/parallel.md): a model larger than one GPU still starts. FLUX.2 dev's transformer
is 120 GiB in float32, Qwen-Image's 76 GiB; moved whole before sharding, they did not fit an 80 GB GPU although their
shards do. A CPU has one device, so the proxy is what moves: the trainer never moves a trained component itself, and
each of FSDP2's moves carries one unit's own parameters."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config


def placement_moves(monkeypatch, raw) -> tuple[dict, list[int], dict[str, int], list[int], int]:
    """Trainer construction under `raw`: the components the trainer moved with Module.to (name -> count), the bytes
    of each of the strategy's moves to the device (FSDP2's, a unit's own parameters; ZeRO-3's, a parameter), the
    trained modules' bytes by name, at each of FSDP2's moves how many parameters moved before it are still alive, and
    how many parameters FSDP2 moved."""
    import weakref

    from deepspeed.runtime.zero.partition_parameters import Init
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    from ot_dist.config.load import validate
    from ot_dist.train.trainer import Trainer

    moved_modules: list[torch.nn.Module] = []
    to = torch.nn.Module.to

    def recording_to(module, *args, **kwargs):
        if args and isinstance(args[0], (torch.device, str)) or "device" in kwargs:
            moved_modules.append(module)
        return to(module, *args, **kwargs)

    strategy_moves: list[int] = []
    moved_params: list[weakref.ref] = []
    alive_at_each_move: list[int] = []
    move = _fsdp_init._move_states_to_device

    def recording_move(params, buffers, device):
        strategy_moves.append(sum(p.numel() * p.element_size() for p in params))
        alive_at_each_move.append(sum(ref() is not None for ref in moved_params))
        moved_params.extend(weakref.ref(p) for p in params)
        return move(params, buffers, device)

    zero_init = Init._zero_init_param

    def recording_zero_init(self, param):  # ZeRO-3 moves, broadcasts and partitions one parameter
        strategy_moves.append(param.numel() * param.element_size())
        return zero_init(self, param)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    monkeypatch.setattr(_fsdp_init, "_move_states_to_device", recording_move)
    monkeypatch.setattr(Init, "_zero_init_param", recording_zero_init)
    trainer = Trainer(validate(raw), log=lambda *_: None)
    try:
        trained = trainer.strategy.trained_modules
        moved = {name: sum(m is module for m in moved_modules) for name, module in trained.items()}
        sizes = {name: sum(shape_of(p).numel() * p.element_size() for p in trainer.model.parts()[name].parameters())
                 for name in trained}
        return moved, strategy_moves, sizes, alive_at_each_move, len(moved_params)
    finally:
        trainer.close()


def shape_of(param) -> torch.Size:
    return getattr(param, "ds_shape", param.shape)  # a ZeRO-3 partitioned parameter is empty; ds_shape is its own


def test_fsdp_moves_the_trained_modules_a_unit_at_a_time(small_sd1, shapes_data, tmp_path, monkeypatch):
    raw = base_config(small_sd1, shapes_data, tmp_path / "fsdp", strategy="fsdp", max_steps=1,
                      **{"text_encoder.train": True})
    moved, strategy_moves, sizes, _, _ = placement_moves(monkeypatch, raw)
    assert set(moved) == {"unet", "text_encoder"}
    assert not any(moved.values()), f"moved whole by the trainer before sharding: {moved}"
    # every trained parameter reached the device through FSDP2, one unit's own at a time (the units of the UNet and
    # the text encoder, then each root's rest)
    total = sum(sizes.values())
    assert len(strategy_moves) > 10 and sum(strategy_moves) == total, (strategy_moves, sizes)
    assert max(strategy_moves) < 0.25 * total, (max(strategy_moves), total)


def test_single_moves_the_trained_modules_whole(small_sd1, shapes_data, tmp_path, monkeypatch):
    """The proxy above sees a whole move where one is made."""
    raw = base_config(small_sd1, shapes_data, tmp_path / "single", max_steps=1, **{"text_encoder.train": True})
    moved, strategy_moves, _, _, _ = placement_moves(monkeypatch, raw)
    assert moved == {"unet": 1, "text_encoder": 1} and not strategy_moves


def test_zero3_partitions_the_trained_modules_a_parameter_at_a_time(small_sd1, shapes_data, tmp_path, monkeypatch):
    """ZeRO-3 where every rank of the node loads at once (here one process): the engine moves only the buffers, and
    DeepSpeed's partitioning moves each parameter to the device, keeps this rank's partition and frees the rest."""
    from ot_dist.memory.node_shared import NodeSharing
    from ot_dist.train import trainer as trainer_module

    shared = []  # the modules whose frozen CPU weights the node would hold once: not those ZeRO-3 is about to move
    monkeypatch.setattr(trainer_module, "share_frozen_cpu_weights",
                        lambda modules, **_: shared.extend(modules) or NodeSharing())
    raw = base_config(small_sd1, shapes_data, tmp_path / "zero3", strategy="zero3", max_steps=1,
                      **{"text_encoder.train": True})
    moved, strategy_moves, sizes, _, _ = placement_moves(monkeypatch, raw)
    assert not any(moved.values()), f"moved whole by the trainer before partitioning: {moved}"
    assert shared and not any(type(m).__name__ in ("UNet2DConditionModel", "CLIPTextModel") for m in shared), shared
    total = sum(sizes.values())
    assert sum(strategy_moves) == total and max(strategy_moves) < 0.25 * total, (strategy_moves, total)


def test_zero3s_engine_module_moves_only_its_buffers_when_the_parameters_stay():
    """DeepSpeed's engine moves its module to the device before partitioning (a CPU has no second device to show it:
    the meta device stands in)."""
    from ot_dist.parallel.deepspeed import TrainableParts

    norm = torch.nn.BatchNorm1d(4)  # parameters and buffers
    parts = TrainableParts({"norm": norm}, parameters_stay=True)
    assert parts.to(torch.device("meta")) is parts
    assert norm.weight.device.type == "cpu" and norm.running_mean.device.type == "meta"
    moved = TrainableParts({"norm": torch.nn.BatchNorm1d(4)}).to("meta")
    assert moved.parts["norm"].weight.device.type == "meta"


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fsdp_releases_each_unit_before_the_next_moves(small_sd1, shapes_data, tmp_path, monkeypatch, method):
    """FSDP2 moves a unit's parameters to the device in place (each Parameter object's data) and then shards them:
    a parameter object still held anywhere keeps its whole copy on the device. The trainer's parameter groups held
    them all until the wrap ended, so on an H200 the GPU held the whole UNet at start-up again (2026-11-28: 3.3 MB
    for a 3.2 MB UNet whose largest unit is 0.5 MB). When each unit moves, no parameter moved before it may be
    alive."""
    raw = base_config(small_sd1, shapes_data, tmp_path / method, strategy="fsdp", max_steps=1, method=method)
    _, _, _, alive_at_each_move, params_moved = placement_moves(monkeypatch, raw)
    assert len(alive_at_each_move) > 10 and params_moved > 100
    assert not any(alive_at_each_move), alive_at_each_move
