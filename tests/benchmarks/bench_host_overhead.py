"""The host's work in a training step, counted on a CPU: SDXL and Flux.1 at their real depth with tiny widths.

On a GPU, SDXL LoRA at batch 8 is paced by the host that launches its kernels, not by the kernels (issue 21,
docs/performance.md: ~19,300 launches per step, the device busy 53-72 %). The ops a step dispatches depend on the
module tree and the op graph, not on the widths, so this script builds structural twins (the published SDXL UNet
and Flux.1-dev transformer configs with every block and layer kept, channels, heads and text width cut), trains
LoRA (and a full finetune with gradient checkpointing) under bfloat16 autocast with the trainer's step (`ot-dist bench`'s `prepare`) and counts per step the aten ops
that compute (views and other metadata-only ops left out; CPU-only ones, AdamW's per-parameter `.item()` on CPU step
counts that CUDA's fused AdamW does not make, counted apart). On a GPU each is one kernel launch or more.

Each variant undoes some of ot_dist's fast-path changes (tests/benchmarks/fast_path_levers.py), so the table
shows what each change saves. CPU time is not reported: even at these widths a bfloat16 op's compute on a CPU
outweighs its dispatch, and the variants take the same CPU time within noise.

    python tests/benchmarks/bench_host_overhead.py [--model sdxl|flux|both] [--method lora|full|both] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fast_path_levers import undone  # noqa: E402

# Cut widths; depth, block types, layer counts and the attention layout stay as published.
TWINS = {
    "sdxl": ("sdxl", dict(block_out_channels=(40, 80, 160), norm_num_groups=8, cross_attention_dim=64,
                          addition_time_embed_dim=16, projection_class_embeddings_input_dim=64 + 6 * 16)),
    "flux": ("flux-dev", dict(num_attention_heads=2, attention_head_dim=16, axes_dims_rope=(4, 6, 6),
                              joint_attention_dim=64, pooled_projection_dim=32)),
}
# method -> (label, changes undone): the fast path first, then each change taken back in turn
VARIANTS = {
    "lora": [
        ("fast path", ()),
        ("diffusers' attention processor", ("lean_attention",)),
        ("own down projections", ("lean_attention", "lora_shared_down")),
        ("per-layer casts", ("lean_attention", "lora_shared_down", "lora_block_casts")),
        ("+ peft forward", ("lean_attention", "lora_shared_down", "lora_block_casts", "lora_fused_forward")),
        ("+ peft input copies", ("lean_attention", "lora_shared_down", "lora_block_casts", "lora_fused_forward",
                                 "lora_input_copies")),
    ],
    "full": [("fast path", ()), ("diffusers' attention processor", ("lean_attention",)),
             ("per-layer casts", ("lean_attention", "weight_block_casts"))],
}
METADATA_OPS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "split", "split_with_sizes",
                "as_strided", "detach", "unsqueeze", "squeeze", "slice", "select", "alias", "unbind", "chunk",
                "reshape", "_reshape_alias", "narrow", "lift_fresh", "empty_like", "empty", "new_empty", "unflatten", "flatten"}
CPU_ONLY_OPS = {"_local_scalar_dense"}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def build(model: str, method: str, changes: tuple[str, ...], workdir: Path):
    from ot_dist.bench import architectures
    from ot_dist.bench.setup import BenchOptions, prepare, train_config

    base_name, cut = TWINS[model]
    bench = replace(architectures.BENCH_MODELS[base_name], name=f"{base_name}-twin",
                    config=dict(architectures.BENCH_MODELS[base_name].config, **cut))
    options = BenchOptions(model=bench.name, method=method, lora_rank=16, resolution=64, batch_size=1,
                           dtype="bf16", device="cpu", count_flops=False, gradient_checkpointing=method == "full")
    with undone(*changes):
        return prepare(bench, options, train_config(bench, options, str(workdir)), torch.device("cpu"))


def count_ops(run) -> dict:
    with CountOps() as counted:
        run.step()
    computing = {k: v for k, v in counted.ops.items() if k not in METADATA_OPS}
    cpu_only = sum(v for k, v in computing.items() if k in CPU_ONLY_OPS)
    return {"ops": sum(computing.values()) - cpu_only, "cpu_only_ops": cpu_only,
            "casts": computing.get("_to_copy", 0) + computing.get("_foreach_copy_", 0), "matmuls": sum(computing.get(k, 0) for k in ("mm", "addmm", "bmm")),
            "lora_layers": sum(1 for m in run.model.denoiser.modules() if hasattr(m, "lora_A"))}


def measure(model: str, method: str, workdir: Path) -> list[dict]:
    rows = []
    for label, changes in VARIANTS[method]:
        run = build(model, method, changes, workdir / f"{method}_{label.replace(' ', '_')}")
        for _ in range(2):  # warm-up: first-step allocations, optimizer state
            run.step()
        name = f"{model} twin, " + ("LoRA" if method == "lora" else "full finetune, checkpointing")
        rows.append({"model": name, "variant": label, "undone": list(changes), **count_ops(run)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("sdxl", "flux", "both"), default="both")
    parser.add_argument("--method", choices=("lora", "full", "both"), default="both")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for model in (("sdxl", "flux") if args.model == "both" else (args.model,)):
            for method in (("lora", "full") if args.method == "both" else (args.method,)):
                rows += measure(model, method, Path(workdir))
    print("| model | variant | LoRA layers | ops / step | casts | matmuls | vs fast path |")
    print("|---|---|---|---|---|---|---|")
    fast = {r["model"]: r for r in rows if not r["undone"]}
    for r in rows:
        base = fast[r["model"]]
        print(f"| {r['model']} | {r['variant']} | {r['lora_layers']} | {r['ops']:,} | {r['casts']:,} | "
              f"{r['matmuls']:,} | {r['ops'] / base['ops']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
