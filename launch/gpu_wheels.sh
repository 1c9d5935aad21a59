#!/usr/bin/env bash
# Download, here, the wheels a lent GPU machine lacks (python 3.12, x86-64 manylinux; nothing can be fetched there),
# at the versions this checkout's .venv runs, into DIR (default .whl, which .git/info/exclude should ignore):
#
#   launch/gpu_wheels.sh [DIR]        # BNB=0 leaves bitsandbytes out (43 MB of the 64 MiB a device call carries)
#
# The machine has torch 2.11 (CUDA), transformers, accelerate, safetensors, numpy, pytest and their needs; the wheels
# are what ot_dist imports beyond those: diffusers, peft, pydantic (with pydantic-core, typing-inspection and
# annotated-types, which it imports at once), torchao (float8 matmuls), webdataset + braceexpand, prodigyopt,
# bitsandbytes (nf4 storage, 8-bit optimizers), and DeepSpeed (the ZeRO strategies; no wheel on the registry, so one is
# built here without its ops, which it builds when first used; DS=0 leaves it out) with what it imports that the
# machine lacks (hjson, py-cpuinfo, msgpack, einops, ninja). launch/gpu_lease.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
names=(diffusers peft pydantic pydantic_core typing_inspection annotated_types torchao webdataset braceexpand prodigyopt)
[ "${BNB:-1}" = 1 ] && names+=(bitsandbytes)
[ "${DS:-1}" = 1 ] && names+=(hjson py-cpuinfo msgpack einops ninja)
specs=()
for name in "${names[@]}"; do
    version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    specs+=("$name==$version")
done
mkdir -p "$dir"
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$dir" "${specs[@]}"
if [ "${DS:-1}" = 1 ]; then  # a pure-python wheel (py3-none-any), built against this checkout's torch
    DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" \
        "deepspeed==$("$py" -c "import importlib.metadata as m; print(m.version('deepspeed'))")"
fi
du -sh "$dir"
