#!/usr/bin/env bash
# On a CUDA machine, one command: install carried wheels (if any), run the GPU tests (`pytest -m gpu`), then the
# bench table of issue 21 (SDXL LoRA / SDXL full finetune / Flux.1 dev LoRA at 1024 px, bf16) into OUT/bench.md.
#
#   WHEELS=dir/with/wheels OUT=gpu_check_out launch/gpu_check.sh
#
# Environment: PYTHON (default python3: the machine's own, with its CUDA build of torch), WHEELS (a folder of
# .whl files installed with --no-index --no-deps first: diffusers, pydantic + pydantic-core, pytest, ...), OUT
# (default gpu_check_out), STEPS / WARMUP (timed / untimed steps per bench, default 10 / 3), batch sizes
# SDXL_LORA_BATCH (8), SDXL_FULL_BATCH (8), FLUX_LORA_BATCH (1), LEVERS (1: also
# tests/benchmarks/bench_gpu_levers.py, the rows and each `performance` lever side by side in one process within
# LEVERS_BUDGET seconds (900): compile, selective checkpointing, batch, float8 matmuls; off by default), PROFILE (steps profiled after the timed ones in each of the three rows, default 2: where the time
# went, OUT/<run>_profile.md, and a trace; 0 turns it off). Exit status: 0 when every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-gpu_check_out}
steps=${STEPS:-10}
warmup=${WARMUP:-3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"

if [ -n "${WHEELS:-}" ]; then
    "$py" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || exit 1
fi
"$py" - <<'PY' || exit 1
import torch
assert torch.cuda.is_available(), "launch/gpu_check.sh needs a CUDA device"
print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
PY

failed=0
echo "== pytest -m gpu"
# -v: each test's name and outcome as it ends (a lease cut short still says which failed); -rfE: each failure's
# reason in the short summary; the JUnit file for tools
"$py" -m pytest -v -rfE -m gpu --continue-on-collection-errors --junitxml "$out/pytest_gpu.xml" tests 2>&1 \
    | tee "$out/pytest_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

bench() {  # one row of the table; a failure (e.g. out of memory) is recorded and the next row still runs
    echo "== ot-dist bench $*"
    "$py" -m ot_dist.cli bench --resolution 1024 --dtype bf16 --steps "$steps" --warmup "$warmup" --out "$out" "$@" \
        2>&1 | tee -a "$out/bench_log.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "| $* | FAILED (see bench_log.txt) |" >> "$out/bench_failures.md"; failed=1; }
}
profile=(--profile "${PROFILE:-2}")
bench --model sdxl --method lora --batch-size "${SDXL_LORA_BATCH:-8}" "${profile[@]}"
bench --model sdxl --method full --gradient-checkpointing --batch-size "${SDXL_FULL_BATCH:-8}" "${profile[@]}"
bench --model flux-dev --method lora --batch-size "${FLUX_LORA_BATCH:-1}" "${profile[@]}"

if [ "${LEVERS:-0}" = 1 ]; then  # which lever closes the gap to the targets: side by side in one process
    echo "== levers (tests/benchmarks/bench_gpu_levers.py)"
    "$py" tests/benchmarks/bench_gpu_levers.py --out "$out/levers" --budget "${LEVERS_BUDGET:-900}" \
        2>&1 | tee -a "$out/bench_log.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
fi

echo "== table ($out/bench.md)"
cat "$out/bench.md" 2>/dev/null
[ -f "$out/bench_failures.md" ] && cat "$out/bench_failures.md"
exit $failed
