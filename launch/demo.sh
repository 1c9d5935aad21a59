#!/usr/bin/env bash
# The demo, one command on a fresh machine: set up, create the tiny SD model and the shapes
# dataset, train a full finetune on 2 CPU processes (FSDP2), export a diffusers folder and a
# single-file checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/ot-dist demo prepare --root demo_out
.venv/bin/ot-dist launch configs/demo.yaml --nproc-per-node 2 "$@"
