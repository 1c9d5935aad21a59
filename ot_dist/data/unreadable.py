"""The limit on unreadable samples (`data.max_bad_fraction`): one rule for concept folders and external tars.

Above the limit the build stops (exit 3), below it the samples are skipped with a warning. Either message names the
first NAMED samples in full and counts the rest: a wrong caption field or an unmounted store can make every one of
millions of samples unreadable, and a message millions of entries long helps nobody (the manifest of a finished
build lists them all)."""

from __future__ import annotations

from ot_dist.errors import InputFileError

NAMED = 20  # unreadable samples named in an error or warning


def named(errors: list[str]) -> str:
    shown = "; ".join(errors[:NAMED])
    return shown + (f"; ... {len(errors) - NAMED} more" if len(errors) > NAMED else "")


def check_unreadable(errors: list[str], total: int, max_bad_fraction: float, noun: str, log=print) -> None:
    """Stop when more than `max_bad_fraction` of the `total` samples (`noun`: images, samples) are unreadable."""
    if not errors:
        return
    if len(errors) > max_bad_fraction * total:
        raise InputFileError(f"{named(errors)} ({len(errors)} of {total} {noun} unreadable, more than "
                             f"data.max_bad_fraction {max_bad_fraction})")
    log(f"warning: data: {len(errors)} of {total} {noun} unreadable, skipped (within data.max_bad_fraction "
        f"{max_bad_fraction}): {named(errors)}")
