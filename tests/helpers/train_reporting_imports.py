"""`ot-dist train` that afterwards records, per rank, whether it tracked (loaded ot_dist's MLflow
tracker) and whether it ever imported MLflow: only rank 0 may track, and no training process loads
MLflow itself (rank 0's sender process does). Run by the tracking test as 2 ranks, each in a fresh interpreter
with the environment torchrun gives (tests/forked_ranks.py run_ranks, fork=False)."""

import json
import os
import sys

from ot_dist.cli import main

code = main(sys.argv[1:])
report = {"tracks": "ot_dist.tracking.mlflow_tracker" in sys.modules,
          "mlflow_imported": any(name == "mlflow" or name.startswith("mlflow.") for name in sys.modules)}
with open(os.path.join(os.environ["IMPORT_REPORT_DIR"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(report, f)
from ot_dist.parallel.runtime import exit_process  # noqa: E402

exit_process(code)
