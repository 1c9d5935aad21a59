"""Send what a run could not deliver to MLflow (its outbox file, named by the run's warning):

    python -m ot_dist.tracking.replay OUTPUT_DIR/mlflow-outbox/RUN.jsonl [--tracking-uri URI]

To the server the run meant (the same run continues where delivery stopped) or, with
--tracking-uri, anywhere else, e.g. a local store `sqlite:///PATH/mlflow.db` (a new run there,
tagged `ot_dist.replayed_from`). A delivered outbox is removed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ot_dist.tracking.outbox import read_records, remove_delivered, summary


def replay(path: Path, uri: str | None = None) -> tuple[str, str, str]:
    """Deliver the outbox at `path`; returns (uri, run id, what was sent). Raises on failure (what
    was delivered until then is noted, so running it again continues)."""
    from ot_dist.tracking.delivery import Delivery

    entries = read_records(path, 0)
    if not entries or entries[0][1]["kind"] != "run":
        raise ValueError(f"{path}: not an ot_dist MLflow outbox (no run record first)")
    uri = uri or entries[0][1]["uri"]
    delivery = Delivery(path, uri)
    left = [e for e in entries if e[0] > delivery.offset]
    delivery.deliver(left)
    if not any(record["kind"] == "end" for _, record in entries):
        delivery.end_run("FAILED")  # its training process died before it could end the run
    remove_delivered(path)
    return uri, delivery.run_id, summary([record for _, record in left])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ot_dist.tracking.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("outbox", type=Path, help="the outbox file the run's warning named")
    parser.add_argument("--tracking-uri", default=None, help="where to send it (default: where the run meant to)")
    args = parser.parse_args(argv)
    if not args.outbox.is_file():
        print(f"error: {args.outbox}: no such outbox file", file=sys.stderr)
        return 3
    uri, run_id, sent = replay(args.outbox, args.tracking_uri)
    print(f"sent {sent} to {uri}, run {run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
