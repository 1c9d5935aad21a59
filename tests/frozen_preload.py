"""Imported last by forked_ranks.py's fork server, after the libraries: collect once, then freeze what is left.

Every rank forked from the server inherits ~650 k objects from those imports. Unfrozen, each rank's full
collections walk them again (ot_dist's own `freeze_long_lived_objects` at its first trainer took 0.67 s of a rank,
DeepSpeed's ZeRO-3 `defragment` collects at every engine), and walking them touches their pages, which the fork
then copies per rank. A rank torchrun starts pays the first of these itself; what the test asserts does not depend
on it (ot_dist freezes at its first trainer either way)."""

import gc

gc.collect()
gc.freeze()
