#!/usr/bin/env bash
# A short lease of a GPU machine (15 minutes of device time, its start included), as one prepared command: install the
# carried wheels (launch/gpu_wheels.sh), check that ot_dist imports, run `pytest -m gpu` within PYTEST_BUDGET seconds,
# then tests/benchmarks/bench_gpu_levers.py's ENTRIES, in that order, within what is left of BUDGET seconds:
#
#   OUT=$OUT BUDGET=540 ENTRIES="sdxl lora,sdxl lora cuda-graphs" bash launch/gpu_lease.sh
#
# Environment:
#   OUT (default gpu_lease_out); BUDGET (seconds for the whole script, default 540: a call runs 600 at most)
#   PYTEST_BUDGET (default 150; 0 skips the GPU tests); PYTEST_TESTS (default tests: the files or test ids to run);
#   PYTEST_WORKERS (default 4: processes at a time); PYTEST_ISOLATE (default 1: one process per test; 0: pytest-xdist
#   workers, where a CUDA error or a setting one test leaves reaches the rest of its worker's tests);
#   PYTEST_TEST_TIMEOUT (default 90 s a test)
#   ENTRIES (comma-separated labels of the plan; default the whole plan); NO_PROFILE (set: no profiled steps);
#   WARMUP and STEPS (the bench's warmup and timed steps, default 3 and 8); TINY (set: the tiny models, a smoke run
#   on a CPU); WHEELS (default .whl)
# Writes OUT/env.txt, OUT/gpu_test_ids.txt, OUT/pytest_gpu.txt (each test's outcome as it ends),
# OUT/pytest_failures.txt (each failure's reason as it happens), OUT/levers_log.txt and OUT/levers/ (bench.md,
# levers.jsonl, profiles.md): eight files, the most a device call brings back. launch/gpu_check.sh is the longer,
# whole check.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_lease_out}
budget=${BUDGET:-540}
wheels=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if compgen -G "$wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, diffusers, peft, transformers; print('torch', torch.__version__, 'diffusers', \
diffusers.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$out/env.txt"
# every module the bench and the GPU tests need imports (a missing wheel fails here, in seconds, not per test)
python3 -c "import ot_dist.config.schema, ot_dist.bench.run, ot_dist.train.trainer" || exit 1

failed=0
if [ "${PYTEST_BUDGET:-150}" != 0 ]; then
    workers=${PYTEST_WORKERS:-4}
    # Each failure's reason is written as it happens (tests/conftest.py): the budget's kill comes before pytest's
    # summary. No test may take the whole budget (pytest-timeout, which the image has).
    per_test=()
    python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${PYTEST_TEST_TIMEOUT:-90}")
    export OT_DIST_FAILURES="$out/pytest_failures.txt"
    if [ "${PYTEST_ISOLATE:-1}" = 1 ]; then
        # One process per test, WORKERS at a time: a CUDA error, or a process-wide setting a test leaves (the
        # allocator's expandable segments, compiled graphs), reaches no other test. An H200 lease (2026-11-28) saw
        # tests fail after others in one process that had passed one per process on an H100.
        python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider ${PYTEST_TESTS:-tests} 2>/dev/null \
            | grep "::" > "$out/gpu_test_ids.txt"
        [ -s "$out/gpu_test_ids.txt" ] || { echo "no GPU tests collected (an import or collection error?)"; failed=1; }
        export PER_TEST="${per_test[*]}"
        timeout "${PYTEST_BUDGET:-150}" xargs -P "$((workers > 0 ? workers : 1))" -I{} sh -c \
            'r=$(python3 -m pytest -q -rs -p no:cacheprovider $PER_TEST "{}" 2>&1 | tail -1); echo "{}: $r"' \
            < "$out/gpu_test_ids.txt" | tee "$out/pytest_gpu.txt"
        # a line is "TEST_ID: pytest's last line"; only that outcome is read (a test's name may say "error")
        [ "${PIPESTATUS[0]}" -eq 0 ] && ! grep -qE ": .*(failed|error|no tests ran)|: *$" "$out/pytest_gpu.txt" \
            || failed=1
    else
        [ "$workers" = 0 ] && parallel=() || parallel=(-n "$workers")
        timeout "${PYTEST_BUDGET:-150}" python3 -m pytest -v -rfE -m gpu -p no:cacheprovider "${parallel[@]}" \
            "${per_test[@]}" ${PYTEST_TESTS:-tests} 2>&1 \
            | tee "$out/pytest_gpu.txt" | grep -E "(PASSED|FAILED|ERROR|SKIPPED)( |$)|^(FAILED|ERROR) | passed| failed"
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    fi
fi
left=$((budget - SECONDS))
python3 tests/benchmarks/bench_gpu_levers.py --out "$out/levers" --budget "$left" \
    ${ENTRIES:+--only "$ENTRIES"} ${NO_PROFILE:+--no-profile} ${TINY:+--tiny} ${WARMUP:+--warmup "$WARMUP"} \
    ${STEPS:+--steps "$STEPS"} 2>&1 \
    | tee "$out/levers_log.txt" | grep -E "^\||^== |Error"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
exit $failed
