"""Moving from other trainers: `ot-dist import onetrainer` turns a OneTrainer config into an ot_dist one."""
