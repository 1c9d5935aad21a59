"""`performance.float8_matmuls` trains (ot_dist/train/fast_path.py): trained Linear layers as torchao Float8Linear,
frozen ones (a LoRA's base layers) as ot_dist's FrozenFloat8Linear, which computes no weight gradient
(ot_dist/train/frozen_float8.py). torch 2.13 runs `torch._scaled_mm` on the CPU, so both run here: gradients within a
measured tolerance of bfloat16's, a third fewer float8 matmuls per frozen layer than torchao's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ot_dist.train.frozen_float8 import FrozenFloat8Linear, convert_frozen_linears

pytest.importorskip("torchao.float8")


class CountScaledMatmuls(TorchDispatchMode):
    """float8 matmuls: `_scaled_mm` called directly, or a matmul of torchao's float8 tensors (which their subclass
    turns into `_scaled_mm` out of this mode's sight)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        float8_operands = any(type(a).__name__ == "Float8TrainingTensor" for a in args)
        if func.overloadpacket is torch.ops.aten._scaled_mm or (func.overloadpacket is torch.ops.aten.mm
                                                                and float8_operands):
            self.count += 1
        return func(*args, **(kwargs or {}))


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def frozen_layer_pair():
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 48)).requires_grad_(False)
    ours, torchaos = copy.deepcopy(plain), copy.deepcopy(plain)
    assert convert_frozen_linears(ours, lambda module, name: True) == 1 and type(ours[0]) is FrozenFloat8Linear
    convert_to_float8_training(torchaos)
    return plain, ours, torchaos


def forward_backward(model, x):
    x = x.clone().requires_grad_(True)
    with CountScaledMatmuls() as counted:
        out = model(x)
        out.float().square().sum().backward()
    return out.detach(), x.grad, counted.count


def float8_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not float8_cuda(), reason="needs a CUDA device with compute capability 8.9+")])])
def test_frozen_float8_linear_is_torchaos_recipe_without_the_weight_gradient(device):
    plain, ours, torchaos = (m.to(device) for m in frozen_layer_pair())
    x = torch.randn(4, 8, 64, device=device)
    out, grad, ours_matmuls = forward_backward(ours, x)
    ao_out, ao_grad, ao_matmuls = forward_backward(torchaos, x)
    exact_out, exact_grad, _ = forward_backward(plain, x)
    # the same scaling recipe as torchao's default: far closer to it than either is to the exact values
    assert relative_distance(out, ao_out) < 1e-3 < relative_distance(out, exact_out) < 0.1
    assert relative_distance(grad, ao_grad) < 1e-3 < relative_distance(grad, exact_grad) < 0.1
    assert (ours_matmuls, ao_matmuls) == (2, 3)  # forward and input gradient; torchao adds the weight gradient
    assert ours[0].weight.grad is None and set(ours.state_dict()) == set(plain.state_dict())


def tiny_sdxl_gradients(tmp_path, method: str, dtype: str, float8: bool) -> dict[str, torch.Tensor]:
    from ot_dist.bench.architectures import BENCH_MODELS
    from ot_dist.bench.setup import BenchOptions, prepare, train_config

    options = BenchOptions(model="tiny-sdxl", method=method, lora_rank=4, resolution=64, batch_size=2, device="cpu",
                           dtype=dtype, count_flops=False,
                           performance=(("float8_matmuls", "true"),) if float8 else ())
    bench = BENCH_MODELS[options.model]
    run = prepare(bench, options, train_config(bench, options, str(tmp_path)), torch.device("cpu"),
                  with_optimizer=False)
    kinds = {type(m).__name__ for m in run.model.denoiser.modules()}
    assert ("FrozenFloat8Linear" in kinds) == (float8 and method == "lora")
    assert ("Float8Linear" in kinds) == (float8 and method == "full")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero: the down projections would get no gradient
        for name, param in run.model.denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    run.backward(run.loss())
    return {n: p.grad.float().clone() for n, p in run.model.denoiser.named_parameters() if p.grad is not None}


def distance(got: dict, reference: dict) -> float:
    assert got.keys() == reference.keys() and reference
    return (sum(float((got[n] - reference[n]).norm() ** 2) for n in reference)
            / sum(float(reference[n].norm() ** 2) for n in reference)) ** 0.5


# Measured on the tiny SDXL UNet (2026-11-27): float8 gradients are 0.159 (LoRA) / 0.110 (full finetune) from
# float32's, 5.6x / 5.4x bfloat16's 0.028 / 0.020 (tiny widths: a tensor-wide scale is coarse there).
FLOAT8_NOISE = 8


@pytest.mark.parametrize("method", ["lora", "full"])
def test_float8_matmuls_train_within_a_measured_multiple_of_bfloat16s_error(tmp_path, method):
    exact = tiny_sdxl_gradients(tmp_path / "fp32", method, "fp32", float8=False)
    bf16 = distance(tiny_sdxl_gradients(tmp_path / "bf16", method, "bf16", float8=False), exact)
    float8 = distance(tiny_sdxl_gradients(tmp_path / "float8", method, "bf16", float8=True), exact)
    assert bf16 < float8 <= FLOAT8_NOISE * bf16, (bf16, float8)  # float8 did compute, and within the tolerance


def cuda_scaled_mm_refusals(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """What CUDA's torch._scaled_mm refuses and its CPU kernel does not (torch/_meta_registrations.py, off the CPU):
    `a` row-major, `b` column-major, the inner dimension and both of `b`'s in multiples of 16."""
    problems = []
    if not (a.stride(1) == 1 and a.stride(0) > 1):
        problems.append(f"a not row-major {tuple(a.stride())}")
    if not (b.stride(0) == 1 and b.stride(1) > 1):
        problems.append(f"b not column-major {tuple(b.stride())}")
    if a.size(1) % 16 or b.size(0) % 16 or b.size(1) % 16:
        problems.append(f"{tuple(a.shape)} @ {tuple(b.shape)} not in multiples of 16")
    return problems


@pytest.mark.parametrize("method", ["lora", "full"])
def test_every_float8_matmul_of_a_step_is_one_cuda_runs(tmp_path, method, monkeypatch):
    """The CPU's _scaled_mm takes any shape; CUDA's takes multiples of 16 only. A full finetune's weight gradients
    multiply over the rows of a batch (batch x tokens), and a timestep embedding has one row per sample: SDXL's full
    finetune with float8 matmuls stopped at its first backward on an H200 at batch 8 (2026-11-28). Every float8
    matmul of a tiny SDXL step at batch 2 (77 text tokens a sample, one row per sample in the embeddings) must be one
    CUDA would run."""
    original = torch._scaled_mm
    refused = []

    def checked(a, b, *args, **kwargs):
        refused.extend(cuda_scaled_mm_refusals(a, b))
        return original(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    gradients = tiny_sdxl_gradients(tmp_path, method, "bf16", float8=True)
    assert gradients
    assert not refused, sorted(set(refused))[:5]


def test_fsdp_float8_all_gather_trains_as_one_process(small_sd1, shapes_data, tmp_path):
    """Under fsdp, float8 matmuls gather each trained weight in float8 (torchao's all-gather wrapper, a new Parameter
    around each float32 master): 2 ranks (batch 2 each) take the steps one process takes on batch 4, and export and
    checkpoint the float32 masters. Such a run once stopped at start-up (the parameter groups still held the replaced
    weights) and its export could not read the wrapper (it has no storage of its own). Each rank casts its own
    activations with their own scale, so the runs differ by float8 noise, measured against bfloat16's."""
    import json

    from conftest import base_config
    from forked_ranks import run_ranks
    from safetensors.torch import load_file

    from ot_dist.config.load import validate
    from ot_dist.train.trainer import Trainer

    def raw(out, **overrides):
        return base_config(small_sd1, shapes_data, tmp_path / out, max_steps=2, learning_rate=0.05,
                           clip_grad_norm=None, train_dtype="bfloat16",
                           **{"optimizer.name": "SGD", "performance.float8_matmuls": True, **overrides})

    def update(out):
        trained = load_file(tmp_path / out / "model" / "unet" / "diffusion_pytorch_model.safetensors")
        return torch.cat([(trained[name].float() - start[name].float()).flatten() for name in sorted(start)])

    start = load_file(small_sd1 / "unet" / "diffusion_pytorch_model.safetensors")
    config = tmp_path / "fsdp.json"
    config.write_text(json.dumps(raw("fsdp", strategy="fsdp", batch_size=2, **{"checkpoint.every_n_steps": 1})))
    done = run_ranks("-m", "ot_dist", "train", config, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "fsdp" / "checkpoints" / "step-00000002").is_dir()
    for out, overrides in (("one", {}), ("bf16", {"performance.float8_matmuls": False}),
                           # fsdp in one process (its own group): a full_tensor() there is the wrapper itself
                           ("fsdp-one-rank", {"strategy": "fsdp", "checkpoint.every_n_steps": 1})):
        Trainer(validate(raw(out, **overrides)), log=lambda *_: None).train()
    noise = relative_distance(update("one"), update("bf16"))
    # measured: 2 ranks 0.034 apart, one rank 0.026 (FSDP2's bfloat16 all-gather policy rounds its own way), float8's
    # distance from bfloat16 0.035; a gradient summed instead of averaged is ~1.0 apart
    for run in ("fsdp", "fsdp-one-rank"):
        apart = relative_distance(update(run), update("one"))
        assert apart < 0.3 and apart < 3 * noise, (run, apart, noise)


def test_fsdp_float8_all_gather_leaves_out_weights_that_do_not_split_evenly(tmp_path):
    """torchao's float8 all-gather sends each rank's shard unpadded: over 3 ranks a 16-row weight would be sent as
    6, 6 and 4 rows and gloo aborts (NCCL hangs). Those weights are gathered in their own dtype and still compute in
    float8; a 48-row one keeps the float8 all-gather. The run finishes on every rank with the same gradients."""
    import json
    from pathlib import Path

    from forked_ranks import run_ranks

    done = run_ranks(Path(__file__).parent / "helpers" / "float8_uneven_ranks.py", tmp_path, nproc=3, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(r["float8_all_gather"] == [False, True] for r in results), results
    assert all(r["norms"] == results[0]["norms"] and all(n > 0 for n in r["norms"]) for r in results), results


def test_fsdp_computes_the_float8_scales_once_per_forward_and_never_stale(tmp_path):
    """Under fsdp with float8 matmuls, the float8 weights' scales for a forward's all-gathers are computed before it in
    one all-reduce (torchao's precompute), not one per weight and gather (8 for 4 layers, forward and backward): the
    same losses, and weights changed outside a step (a loaded checkpoint, EMA weights) get their new scales."""
    import json
    from pathlib import Path

    from forked_ranks import run_ranks

    done = run_ranks(Path(__file__).parent / "helpers" / "float8_scale_ranks.py", tmp_path, nproc=2, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for rank in range(2):
        per_weight, once = (json.loads((tmp_path / f"rank{rank}.json").read_text())[key] for key in ("False", "True"))
        assert per_weight["all_reduces"] == 8 and once["all_reduces"] == 1, (per_weight, once)
        assert once["loss"] == per_weight["loss"] and once["changed"] == per_weight["changed"]
        assert once["changed"] > 100 * once["loss"]  # the change reached the output
