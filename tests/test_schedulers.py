"""Learning-rate schedules: each curve matches its definition at the end of warmup, at cycle boundaries and
at the last step; CUSTOM reproduces the torch scheduler it names; cycle lows fall where the snapshots go;
config errors name the key."""

from __future__ import annotations


import pytest
import torch

from ot_dist.config.load import validate
from ot_dist.config.optim import CYCLIC, DECAYING, SchedulerConfig
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


def rex(x):
    return (1 - x) / (0.1 + 0.9 * (1 - x))


# OneTrainer's factor at optimizer step s (0-based), computed by OneTrainer's own code: the lr_lambda_* functions
# of modules/util/lr_scheduler_util.py wrapped in lr_lambda_warmup, with the warmup converted as
# modules/util/create.py create_lr_scheduler does (> 1: int(warmup / accumulation); <= 1: int(warmup x total)),
# at Nerogar/OneTrainer 23df3832e8f213d64c337e39f9365ba46e99fed0. Columns: name, total optimizer steps,
# learning_rate_warmup_steps, gradient_accumulation_steps, learning_rate_cycles, learning_rate_min_factor,
# {step: factor}.
ONETRAINER = [
    ('CONSTANT', 100, 10, 1, 1.0, 0.0, {0: 0.0, 1: 0.1, 9: 0.9, 10: 1.0, 11: 1.0, 40: 1.0, 55: 1.0, 98: 1.0, 99: 1.0}),
    ('CONSTANT', 100, 40, 4, 1.0, 0.0, {0: 0.0, 1: 0.1, 9: 0.9, 10: 1.0, 11: 1.0, 40: 1.0, 55: 1.0, 98: 1.0, 99: 1.0}),
    ('LINEAR', 100, 10, 1, 1.0, 0.0, {0: 0.0, 1: 0.1, 9: 0.9, 10: 1.0, 11: 0.9888888888888889, 40: 0.6666666666666666, 55: 0.5, 98: 0.022222222222222223, 99: 0.011111111111111112}),
    ('LINEAR', 200, 0.1, 1, 1.0, 0.2, {0: 0.0, 1: 0.05, 19: 0.95, 20: 1.0, 21: 0.9955555555555555, 80: 0.7333333333333334, 110: 0.6000000000000001, 198: 0.2088888888888889, 199: 0.20444444444444446}),
    ('COSINE', 100, 10, 2, 1.0, 0.1, {0: 0.0, 1: 0.2, 4: 0.8, 5: 1.0, 6: 0.9997539658034167, 36: 0.7835363082015468, 52: 0.5574402751448614, 98: 0.10098386775155146, 99: 0.10024603419658329}),
    ('COSINE', 77, 0, 1, 1.0, 0.0, {0: 1.0, 1: 0.9995838996722914, 25: 0.761683991848306, 38: 0.5101992686957028, 75: 0.0016637087529033923, 76: 0.0004161003277085573}),
    ('COSINE_WITH_RESTARTS', 1000, 0, 1, 3.0, 0.0, {0: 1.0, 1: 0.9999111761904045, 167: 9.869571931442334e-06, 250: 0.4999999999999999, 333: 0.9999901304280685, 500: 0.0, 833: 9.869571931442334e-06, 998: 0.9996447363202946, 999: 0.9999111761904045}),
    ('COSINE_WITH_RESTARTS', 10000, 0, 1, 20.0, 0.0, {0: 1.0, 1: 0.9999605221019081, 250: 0.0, 499: 0.9999605221019081, 500: 1.0, 750: 0.0, 3333: 0.24818839918212, 5000: 1.0, 9750: 0.0, 9998: 0.9998420946416497, 9999: 0.999960522101908}),
    ('COSINE_WITH_RESTARTS', 100, 10, 1, 2.5, 0.05, {0: 0.0, 1: 0.1, 9: 0.9, 10: 1.0, 11: 0.9927836826807989, 40: 0.7624999999999997, 55: 0.5250000000000001, 98: 0.07864600512669355, 99: 0.057216317319201196}),
    ('COSINE_WITH_HARD_RESTARTS', 100, 10, 1, 3.0, 0.0, {0: 0.0, 1: 0.1, 9: 0.9, 10: 1.0, 11: 0.9972609476841366, 40: 1.0, 55: 0.5, 98: 0.010926199633097267, 99: 0.0027390523158632996}),
    ('COSINE_WITH_HARD_RESTARTS', 10000, 200, 2, 20.0, 0.1, {0: 0.0, 1: 0.01, 99: 0.99, 100: 1.0, 101: 0.9999909370328078, 250: 0.8110256093070393, 499: 0.18097251162211403, 500: 0.17934553835657518, 750: 0.7992640287397497, 3400: 0.32500000000000084, 5050: 1.0, 9750: 0.5571396837256638, 9998: 0.1000362515037133, 9999: 0.10000906296719207}),
    ('REX', 100, 20, 4, 1.0, 0.0, {0: 0.0, 1: 0.2, 4: 0.8, 5: 1.0, 6: 0.9989373007438894, 36: 0.9538002980625931, 52: 0.9108159392789373, 98: 0.1769911504424776, 99: 0.09615384615384645}),
    ('REX', 50, 0, 1, 1.0, 0.3, {0: 1.0, 1: 0.9985743380855396, 16: 0.9685393258426966, 25: 0.9363636363636363, 48: 0.5058823529411767, 49: 0.41864406779661023}),
]


@pytest.mark.parametrize("name,total,warmup,accumulation,cycles,min_factor,expected", ONETRAINER)
def test_factors_equal_onetrainers(name, total, warmup, accumulation, cycles, min_factor, expected):
    options = {}
    if name in CYCLIC:
        options["cycles"] = cycles
    if name in DECAYING:
        options["min_factor"] = min_factor
    config = SchedulerConfig(name=name, warmup_steps=warmup, **options)
    for step, factor in expected.items():
        ours = lr_factor(config, step, total, accumulation)
        assert ours == pytest.approx(factor, rel=1e-6, abs=1e-12), (name, step, ours, factor)


def test_rex_with_restarts_is_rex_over_each_cycle():
    """ot_dist's own (OneTrainer has no REX with restarts): REX of (n p) mod 1, p as COSINE_WITH_HARD_RESTARTS."""
    config = SchedulerConfig(name="REX_WITH_RESTARTS", warmup_steps=10, cycles=3, min_factor=0.5)
    values = [lr_factor(config, s, 100) for s in range(100)]
    assert values[:10] == [s / 10 for s in range(10)]
    for step, expected in {10: 1.0, 39: rex(29 / 30), 40: 1.0, 55: rex(0.5), 99: rex(29 / 30)}.items():
        assert values[step] == pytest.approx(0.5 + 0.5 * expected, abs=1e-12), step


def test_warmup_fraction_and_micro_steps():
    assert SchedulerConfig(warmup_steps=0.25).resolved_warmup(200) == 50
    assert SchedulerConfig(warmup_steps=1).resolved_warmup(200) == 200  # <= 1 is a fraction: the whole run
    assert SchedulerConfig(warmup_steps=30).resolved_warmup(200) == 30
    # A count is in micro steps, as OneTrainer counts it: 30 with accumulation 4 is 7 optimizer steps.
    assert SchedulerConfig(warmup_steps=30).resolved_warmup(200, accumulation=4) == 7
    assert SchedulerConfig(warmup_steps=0.25).resolved_warmup(200, accumulation=4) == 50
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
    assert warmed[0] == [0.0, 0.0]  # OneTrainer's warmup: step / warmup
    assert warmed[9] == pytest.approx([1e-4 * 9 / 10, 1e-3 * 9 / 10])


@pytest.mark.parametrize("class_name,params", [
    ("MultiStepLR", {"milestones": [3, 6], "gamma": 0.5}),
    ("LinearLR", {"start_factor": 0.5, "total_iters": 3}),  # the class's first lr is not the base lr
    ("ConstantLR", {"factor": 0.25, "total_iters": 5}),
    ("CyclicLR", {"base_lr": 1e-5, "max_lr": 1e-3, "step_size_up": 3, "cycle_momentum": False}),  # no closed form
    ("OneCycleLR", {"max_lr": 1e-3, "total_steps": 14, "cycle_momentum": False}),  # sets initial_lr itself
])
def test_custom_with_warmup_equals_onetrainers_sequential_lr(class_name, params):
    """OneTrainer (create.create_lr_scheduler, CUSTOM): the class built with last_epoch -1, then a LambdaLR of
    lr_lambda_warmup(warmup, constant) and SequentialLR(milestones=[warmup]); here run with torch directly. The warmup
    climbs to each group's initial_lr, and at the milestone the class starts at its step 0."""
    custom = {"name": "CUSTOM", "class_name": f"torch.optim.lr_scheduler.{class_name}", "params": params,
              "warmup_steps": 8}
    config = validate({**MINIMAL, "gradient_accumulation_steps": 2, "scheduler": custom})  # 8 micro = 4 steps
    ours = applied_lrs(config, optimizer_with_groups([1e-4, 1e-3]), 14)
    reference_optimizer = optimizer_with_groups([1e-4, 1e-3])
    inner = getattr(torch.optim.lr_scheduler, class_name)(optimizer=reference_optimizer, last_epoch=-1, **params)
    warm = torch.optim.lr_scheduler.LambdaLR(reference_optimizer, lambda s: s / 4 if s < 4 else 1, last_epoch=-1)
    reference = torch.optim.lr_scheduler.SequentialLR(reference_optimizer, [warm, inner], milestones=[4], last_epoch=-1)
    expected = []
    for _ in range(14):
        expected.append([g["lr"] for g in reference_optimizer.param_groups])
        reference_optimizer.step()
        reference.step()
    for step, (row, reference_row) in enumerate(zip(ours, expected, strict=True)):
        assert row == pytest.approx(reference_row, rel=1e-12), step
    if class_name == "MultiStepLR":
        assert [row[0] / 1e-4 for row in ours] == pytest.approx([0, 0.25, 0.5, 0.75, 1, 1, 1, 0.5, 0.5, 0.5, 0.25,
                                                                  0.25, 0.25, 0.25])
    if class_name == "LinearLR":  # the warmup reaches the base lr; then LinearLR starts at half of it
        assert [row[0] / 1e-4 for row in ours[:8]] == pytest.approx([0, 0.25, 0.5, 0.75, 0.5, 2 / 3, 5 / 6, 1])


def test_steps_per_epoch_placeholder_counts_batches_before_accumulation():
    """OneTrainer fills %STEPS_PER_EPOCH% with its data loader's length (create.create_lr_scheduler's
    approximate_epoch_length): the batches one process draws per epoch, before gradient accumulation, while the
    schedule steps once per optimizer step. 10 optimizer steps per epoch with accumulation 4 are 40 batches."""
    custom = {"name": "CUSTOM", "class_name": "torch.optim.lr_scheduler.StepLR",
              "params": {"step_size": "%STEPS_PER_EPOCH%", "gamma": 0.5}}
    config = validate({**MINIMAL, "epochs": 5, "gradient_accumulation_steps": 4, "scheduler": custom})
    lrs = [row[0] for row in applied_lrs(config, optimizer_with_groups([1.0]), 50, StepPlan(160, 4, 10, 50))]
    assert lrs == [1.0] * 40 + [0.5] * 10


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


@pytest.mark.parametrize("name,first", [("COSINE_WITH_HARD_RESTARTS", 500), ("REX_WITH_RESTARTS", 500),
                                        ("COSINE_WITH_RESTARTS", 251)])
def test_cycle_lows_of_the_seed_example(name, first):
    """Seed 003: 10000 steps with 20 cycles: 20 lows 500 steps apart, each where the learning rate is lowest
    (OneTrainer's smooth COSINE_WITH_RESTARTS has its lows mid-cycle, at 0-based steps 250, 750, ...)."""
    config = SchedulerConfig(name=name, cycles=20)
    assert cycle_lows(config, 10000) == list(range(first, 10001, 500))
    # After a warmup the cycles start later.
    warm = SchedulerConfig(name=name, cycles=20, warmup_steps=100)
    assert cycle_lows(warm, 10100) == list(range(first + 100, 10101, 500))


def test_cycle_lows_are_the_lowest_step_of_each_cycle():
    config = SchedulerConfig(name="COSINE_WITH_RESTARTS", cycles=3, warmup_steps=WARMUP)
    values = factors("COSINE_WITH_RESTARTS", cycles=3)
    lows = cycle_lows(config, TOTAL)
    assert lows == [26, 56, 86]  # 1-based: the step that ran at the bottom (0-based 25, 55, 85: 15, 45, 75 after warmup)
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
    config = validate({**MINIMAL, "optimizer": {"name": "ADAFACTOR", "relative_step": True, "scale_parameter": True},
                       "scheduler": {"name": "ADAFACTOR"}})
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
