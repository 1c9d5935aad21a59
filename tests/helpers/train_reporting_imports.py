"""`ot-dist train` that afterwards records, per rank, whether MLflow was ever imported: only rank 0
may track, so no other rank may even load the library. Run under torchrun by the tracking test."""

import json
import os
import sys

from ot_dist.cli import main

code = main(sys.argv[1:])
report = {"mlflow_imported": any(name == "mlflow" or name.startswith("mlflow.") for name in sys.modules)}
with open(os.path.join(os.environ["IMPORT_REPORT_DIR"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(report, f)
sys.exit(code)
