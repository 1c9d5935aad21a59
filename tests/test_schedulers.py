"""Learning-rate schedules: each curve matches its definition at the end of warmup, at cycle boundaries and
at the last step; CUSTOM reproduces the torch scheduler it names; cycle lows fall where the snapshots go;
config errors name the key."""

from __future__ import annotations

import math

import pytest
import torch

from ot_dist.config.load import validate
from ot_dist.config.optim import SchedulerConfig
from ot_dist.errors import ConfigError
from ot_dist.methods.base import ParamGroup
from ot_dist.optim.factory import build_optimizer
from ot_dist.optim.schedulers import build_scheduler, cycle_lows, lr_factor
from ot_dist.train.steps import StepPlan

MINIMAL = {"model": {"family": "sd1", "path": "m"}, "method": "lora", "output_dir": "o", "data": {"path": "d"}}
TOTAL, WARMUP = 100, 10  # 90 steps after warmup


def factors(name, total=TOTAL, **options):
    config = SchedulerConfig(name=name, warmup_steps=WARMUP, **options)
    return [lr_factor(config, s, total) for s in range(total)]


def cos(x):
    return 0.5 * (1 + math.cos(math.pi * x))


def rex(x):
    return (1 - x) / (0.1 + 0.9 * (1 - x))


@pytest.mark.parametrize(
    "name,options,points",
    [
        ("CONSTANT", {}, {10: 1.0, 55: 1.0, 99: 1.0}),
        ("LINEAR", {}, {10: 1.0, 55: 0.5, 99: 1 / 90}),
        ("LINEAR", {"min_factor": 0.2}, {10: 1.0, 55: 0.6, 99: 0.2 + 0.8 / 90}),
        ("COSINE", {}, {10: 1.0, 55: 0.5, 99: cos(89 / 90)}),
        # 3 smooth cycles = 5 half periods of 18 steps: lows at 18 and 54 (and the end), tops at 36 and 72.
        ("COSINE_WITH_RESTARTS", {"cycles": 3}, {10: 1.0, 28: 0.0, 46: 1.0, 64: 0.0, 82: 1.0, 99: cos(5 * 89 / 90)}),
        ("COSINE_WITH_RESTARTS", {"cycles": 3, "min_factor": 0.1}, {28: 0.1, 46: 1.0}),
        # 3 hard cycles of 30 steps: the last step of a cycle is its low, the next one is back at the top.
        ("COSINE_WITH_HARD_RESTARTS", {"cycles": 3},
         {10: 1.0, 25: 0.5, 39: cos(29 / 30), 40: 1.0, 70: 1.0, 99: cos(29 / 30)}),
        ("REX", {}, {10: 1.0, 55: rex(0.5), 99: rex(89 / 90)}),
        ("REX_WITH_RESTARTS", {"cycles": 3}, {10: 1.0, 39: rex(29 / 30), 40: 1.0, 99: rex(29 / 30)}),
        ("REX_WITH_RESTARTS", {"cycles": 3, "min_factor": 0.5}, {39: 0.5 + 0.5 * rex(29 / 30), 40: 1.0}),
    ],
)
def test_curve_matches_its_definition(name, options, points):
    values = factors(name, **options)
    # Warmup: linear, never zero, reaching the schedule's start right after the last warmup step.
    assert values[0] == pytest.approx(1 / 11) and values[9] == pytest.approx(10 / 11)
    for step, expected in points.items():
        assert values[step] == pytest.approx(expected, abs=1e-12), (name, step)


def test_warmup_fraction_and_whole_steps():
    assert SchedulerConfig(warmup_steps=0.25).resolved_warmup(200) == 50
    assert SchedulerConfig(warmup_steps=1).resolved_warmup(200) == 200  # <= 1 is a fraction: the whole run
    assert SchedulerConfig(warmup_steps=30).resolved_warmup(200) == 30
    with pytest.raises(ValueError, match="scheduler.warmup_steps"):
        SchedulerConfig(warmup_steps=2.5)


def optimizer_with_groups(lrs, name="ADAMW"):
    config = validate({**MINIMAL, "optimizer": {"name": name}})
    groups = [ParamGroup(f"g{i}", [torch.nn.Parameter(torch.zeros(2))], lr) for i, lr in enumerate(lrs)]
    return build_optimizer(config.optimizer, groups)


def applied_lrs(config, optimizer, steps, plan=None):
    plan = plan or StepPlan(0, 1, steps, steps)
    scheduler = build_scheduler(config, optimizer, plan)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return out


def test_custom_multisteplr_reproduces_torch_and_the_seed_table():
    """The seed's example: MultiStepLR, milestones 50, 100, 150, gamma 0.5, a LoRA UNet at 1e-4 and an
    embedding at 1e-3."""
    custom = {"name": "CUSTOM", "class_name": "torch.optim.lr_scheduler.MultiStepLR",
              "params": {"milestones": [50, 100, 150], "gamma": 0.5}}
    config = validate({**MINIMAL, "scheduler": custom})
    ours = applied_lrs(config, optimizer_with_groups([1e-4, 1e-3]), 200)
    reference_optimizer = optimizer_with_groups([1e-4, 1e-3])
    reference = torch.optim.lr_scheduler.MultiStepLR(reference_optimizer, milestones=[50, 100, 150], gamma=0.5)
    expected = []
    for _ in range(200):
        expected.append([g["lr"] for g in reference_optimizer.param_groups])
        reference_optimizer.step()
        reference.step()
    assert ours == expected  # exactly
    for step, (unet, embedding) in {0: (1e-4, 1e-3), 50: (5e-5, 5e-4), 100: (2.5e-5, 2.5e-4), 150: (1.25e-5, 1.25e-4),
                                    199: (1.25e-5, 1.25e-4)}.items():
        assert ours[step] == pytest.approx([unet, embedding], rel=1e-12)

    # With warmup the custom schedule starts after it: step 10 + s applies MultiStepLR's step s.
    warm = validate({**MINIMAL, "scheduler": {**custom, "warmup_steps": 10}})
    warmed = applied_lrs(warm, optimizer_with_groups([1e-4, 1e-3]), 210)
    assert warmed[10:] == expected
    assert warmed[0] == pytest.approx([1e-4 / 11, 1e-3 / 11])
    assert warmed[9] == pytest.approx([1e-4 * 10 / 11, 1e-3 * 10 / 11])


def test_custom_placeholders_are_substituted():
    config = validate({
        **MINIMAL, "learning_rate": 2e-4, "epochs": 4,
        "scheduler": {"name": "CUSTOM", "class_name": "torch.optim.lr_scheduler.OneCycleLR",
                      "params": {"max_lr": "%LR%", "total_steps": "%TOTAL_STEPS%", "cycle_momentum": False}},
    })
    ours = applied_lrs(config, optimizer_with_groups([2e-4]), 40, StepPlan(40, 4, 10, 40))
    reference_optimizer = optimizer_with_groups([2e-4])
    reference = torch.optim.lr_scheduler.OneCycleLR(reference_optimizer, max_lr=2e-4, total_steps=40, cycle_momentum=False)
    expected = []
    for _ in range(40):
        expected.append([g["lr"] for g in reference_optimizer.param_groups])
        reference_optimizer.step()
        reference.step()
    assert ours == expected


@pytest.mark.parametrize("name", ["COSINE_WITH_HARD_RESTARTS", "REX_WITH_RESTARTS"])
def test_cycle_lows_of_the_seed_example(name):
    """10000 steps with 20 cycles: a snapshot every 500 steps, each where the learning rate is lowest."""
    config = SchedulerConfig(name=name, cycles=20)
    assert cycle_lows(config, 10000) == list(range(500, 10001, 500))
    # After a warmup the cycles start later and are shorter.
    warm = SchedulerConfig(name=name, cycles=20, warmup_steps=100)
    assert cycle_lows(warm, 10100) == list(range(600, 10101, 500))


def test_cycle_lows_are_the_lowest_step_of_each_cycle():
    config = SchedulerConfig(name="COSINE_WITH_RESTARTS", cycles=3, warmup_steps=WARMUP)
    values = factors("COSINE_WITH_RESTARTS", cycles=3)
    lows = cycle_lows(config, TOTAL)
    assert lows == [29, 65, 100]  # 1-based: the step that ran at the bottom (0-based 28, 64, 99)
    for low in lows:
        assert values[low - 1] == min(values[max(WARMUP, low - 19): low + 18])


def test_scheduler_option_errors_name_the_key():
    cases = [
        ({"name": "COSINE", "cycles": 3}, "scheduler.cycles: schedule COSINE does not take it"),
        ({"name": "CONSTANT", "min_factor": 0.1}, "scheduler.min_factor"),
        ({"name": "COSINE", "snapshot_at_cycle_lows": True}, "scheduler.snapshot_at_cycle_lows: needs a cyclic schedule"),
        ({"name": "CUSTOM"}, "scheduler.class_name: schedule CUSTOM needs `module.Class`"),
        ({"name": "CUSTOM", "class_name": "torch.optim.lr_scheduler.MultiStepLR", "params": {"milestone": [5]}},
         "scheduler.params.milestone: MultiStepLR does not take it; it takes: milestones, gamma"),
        ({"name": "CUSTOM", "class_name": "torch.optim.lr_scheduler.NoSuchLR"}, "scheduler.class_name: cannot load"),
        ({"name": "CUSTOM", "class_name": "torch.optim.lr_scheduler.StepLR", "params": {"step_size": "%STEPS%"}},
         "scheduler.params.step_size: unknown placeholder %STEPS%"),
        ({"name": "ADAFACTOR"}, "scheduler.name: ADAFACTOR reports Adafactor's own step size"),
    ]
    for scheduler, expected in cases:
        with pytest.raises(ConfigError) as err:
            validate({**MINIMAL, "scheduler": scheduler})
        assert expected in str(err.value), (scheduler, str(err.value))


def test_custom_class_outside_the_allowed_modules_needs_opt_in(tmp_path, monkeypatch):
    (tmp_path / "my_schedules.py").write_text(
        "import torch\n"
        "class Halving(torch.optim.lr_scheduler.LambdaLR):\n"
        "    def __init__(self, optimizer, every, last_epoch=-1):\n"
        "        super().__init__(optimizer, lambda s: 0.5 ** (s // every), last_epoch)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = {"name": "CUSTOM", "class_name": "my_schedules.Halving", "params": {"every": 3}}
    with pytest.raises(ConfigError) as err:
        validate({**MINIMAL, "scheduler": custom})
    assert "scheduler.class_name: my_schedules.Halving is outside torch.optim.lr_scheduler and ot_dist" in str(err.value)
    assert "scheduler.allow_custom_code: true" in str(err.value)
    config = validate({**MINIMAL, "scheduler": {**custom, "allow_custom_code": True}})
    lrs = applied_lrs(config, optimizer_with_groups([1.0]), 7)
    assert [row[0] for row in lrs] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]


def test_adafactor_schedule_reports_the_step_size_applied():
    config = validate({**MINIMAL, "optimizer": {"name": "ADAFACTOR"}, "scheduler": {"name": "ADAFACTOR"}})
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 8))
    optimizer = build_optimizer(config.optimizer, [ParamGroup("unet", [weight], 1e-4)])
    scheduler = build_scheduler(config, optimizer, StepPlan(0, 1, 5, 5))
    for step in range(1, 4):
        before = weight.detach().clone()
        weight.grad = torch.randn(8, 8)
        optimizer.step()
        scheduler.step()
        rms = before.norm() / 8  # scale_parameter: relative step x the weight's root mean square
        assert scheduler.get_last_lr()[0] == pytest.approx(min(1e-2, step ** -0.5) * float(rms), rel=1e-5)
