"""OneTrainer's further optimizers (issue 17): the combinations that cannot be right are config errors naming the
strategy and why; schedule-free optimizers sample, export and checkpoint their averaged weights. (Each trains 2 steps
on one process in tests/test_optimizers.py, which runs every optimizer of the registry; those that run under fsdp and
zero2 end where one process ends on the same global batch in tests/test_optimizers_distributed.py, whose 2-rank launch
trains them anyway.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import base_config
from safetensors.torch import load_file
from test_optimizers import settings
from test_optimizers_distributed import RUNS

from ot_dist.checkpoint.export_command import export_checkpoint
from ot_dist.config.load import validate
from ot_dist.errors import ConfigError
from ot_dist.optim.registry import SPECS
from ot_dist.train.trainer import Trainer

NEW = ("ADOPT", "AdEMAMix", "AdEMAMix_8BIT", "CAME", "CAME_8BIT", "MUON", "SCHEDULE_FREE_ADAMW", "SCHEDULE_FREE_SGD",
       "PRODIGY_PLUS_SCHEDULE_FREE", "ADABELIEF", "TIGER", "YOGI")
# What is refused where (what runs: tests/test_optimizers_distributed.py RUNS)
REFUSED = {
    # name: (strategies, a word of the reason)
    "AdEMAMix": (("fsdp",), "bitsandbytes"),
    "AdEMAMix_8BIT": (("fsdp",), "bitsandbytes"),
    "CAME": (("fsdp", "zero1", "zero2", "zero3"), "factored"),
    "CAME_8BIT": (("fsdp", "zero1", "zero2", "zero3"), "factored"),
    "MUON": (("fsdp", "zero1", "zero2", "zero3"), "orthogonalisation"),
    "SCHEDULE_FREE_ADAMW": (("zero1", "zero2", "zero3"), "averaged weights"),
    "SCHEDULE_FREE_SGD": (("zero1", "zero2", "zero3"), "averaged weights"),
    "PRODIGY_PLUS_SCHEDULE_FREE": (("fsdp", "zero1", "zero2", "zero3"), "step size"),
}


def raw(tiny_models, shapes_data, out: Path, name: str, **extra) -> dict:
    overrides = {"max_steps": 2, **settings(name), **extra}
    method = overrides.pop("method")
    return base_config(tiny_models["sd1"], shapes_data, out, method=method, **overrides)


def lora(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "lora.safetensors")


@pytest.mark.parametrize("name", list(REFUSED))
def test_combinations_that_cannot_be_right_are_refused(name, tiny_models, shapes_data, tmp_path):
    strategies, reason = REFUSED[name]
    for strategy in ("fsdp", "zero1", "zero2", "zero3"):
        config = raw(tiny_models, shapes_data, tmp_path / strategy, name, strategy=strategy)
        if strategy not in strategies:
            validate(config)
            continue
        with pytest.raises(ConfigError) as err:
            validate(config)
        assert f"strategy: {strategy}" in str(err.value) and name in str(err.value) and reason in str(err.value)


def test_the_runs_and_refusals_cover_every_new_optimizer():
    assert set(NEW) <= set(SPECS)
    for strategy, names in RUNS.items():
        refused = {n for n, (strategies, _) in REFUSED.items() if strategy in strategies}
        ours = set(names) & set(NEW)  # (RUNS also compares AIDA / *_ADV cases: tests/test_optimizers_adv.py)
        assert ours | refused == set(NEW), strategy
        assert not ours & refused


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("name", ["SCHEDULE_FREE_ADAMW", "SCHEDULE_FREE_SGD"])
def test_schedule_free_exports_and_checkpoints_the_averaged_weights(name, tiny_models, shapes_data, tmp_path):
    out = tmp_path / "out"
    lr = {"SCHEDULE_FREE_ADAMW": 1e-2, "SCHEDULE_FREE_SGD": 1.0}[name]  # SGD: schedulefree's own default
    config = raw(tiny_models, shapes_data, out, name, batch_size=2, max_steps=3, learning_rate=lr,
                 **{"checkpoint.at_end": True})
    trainer = Trainer(validate(config), log=lambda *_: None)
    result = trainer.train()
    exported = lora(out)
    # the same export code on the weights training holds (the point y the gradients are taken at) ...
    iterate = [p.detach().clone() for p in trainer.params]
    trainer._export(tmp_path / "raw")
    # ... and on what the optimizer's eval() calls its weights (the average x)
    trainer.optimizer.eval()
    trainer._export(tmp_path / "eval")
    trainer.optimizer.train()
    assert gap(exported, lora(tmp_path / "eval")) <= 1e-7, "the export is not the optimizer's eval() weights"
    assert gap(exported, lora(tmp_path / "raw")) > 1e-4, "after 3 steps the average differs from the iterate"
    # training goes on from the iterate (eval then train: the same point up to float rounding)
    assert max((p - q).abs().max().item() for p, q in zip(trainer.params, iterate)) <= 1e-6
    # the checkpoint holds the average too: `ot-dist export CHECKPOINT` writes what the run exported
    from_checkpoint = export_checkpoint(str(result.checkpoint), None, False, str(tmp_path / "exp"), log=lambda *_: None)
    assert gap(exported, load_file(next(p for p in from_checkpoint if p.name == "lora.safetensors"))) <= 1e-7
    # and a resume takes its gradients at the iterate again
    resumed = Trainer(validate({**config, "max_steps": 4}), log=lambda *_: None, resume=str(result.checkpoint))
    assert max((p - q).abs().max().item() for p, q in zip(resumed.params, iterate)) <= 1e-6


@pytest.mark.parametrize("name", NEW)
def test_onetrainer_configs_with_the_new_optimizers_import(name, tiny_models, shapes_data, tmp_path):
    """OneTrainer's optimizer section of each (its defaults table, a changed value, keys ot_dist lacks) imports to a
    config that validates with the value kept; what ot_dist does not take is named."""
    from test_import_onetrainer import sd15_lora
    from test_optimizers import ONETRAINER_DEFAULTS

    from ot_dist.migrate.onetrainer import import_onetrainer

    ot = sd15_lora(tiny_models["sd1"], shapes_data)
    section = {**ONETRAINER_DEFAULTS.get(name, {}), "optimizer": name, "weight_decay": 0.05, "not_an_option": 1}
    if SPECS[name].adaptive:
        ot["learning_rate"] = 1.0
        ot["text_encoder"] = {**ot.get("text_encoder", {}), "learning_rate": 1.0}
    if name == "SCHEDULE_FREE_SGD":
        section["momentum"] = 0.9  # OneTrainer's default 0 is refused by schedulefree (a config error says so)
    ot["optimizer"] = section
    (tmp_path / "ot.json").write_text(json.dumps(ot))
    imported = import_onetrainer(tmp_path / "ot.json")
    config = validate(imported.config)
    assert (config.optimizer.name, config.optimizer.weight_decay) == (name, 0.05)
    assert any(line.startswith("optimizer.not_an_option") for line in imported.not_honoured)
