"""Crash a checkpoint save between the shard writes and the commit, in forked children, and check
after each crash that the previous checkpoint is still `latest` and loads.

    crash_before_commit.py CONFIG_JSON RESULT_JSON TRIALS

The config trains 1 step and saves it (committed step 1). Each trial forks a child that saves again
and dies (os._exit) at one of three points: after every shard file is written but before the marker;
halfway through writing the marker; after the marker, before the folder is renamed into place."""

import json
import os
import sys

import torch

from ot_dist.checkpoint import layout
from ot_dist.checkpoint.layout import MARKER, checkpoints_dir, latest_checkpoint, resolve_resume
from ot_dist.config.load import validate
from ot_dist.train.trainer import Trainer

CRASH = 86


def crash_at(point: str) -> None:
    """Replace the next step of the commit with a hard exit (a killed process runs no cleanup)."""
    if point == "before-marker":
        layout.commit = lambda *a, **k: os._exit(CRASH)
    elif point == "torn-marker":
        original = layout.write_file_durably

        def torn(path, data):
            if path.name != MARKER:
                return original(path, data)
            with open(path, "wb") as f:  # half a marker, as a power cut mid-write would leave it
                f.write(data[: len(data) // 2])
            os._exit(CRASH)

        layout.write_file_durably = torn
    else:  # "before-rename": the marker is complete in the partial folder, the folder is not yet `step-N`
        original_replace = os.replace

        def crash_on_folder_rename(src, dst, *args, **kwargs):
            if os.path.isdir(src):  # the marker itself is also written by a replace (of its temp file)
                os._exit(CRASH)
            return original_replace(src, dst, *args, **kwargs)

        layout.os.replace = crash_on_folder_rename


def marker_state(path, step: int) -> str:
    """What a crash left of the marker: absent, torn (unreadable), or complete (names this save's step)."""
    if not path.is_file():
        return "absent"
    try:
        return "complete" if json.loads(path.read_text())["step"] == step else "other"
    except ValueError:
        return "torn"


if __name__ == "__main__":
    torch.set_num_threads(1)  # forked children of a multi-threaded parent must not inherit a busy pool
    config = validate(json.loads(open(sys.argv[1]).read()))
    trials = int(sys.argv[3])
    trainer = Trainer(config, log=lambda *_: None)
    trainer.train()  # 1 step, saved at the end: the committed checkpoint every crash must leave intact
    root = checkpoints_dir(config.output_dir)
    good = latest_checkpoint(root)
    weights = {n: p.detach().clone() for n, p in trainer.strategy.trained_parameters().items()}
    results = []
    for trial in range(trials):
        point = ("before-marker", "torn-marker", "before-rename")[trial % 3]
        with torch.no_grad():  # the state the crashed save would have held differs from the committed one
            for p in trainer.strategy.trained_parameters().values():
                p.add_(1.0)
        child = os.fork()
        if child == 0:
            crash_at(point)
            trainer.checkpointer.save(100 + trial, 0, "crash test")
            trainer.checkpointer.wait()  # written in the background by default: the crash comes in that thread
            os._exit(0)  # not crashed: the test fails on the exit code
        _, status = os.waitpid(child, 0)
        latest = latest_checkpoint(root)
        pointer = (root / layout.LATEST).read_text().strip()
        loaded = trainer.checkpointer.load(resolve_resume("auto", config.output_dir))
        same = all(torch.equal(p, weights[n]) for n, p in trainer.strategy.trained_parameters().items())
        leftovers = sorted(p.name for p in root.iterdir() if p.name.endswith(".partial"))
        this_attempt = layout.partial_dir(root, 100 + trial)
        marker_left = marker_state(this_attempt / MARKER, 100 + trial)
        results.append({"point": point, "marker_left": marker_left,
                        "exit": os.waitstatus_to_exitcode(status), "latest": latest.name,
                        "pointer": pointer, "loaded_step": loaded.step, "weights_restored": same, "partial": leftovers})
    after = trainer.checkpointer.save(500, 0, "after the crashes")  # a real save commits and sweeps the debris
    trainer.checkpointer.wait()
    leftovers = sorted(p.name for p in root.iterdir() if p.name.endswith(".partial"))
    json.dump({"good": good.name, "trials": results, "after": after.name, "latest_after": latest_checkpoint(root).name,
               "partial_after": leftovers}, open(sys.argv[2], "w"))
