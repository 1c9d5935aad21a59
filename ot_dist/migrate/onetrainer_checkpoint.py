"""OneTrainer's backups and saves as ot_dist's `checkpoint` section (intervals and how many are kept)."""

from __future__ import annotations

MINUTES = {"SECOND": 1 / 60, "MINUTE": 1, "HOUR": 60}


def import_checkpoint(ot: dict, c: dict, skip) -> None:
    """OneTrainer writes two things on a clock: backups (resumable; backup_after, default every 30 minutes, all kept
    unless rolling_backup keeps rolling_backup_count) and saves (the model, save_every, all kept). ot_dist writes
    resumable checkpoints (`ot-dist export` makes the model files of any of them): one interval of each kind, and a
    save interval keeps every checkpoint."""
    checkpoint = {}
    intervals = (("save_every", ot["save_every_unit"], ot["save_every"]),
                 ("backup_after", ot["backup_after_unit"], ot["backup_after"]))
    for key, unit, every in intervals:
        if unit == "NEVER" or not every:
            continue
        if unit in MINUTES:
            setting, value = "every_n_minutes", every * MINUTES[unit]
        elif unit in ("STEP", "EPOCH"):
            setting, value = f"every_n_{unit.lower()}s", int(every)
        else:
            skip(f"{key}_unit: {unit} is not supported")
            continue
        if setting in checkpoint and checkpoint[setting] != value:
            skip(f"{key}: {every} {unit}: ot_dist has one {setting}; the save interval ({checkpoint[setting]}) is used")
            continue
        checkpoint[setting] = value
    if "every_n_minutes" not in checkpoint:
        checkpoint["every_n_minutes"] = None  # no time-based backups (ot_dist's default is 30 minutes)
    saves = ot["save_every_unit"] != "NEVER" and ot["save_every"]
    checkpoint["keep_last"] = ot["rolling_backup_count"] if ot["rolling_backup"] and not saves else None
    for key in ("save_skip_first", "save_filename_prefix"):
        if ot.get(key):
            skip(f"{key}: {ot[key]!r} is not supported")
    c["checkpoint"] = checkpoint
