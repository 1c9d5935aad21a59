#!/usr/bin/env bash
# Create .venv/ in the repo and install ot_dist with everything its tests and demo need.
# torch comes first, pinned to the CPU build that lies on this kind of machine: a bare `torch`
# requirement would pull a multi-GB CUDA build. On a GPU machine set TORCH_SPEC (e.g. "torch>=2.6").
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[all]"
echo "setup done: $(.venv/bin/python -c 'import torch, diffusers, transformers; print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, transformers {transformers.__version__}")')"
