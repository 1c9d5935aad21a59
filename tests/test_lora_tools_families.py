"""`ot-dist lora merge | resize | extract` on SD 2.x, PixArt-Sigma and Stable Cascade's prior (issue 22), on the tiny
models, with the helpers of tests/test_lora_tools.py.

- merge: SD 2.x is compared with diffusers' `load_lora_weights` + `fuse_lora` in test_lora_tools.py
  (`test_merge_equals_diffusers_fuse[sd2-kohya]`); PixArt and Stable Cascade have no diffusers LoRA loader in 0.42
  (PixArtSigmaPipeline has none, StableCascadePriorPipeline's knows `unet` / `text_encoder`, not `prior`), so here
  every family's merge is compared with the in-memory model the file was exported from: each adapted weight is
  W + weight x the adapter's own delta (peft's `get_delta_weight`), every other weight unchanged.
- resize: each module's change is the best rank-R approximation (truncated SVD) and the reported kept energy is
  the SVD's sum(s[:R]^2) / sum(s^2), min and mean over the modules.
- extract: from a full finetune (every Linear / Conv2d of the denoiser and text encoder moved by a full-rank change)
  at full rank, the extracted file merged into the base gives the finetune back.
"""

from __future__ import annotations

import pytest
import torch
from test_lora_tools import diffusers_fused, model_dir, random_lora, run_cli

from ot_dist.config.schema import ModelConfig
from ot_dist.lora_tools.files import read_lora_file
from ot_dist.lora_tools.matching import adaptable_modules
from ot_dist.methods.lora import ADAPTER
from ot_dist.models.loading import load_model

FAMILIES = ["sd2", "pixart_sigma", "stable_cascade"]
TEXT = {"sd2": ("text_encoder",), "pixart_sigma": ("text_encoder",), "stable_cascade": ("text_encoder",)}


def peft_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {path: sub for path, sub in module.named_modules() if isinstance(sub, LoraLayer)}


def load(family, path) -> object:
    return load_model(ModelConfig(family=family, path=str(path)))


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_equals_the_in_memory_model(request, shapes_data, tmp_path, family):
    model, lora = random_lora(request, family, shapes_data, tmp_path / "o", seed=1, text_parts=TEXT[family])
    base = model_dir(request, family)
    done = run_cli("lora", "merge", base, lora, "--family", family, "--weight", 0.7, "--out", tmp_path / "merged",
                   "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stdout, done.stdout
    merged, before = load(family, tmp_path / "merged"), load(family, base)
    for name, part in model.parts().items():
        layers = peft_layers(part)
        assert layers, name
        after = merged.part(name).state_dict()
        for key, value in before.part(name).state_dict().items():
            path = key.removesuffix(".weight")
            expected = value.float()
            if key.endswith(".weight") and path in layers:
                expected = expected + 0.7 * layers[path].get_delta_weight(ADAPTER).float()
                assert layers[path].get_delta_weight(ADAPTER).abs().max() > 0
            torch.testing.assert_close(after[key].float(), expected, rtol=1e-5, atol=1e-6, msg=f"{name}.{key}")


@pytest.mark.parametrize("family", FAMILIES)
def test_resize_reports_the_energy_of_the_svd_truncation(request, shapes_data, tmp_path, family):
    _, lora = random_lora(request, family, shapes_data, tmp_path / "o", seed=2, text_parts=TEXT[family])
    original = read_lora_file(lora)
    done = run_cli("lora", "resize", lora, "--rank", 2, "--out", tmp_path / "r2.safetensors")
    assert done.returncode == 0, done.stderr
    resized = read_lora_file(tmp_path / "r2.safetensors")
    assert resized.layout == original.layout and set(resized.pairs) == set(original.pairs)
    kept = []
    for name, pair in original.pairs.items():
        u, s, vh = torch.linalg.svd(pair.delta().flatten(1), full_matrices=False)
        best = (u[:, :2] * s[:2]) @ vh[:2]
        torch.testing.assert_close(resized.pairs[name].delta().flatten(1), best, rtol=1e-4, atol=1e-6, msg=name)
        assert resized.pairs[name].rank == 2
        kept.append(float((s[:2] ** 2).sum() / (s**2).sum()))
    reported = done.stdout.split("energy kept min ")[1]
    low, mean = float(reported.split(",")[0]), float(reported.split("mean ")[1].split()[0])
    assert low == pytest.approx(min(kept), abs=1e-4) and mean == pytest.approx(sum(kept) / len(kept), abs=1e-4)
    assert low < 1  # rank 4 -> 2 lost something: the figure is not a constant


@pytest.mark.parametrize("family", FAMILIES)
def test_extract_at_full_rank_reproduces_a_full_finetune(request, tmp_path, family):
    base = model_dir(request, family)
    tuned = load(family, base)
    generator = torch.Generator().manual_seed(4)
    full_rank = 1
    with torch.no_grad():
        for part in tuned.parts().values():
            for module in adaptable_modules(part).values():
                module.weight.add_(torch.randn(module.weight.shape, generator=generator) * 0.02)
                full_rank = max(full_rank, min(module.weight.shape[0], module.weight[0].numel()))
    from ot_dist.checkpoint.export import export_diffusers_folder

    # family: with Stable Cascade's EfficientNet beside the prior, as the full export writes it
    export_diffusers_folder(tuned.pipeline, tmp_path / "tuned", torch.float32, family=tuned.family)
    done = run_cli("lora", "extract", base, tmp_path / "tuned", "--family", family, "--rank", full_rank,
                   "--out", tmp_path / "x.safetensors", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "energy kept min 1.0000" in done.stdout
    done = run_cli("lora", "merge", base, tmp_path / "x.safetensors", "--family", family, "--out",
                   tmp_path / "back", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stdout, done.stdout
    back, before = load(family, tmp_path / "back"), load(family, base)
    for name, part in tuned.parts().items():
        modules = adaptable_modules(part)
        expected, original = part.state_dict(), before.part(name).state_dict()
        for key, value in back.part(name).state_dict().items():
            torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5, msg=f"{name}.{key}")
            if key.removesuffix(".weight") in modules and key.endswith(".weight"):
                assert not torch.equal(value, original[key]), f"{name}.{key} was not extracted"
    if family == "sd2":  # diffusers' own reading of the extracted file gives the finetune too
        # and A1111 files it under SD 2.x (ss_v2; without it: SD 1.x, hidden under an SD 2.x checkpoint)
        metadata = read_lora_file(tmp_path / "x.safetensors").metadata
        assert (metadata["ss_base_model_version"], metadata["ss_v2"]) == ("sd_v2", "True")
        fused = diffusers_fused(base, tmp_path / "x.safetensors", 1.0)
        for name in ("unet", "text_encoder"):
            expected = getattr(tuned.pipeline, name).state_dict()
            for key, value in getattr(fused, name).state_dict().items():
                torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5, msg=f"diffusers {name}.{key}")
