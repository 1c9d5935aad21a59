from ot_dist.cli import entry

entry()
