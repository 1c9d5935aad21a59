"""Host memory and time of loading a bfloat16 model for LoRA training, before and after loading in the files' dtype
(ot_dist/models/load_dtype.py; not a pytest test).

Builds a diffusers folder whose denoiser is real-size and whose other components are the tiny ones (their share of a
real model scales the same way): SDXL's UNet (2.57 B parameters), and Flux.1's transformer at its real width with
fewer blocks (`--flux-blocks`, double and single; 19 and 38 in the real one), the latter also as Black Forest Labs'
single file beside a config folder. Every weight file holds bfloat16, as the published models do. Then, each in a
fresh process, what the trainer does before placement: `load_model`, LoRA's `prepare`, `store_component` of every
component (frozen weights stored in bfloat16), then reads every weight once (placement would), and reports the
process's peak RSS above its RSS after the imports (VmHWM, so the peak counts even where it lasted a moment; it counts
the pages of a mapped weight file once read) and the seconds the load took. `--before REV` runs the same
in a git worktree of that revision (the float32 load).

    python tests/benchmarks/bench_load_memory.py [--before 2ee4e19] [--flux-blocks 2,4] [--out docs/...json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MEASURE = r"""
import json, sys, time
import torch
from ot_dist.config.load import validate
from ot_dist.memory.placement import store_component
from ot_dist.methods.registry import build_method
from ot_dist.models.loading import load_model

def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

raw = json.loads(sys.argv[1])
config = validate(raw)
before = status_kib("VmRSS")
start = time.perf_counter()
import inspect  # as the trainer loads: in the files' dtype where this revision can (its keyword), else float32
options = {"in_files_dtype": True} if "in_files_dtype" in inspect.signature(load_model).parameters else {}
model = load_model(config.model, **options)
read_in = sorted({str(p.dtype) for p in model.denoiser.parameters()})
torch.manual_seed(0)
build_method(config).prepare(model)
for name, module in model.named_components():
    store_component(module, name, config, denoiser=module is model.denoiser)
seconds = time.perf_counter() - start
# Every weight read once, as placement or the first step reads it: a weight read in its files' dtype is a view of the
# mapped file until then, whose pages count only once touched.
with torch.no_grad():
    for name, module in model.named_components():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.sum()
params = sum(p.numel() for p in model.denoiser.parameters())
peak = status_kib("VmHWM")  # the mm's high-water mark: new at exec (ru_maxrss keeps the forking parent's)
print(json.dumps({"peak_gib": (peak - before) / 2**20, "seconds": seconds, "read_in": read_in,
                  "denoiser_parameters": params}))
"""


def build_cases(root: Path, flux_blocks: tuple[int, int]) -> dict[str, dict]:
    """case name -> the model section of its config."""
    import torch
    from safetensors.torch import save_file

    from ot_dist.bench.architectures import FLUX_DEV, SDXL_UNET
    from ot_dist.models.families.flux_single_file import FLUX
    from ot_dist.models.tiny import build_tiny_pipeline

    cases = {}
    for name, family, config in (("sdxl", "sdxl", SDXL_UNET),
                                 ("flux", "flux", {**FLUX_DEV, "num_layers": flux_blocks[0],
                                                   "num_single_layers": flux_blocks[1]})):
        folder = root / name
        if not (folder / "model_index.json").is_file():
            pipe = build_tiny_pipeline(family, **({"variant": "dev"} if family == "flux" else {}))
            denoiser_name = "unet" if family == "sdxl" else "transformer"
            cls = type(getattr(pipe, denoiser_name))
            with torch.device("meta"):
                denoiser = cls(**config)
            denoiser = denoiser.to_empty(device="cpu").to(torch.bfloat16)
            with torch.no_grad():
                for p in denoiser.parameters():
                    p.normal_(0, 0.02)
            setattr(pipe, denoiser_name, denoiser)
            pipe.register_modules(**{denoiser_name: denoiser})
            for module in pipe.components.values():
                if isinstance(module, torch.nn.Module):
                    module.to(torch.bfloat16)
            pipe.save_pretrained(folder, safe_serialization=True)
            del pipe, denoiser
        cases[f"{name} folder"] = {"family": family, "path": str(folder)}
        if family == "flux":
            single = root / "flux1.safetensors"
            if not single.is_file():
                from safetensors.torch import load_file

                state = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
                config_json = json.loads((folder / "transformer" / "config.json").read_text())
                save_file({k: v.contiguous() for k, v in FLUX.to_original(state, config_json).items()}, single)
                del state
            cases["flux single file"] = {"family": family, "path": str(single), "config": str(folder)}
    return cases


def measure(code_root: Path, model: dict, work: Path) -> dict:
    (work / "data").mkdir(exist_ok=True)
    raw = {"model": model, "method": "lora", "output_dir": str(work / "out"), "weight_dtype": "bfloat16",
           "data": {"path": str(work / "data")}, "resolution": 1024, "mlflow": {"enabled": False}}
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    done = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(raw)], cwd=code_root, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"measurement failed in {code_root}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="2ee4e19", help="the revision to compare with (float32 loading)")
    parser.add_argument("--flux-blocks", default="2,4")
    parser.add_argument("--models", default=None, help="a folder to keep the built models in between runs")
    parser.add_argument("--out", default=None)
    parser.add_argument("--build-only", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    blocks = tuple(int(n) for n in args.flux_blocks.split(","))
    if args.build_only:
        print(json.dumps(build_cases(Path(args.build_only), blocks)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = Path(args.models) if args.models else tmp / "models"
        root.mkdir(parents=True, exist_ok=True)
        # built in a process of its own, so that no measurement shares this one's memory
        built = subprocess.run([sys.executable, __file__, "--build-only", str(root), "--flux-blocks", args.flux_blocks],
                               capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(built.stderr[-3000:])
        cases = json.loads(built.stdout.strip().splitlines()[-1])
        before = tmp / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=REPO, check=True,
                       capture_output=True)
        rows = []
        try:
            for case, model in cases.items():
                for label, code in (("before", before), ("after", REPO)):
                    result = measure(code, model, tmp)
                    rows.append({"case": case, "code": label, **result})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO, capture_output=True)
    print("\n| model (bfloat16 files), LoRA | denoiser parameters | before: peak / s | after: peak / s | peak ratio |")
    print("|---|---|---|---|---|")
    for case in cases:
        old, new = (next(r for r in rows if r["case"] == case and r["code"] == c) for c in ("before", "after"))
        print(f"| {case} | {new['denoiser_parameters'] / 1e9:.2f} B | {old['peak_gib']:.2f} GiB / {old['seconds']:.1f} "
              f"| {new['peak_gib']:.2f} GiB / {new['seconds']:.1f} | {new['peak_gib'] / old['peak_gib']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
