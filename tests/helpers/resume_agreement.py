"""`--resume` resolved by 2 ranks that see the checkpoints folder differently (a network filesystem's attribute
cache on one node): each scenario runs prepare_run_folder on every rank with rank 1's view changed, and records
the checkpoint each rank would resume from, or the error it raised.

    resume_agreement.py ROOT RESULT_JSON

ROOT holds one output_dir per scenario (made by the test), each with committed checkpoints of steps 2 and 4:
  stale_listing:  rank 1 lists step 2 as the newest (step 4 not yet visible in its listing);
  restart_choice: rank 1 was given `--resume <step 2>` where rank 0 got `auto` (cli.resume_choice decides on each
                  rank before the process group exists, from that rank's listing);
  late:           rank 1 sees step 4's marker only at its third look (its node's cached listing expires meanwhile);
  unseen:         rank 1 cannot see step 4 at all (no marker there) and lists step 2 as the newest, within the wait;
  damaged:        a damaged step 6 (no marker) is the newest: rank 0 refuses, and so must every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ot_dist.checkpoint import layout, run_folder
from ot_dist.errors import UserError
from ot_dist.parallel.runtime import exit_process, gather_objects, start_runtime

SCENARIOS = ("stale_listing", "restart_choice", "late", "unseen", "damaged")


def quiet(*_args, **_kwargs):
    pass


def one(out: Path, scenario: str, runtime) -> dict:
    original_latest, original_sees = layout.latest_checkpoint, getattr(run_folder, "sees_committed", None)
    step_2 = layout.checkpoints_dir(out) / layout.final_name(2)
    resume = "auto"
    if runtime.rank == 1:
        if scenario in ("stale_listing", "unseen"):
            layout.latest_checkpoint = lambda root: step_2 if root == layout.checkpoints_dir(out) else original_latest(root)
        if scenario == "unseen":
            run_folder.sees_committed = lambda folder: folder.name != layout.final_name(4)
        if scenario == "late":
            looks = []
            run_folder.sees_committed = lambda folder: looks.append(folder) or len(looks) >= 3
        if scenario == "restart_choice":
            resume = str(step_2)
    try:
        prepared = run_folder.prepare_run_folder(out, resume, False, runtime, log=quiet)
        return {"folder": prepared.resume_from.name if prepared.resume_from else None, "error": None}
    except UserError as err:
        return {"folder": None, "error": f"{type(err).__name__}: {err}"}
    finally:
        layout.latest_checkpoint = original_latest
        if original_sees is not None:
            run_folder.sees_committed = original_sees


if __name__ == "__main__":
    root, result = Path(sys.argv[1]), Path(sys.argv[2])
    runtime = start_runtime(5)
    run_folder.MARKER_WAIT_S = 3.0  # the unseen scenario's wait (the late one sees it after 0.75 s)
    found = {scenario: gather_objects(one(root / scenario, scenario, runtime)) for scenario in SCENARIOS}
    if runtime.is_main:
        result.write_text(json.dumps(found))
    runtime.shutdown()
    exit_process(0)
