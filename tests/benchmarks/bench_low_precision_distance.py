"""How far 2 ranks of a strategy in bfloat16 end from one process in bfloat16, per family, in bf16 noises.

For each family it trains the tiny model (full finetune, plain SGD, 3 steps, as tests/test_family_strategies.py's
low-precision cases) in one process in float32 and in bfloat16 (batch 4), then every strategy asked for on 2 gloo
ranks (batch 2 each) in one launch, and prints the distance (max abs over the exported weights) between each
strategy's run and the one process's bfloat16 run, divided by the distance between the one process's bfloat16 and
float32 runs (the "bf16 noise"), with the dtypes the denoiser received.

    PYTHONPATH=$PWD:$PWD/tests python tests/benchmarks/bench_low_precision_distance.py \\
        [--families sdxl,sd3,...] [--strategies zero2,fsdp] [--method full|lora] \\
        [--set 'deepspeed.mixed_precision="engine"'] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "helpers")]

FAMILIES = ("sd1", "sdxl", "sd3", "flux", "chroma", "pixart_alpha", "stable_cascade", "wuerstchen_v2")
STRATEGY_SETTINGS = {"fsdp": {"gradient_checkpointing": True}, "zero3": {"gradient_checkpointing": True}}
FAMILY_SETTINGS = {"stable_cascade": {"resolution": 128}, "wuerstchen_v2": {"resolution": 128}}
STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--strategies", default="zero2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--method", default="full", choices=("full", "lora"))
    parser.add_argument("--set", action="append", default=[], help="KEY=JSON value, for the multi-rank runs")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"

    import torch
    from conftest import base_config
    from denoiser_inputs import record_denoiser_inputs
    from forked_ranks import run_ranks
    from safetensors.torch import load_file

    from ot_dist.config.load import validate
    from ot_dist.demo import make_demo_dataset
    from ot_dist.models.families.registry import get_family
    from ot_dist.models.tiny import make_tiny_model
    from ot_dist.train.trainer import Trainer

    torch.set_num_threads(1)
    extra = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    root = Path(tempfile.mkdtemp(prefix="lp_distance_"))
    data = make_demo_dataset(root / "data", count=16)

    def exported(out: Path, family: str) -> dict:
        if args.method == "lora":
            return load_file(out / "lora.safetensors")
        denoiser = get_family(family).denoiser
        return load_file(out / "model" / denoiser / "diffusion_pytorch_model.safetensors")

    def distance(a, b) -> float:
        return max((a[k].float() - b[k].float()).abs().max().item() for k in a)

    def config(family, model, out, dtype, batch_size, **more):
        method = {"learning_rate": 0.05} if args.method == "full" else {"learning_rate": 0.5, "lora.rank": 4,
                                                                         "lora.alpha": 8}
        return base_config(model, data, out, family=family, method=args.method, batch_size=batch_size,
                           train_dtype=dtype, max_steps=STEPS, **{"optimizer.name": "SGD", "clip_grad_norm": None},
                           **method,
                           **FAMILY_SETTINGS.get(family, {}), **more)

    families = args.families.split(",")
    strategies = args.strategies.split(",")
    references, cases = {}, {}
    for family in families:
        model = make_tiny_model(root / "models" / family, family)
        for dtype in ("float32", args.dtype):
            out = root / f"ref-{family}-{dtype}"
            trainer = Trainer(validate(config(family, model, out, dtype, 4)), log=lambda *_: None)
            record_denoiser_inputs(trainer, f"{out}.inputs.json")
            trainer.train()
            references[family, dtype] = exported(out, family)
        for strategy in strategies:
            out = root / f"{family}-{strategy}"
            cases[f"{family}/{strategy}"] = {
                **config(family, model, out, args.dtype, 2, strategy=strategy, **STRATEGY_SETTINGS.get(strategy, {}),
                         **extra),
                "_record_denoiser_inputs": f"{out}.inputs.json"}
    (root / "cases.json").write_text(json.dumps(cases))
    done = run_ranks(str(REPO / "tests" / "helpers" / "family_cases.py"), str(root / "cases.json"),
                     env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, timeout=3000)
    if done.returncode != 0:
        sys.exit((done.stdout + done.stderr)[-6000:])
    results = {}
    for case, raw in cases.items():
        family = raw["model"]["family"]
        noise = distance(references[family, "float32"], references[family, args.dtype])
        diff = distance(references[family, args.dtype], exported(Path(raw["output_dir"]), family))
        inputs = json.loads(Path(f"{raw['output_dir']}.inputs.json").read_text())
        one = json.loads((root / f"ref-{family}-{args.dtype}.inputs.json").read_text())
        results[case] = {"noises": diff / noise, "diff": diff, "noise": noise, "inputs": inputs, "one_process": one}
        print(f"{case}: {diff / noise:.3g} noises (diff {diff:.3g}, noise {noise:.3g})  inputs {inputs}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
