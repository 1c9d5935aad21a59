"""`ot-dist schedule` shows the learning rates training applies, counting steps as the trainer does; the
trainer saves snapshots at the cycle lows."""

from __future__ import annotations

import csv

import yaml
from conftest import base_config
from safetensors.torch import load_file

from ot_dist.cli import main
from ot_dist.config.load import validate
from ot_dist.train.steps import plan_steps
from ot_dist.train.trainer import Trainer


def test_schedule_output_equals_what_the_optimizer_saw(tiny_models, shapes_data, tmp_path, capsys):
    # 16 images / (batch 2 x accumulation 2) = 4 steps per epoch x 2 epochs, capped at 7.
    raw = base_config(
        tiny_models["sd1"], shapes_data, tmp_path / "out", method="lora", batch_size=2, gradient_accumulation_steps=2,
        epochs=2, max_steps=7, learning_rate=1e-3,
        **{"text_encoder.train": True, "text_encoder.learning_rate": 4e-4, "scheduler.name": "COSINE_WITH_HARD_RESTARTS",
           "scheduler.cycles": 2, "scheduler.warmup_steps": 4, "scheduler.min_factor": 0.1},
    )  # warmup: 4 micro steps (OneTrainer's unit) = 2 optimizer steps
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    assert main(["schedule", str(config_path), "--csv", str(tmp_path / "lr.csv"), "--plot", str(tmp_path / "lr.png")]) == 0
    out = capsys.readouterr().out
    assert "over 7 optimizer steps (4 per epoch" in out
    with open(tmp_path / "lr.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "lr/unet", "lr/text_encoder"]
    preview = [[float(v) for v in row[1:]] for row in rows[1:]]
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    trainer = Trainer(validate(raw), log=lambda *_: None)
    seen = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([g["lr"] for g in opt.param_groups])
    )
    assert [g.name for g in trainer.groups] == ["unet", "text_encoder"]
    trainer.train()
    assert len(seen) == 7
    assert preview == seen  # exactly, every group, every step
    assert seen[0] == [0.0, 0.0] and seen[1] == [5e-4, 2e-4]  # OneTrainer's warmup: step / warmup
    assert seen[2] == [1e-3, 4e-4]  # the first step after warmup runs at the full rate


def test_schedule_counts_steps_like_the_trainer_and_takes_steps_without_data(tmp_path, capsys):
    raw = {"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o",
           "data": {"path": str(tmp_path / "missing")}, "scheduler": {"name": "LINEAR"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["schedule", str(path)]) == 3
    assert "--steps N" in capsys.readouterr().err
    assert main(["schedule", str(path), "--steps", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step lr/unet" and out[1:6] == ["1 1e-05", "2 8e-06", "3 6e-06", "4 4e-06", "5 2e-06"]
    config = validate({**raw, "batch_size": 3, "gradient_accumulation_steps": 2, "epochs": 5, "max_steps": 40})
    plan = plan_steps(config, 100, world_size=2)
    assert (plan.global_batch, plan.steps_per_epoch, plan.total_steps) == (12, 8, 40)
    assert plan_steps(config, 100, world_size=4).total_steps == 20


def test_snapshots_at_cycle_lows(tiny_models, shapes_data, tmp_path):
    raw = base_config(
        tiny_models["sd1"], shapes_data, tmp_path / "out", method="lora", batch_size=2, max_steps=6,
        **{"scheduler.name": "REX_WITH_RESTARTS", "scheduler.cycles": 3, "scheduler.snapshot_at_cycle_lows": True},
    )
    lines = []
    Trainer(validate(raw), log=lines.append).train()
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == ["step-2", "step-4"]  # step 6 is the final export
    first, second, final = (load_file(p) for p in (out / "snapshots/step-2/lora.safetensors",
                                                    out / "snapshots/step-4/lora.safetensors", out / "lora.safetensors"))
    assert first.keys() == final.keys()
    assert any(not (first[k] == second[k]).all() for k in first) and any(not (second[k] == final[k]).all() for k in first)
    assert any("snapshots/step-2/lora.safetensors" in line for line in lines)


def test_a_stopped_part_shows_lr_0_in_the_schedule_and_the_logged_rates(tiny_models, shapes_data, tmp_path, capsys):
    """#19 item 8: text_encoder.stop_training_after 3 steps: `ot-dist schedule` and the rates the trainer logs
    (progress line, MLflow) show 0 for it from step 4 on, and the two agree at every step."""
    raw = base_config(
        tiny_models["sd1"], shapes_data, tmp_path / "out", method="lora", batch_size=2, max_steps=6, learning_rate=1e-3,
        **{"text_encoder.train": True, "text_encoder.learning_rate": 4e-4, "text_encoder.stop_training_after": 3,
           "text_encoder.stop_training_after_unit": "step", "scheduler.name": "LINEAR", "scheduler.min_factor": 0.5},
    )
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    assert main(["schedule", str(config_path), "--csv", str(tmp_path / "lr.csv")]) == 0
    assert "text_encoder stops training after 3 steps" in capsys.readouterr().out
    with open(tmp_path / "lr.csv") as f:
        preview = [[float(v) for v in row[1:]] for row in list(csv.reader(f))[1:]]
    assert [row[1] for row in preview[3:]] == [0.0] * 3 and all(row[1] > 0 for row in preview[:3])

    trainer = Trainer(validate(raw), log=lambda *_: None)
    logged, step_of = [], trainer.optimizer_step

    def recording(step):
        rates, norm = step_of(step)
        logged.append([rates["lr/unet"], rates["lr/text_encoder"]])
        return rates, norm

    trainer.optimizer_step = recording
    trainer.train()
    assert logged == preview


def test_a_resumed_run_with_more_steps_continues_on_the_new_curve(tiny_models, shapes_data, tmp_path):
    """#19 item 8: a LINEAR run of 4 steps resumed with max_steps 8 runs step 5 at lr x (1 - 4/8), not at the
    rate the 4-step schedule had planned after its end (0)."""
    def raw(max_steps):
        return base_config(tiny_models["sd1"], shapes_data, tmp_path / "out", method="lora", batch_size=2, epochs=2,
                           max_steps=max_steps, learning_rate=1e-3, **{"scheduler.name": "LINEAR"})

    Trainer(validate(raw(4)), log=lambda *_: None).train()
    trainer = Trainer(validate(raw(8)), log=lambda *_: None, resume="auto")
    seen = []
    trainer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    result = trainer.train()
    assert result.first_step == 4
    assert seen == [1e-3 * (8 - s) / 8 for s in range(4, 8)]
