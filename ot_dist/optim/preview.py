"""`ot-dist schedule`: the learning rate of every parameter group at every optimizer step, computed by
the same optimizer class and scheduler the trainer builds (on one stand-in tensor per group), so the
preview is what training applies, before any model is loaded."""

from __future__ import annotations

import csv
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ot_dist.config.optim import CYCLIC, planned_groups
from ot_dist.methods.base import ParamGroup
from ot_dist.optim.factory import build_optimizer
from ot_dist.optim.schedulers import adafactor_relative_step, build_scheduler, cycle_lows
from ot_dist.train.steps import StepPlan


@dataclass
class Schedule:
    groups: list[str]
    rows: list[list[float]]  # rows[i][g]: learning rate of group g during optimizer step i + 1
    plan: StepPlan
    warmup: int
    lows: list[int]  # cycle lows (1-based steps), empty for schedules without cycles
    note: str = ""


def compute_schedule(config, plan: StepPlan) -> Schedule:
    groups = planned_groups(config)
    names = [name for name, _, _ in groups]
    sched = config.scheduler
    accumulation = config.gradient_accumulation_steps
    warmup = sched.resolved_warmup(plan.total_steps, accumulation)
    if sched.name == "ADAFACTOR":
        warmup_init = config.optimizer.warmup_init
        rows = [[adafactor_relative_step(i + 1, warmup_init)] * len(names) for i in range(plan.total_steps)]
        note = "Adafactor's relative step size" + (
            ", times each parameter's root mean square (scale_parameter)" if config.optimizer.scale_parameter else ""
        )
        zero_after_stops(config, names, rows, plan)
        return Schedule(names, rows, plan, warmup, [], note)
    stand_ins = [ParamGroup(name, [torch.nn.Parameter(torch.zeros(1))], lr) for name, lr, _ in groups]
    optimizer = build_optimizer(config.optimizer, stand_ins)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": nothing trains here
        scheduler = build_scheduler(config, optimizer, plan)
        rows = []
        for step in range(plan.total_steps):
            rows.append([float(group["lr"]) for group in optimizer.param_groups])
            scheduler.step()
    stops = zero_after_stops(config, names, rows, plan)
    lows = cycle_lows(sched, plan.total_steps, accumulation) if sched.name in CYCLIC else []
    notes = []
    if config.optimizer.adaptive:
        notes.append("lr is a multiplier on the step size the optimizer estimates (d*lr is what is applied)")
    for g, part in stops:
        notes.append(f"{names[g]} stops training after {part.stop_training_after} {part.stop_training_after_unit}s "
                     "(lr 0 from then on)")
    note = "; ".join(notes)
    return Schedule(names, rows, plan, warmup, lows, note)


def zero_after_stops(config, names: list[str], rows: list[list[float]], plan: StepPlan) -> list[tuple[int, object]]:
    """Set to 0 the learning rate of a part from the step it stops training (stop_training_after, the trainer's
    rule: a stopped part applies nothing, and its logged lr is 0). Returns (column, part config) of such parts."""
    stops = []
    for g, name in enumerate(names):
        part = config.stop_rule(name)
        if getattr(part, "stop_training_after", None) is not None:
            stops.append((g, part))
    for step, row in enumerate(rows):
        epoch = step // max(1, plan.steps_per_epoch)
        for g, part in stops:
            if part.stopped(epoch, step):
                row[g] = 0.0
    return stops


def write_csv(schedule: Schedule, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step"] + [f"lr/{name}" for name in schedule.groups])
        for i, row in enumerate(schedule.rows):
            writer.writerow([i + 1] + [repr(v) for v in row])


def format_table(schedule: Schedule) -> str:
    header = "step " + " ".join(f"lr/{name}" for name in schedule.groups)
    rows = [f"{i + 1} " + " ".join(f"{v:.6g}" for v in row) for i, row in enumerate(schedule.rows)]
    return "\n".join([header] + rows)


def plot(schedule: Schedule, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(schedule.rows) + 1)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    for g, name in enumerate(schedule.groups):
        ax.plot(steps, [row[g] for row in schedule.rows], label=f"lr/{name}", linewidth=1.5)
    if schedule.warmup:
        ax.axvline(schedule.warmup, color="grey", linestyle=":", linewidth=1,
                   label=f"end of warmup ({schedule.warmup})")
    if schedule.lows:
        ax.scatter(schedule.lows, [schedule.rows[s - 1][0] for s in schedule.lows], color="black", marker="v",
                   zorder=3, label=f"cycle lows ({len(schedule.lows)})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(title + (f"\n{schedule.note}" if schedule.note else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)



def schedule_command(config, steps: int | None, world_size: int, csv_path: str | None, plot_path: str | None) -> None:
    """Count the steps as the trainer does (or take --steps), then print or write the table and plot it."""
    from ot_dist.data.training_data import planned_table
    from ot_dist.errors import InputFileError
    from ot_dist.optim.adaptive import startup_warnings
    from ot_dist.train.steps import plan_steps

    if steps is not None:
        if steps < 1:
            raise InputFileError("--steps: must be at least 1")
        plan = StepPlan(0, config.batch_size * config.gradient_accumulation_steps * world_size,
                        max(1, steps // config.epochs), steps)
    else:
        try:
            bucket_sizes = planned_table(config, world_size).epoch_sizes().values()
        except InputFileError as err:
            raise InputFileError(f"{err} (without the data, give the step count: --steps N)") from None
        plan = plan_steps(config, bucket_sizes, world_size)
    schedule = compute_schedule(config, plan)
    summary = (f"{config.scheduler.name} over {plan.total_steps} optimizer steps ({plan.steps_per_epoch} per epoch, "
               f"global batch {plan.global_batch}), warmup {schedule.warmup}, optimizer {config.optimizer.name}")
    # Files first: a reader that stops early (`| head`) must not cost the CSV or the plot.
    if csv_path:
        write_csv(schedule, Path(csv_path))
    if plot_path:
        from ot_dist.extras import require

        require("matplotlib", f"--plot {plot_path}:")
        plot(schedule, Path(plot_path), summary)
    if not csv_path:
        print(format_table(schedule))
    print(summary)
    if schedule.note:
        print(f"note: {schedule.note}")
    if schedule.lows:
        snapshots = " (snapshots at all but the last step)" if config.scheduler.snapshot_at_cycle_lows else ""
        print(f"cycle lows{snapshots}: {', '.join(map(str, schedule.lows))}")
    for warning in startup_warnings(config):
        print(f"warning: {warning}")
    if csv_path:
        print(f"wrote {csv_path}")
    if plot_path:
        print(f"wrote {plot_path}")
