"""`ot-dist lora resize` options and metadata as users of kohya sd-scripts' resize_lora.py know them
(`--new_conv_rank`, `--dynamic_method sv_ratio | sv_fro | sv_cumulative` with `--dynamic_param`, the module's
alpha / rank scale kept, metadata of the new file) and `ot-dist lora merge-loras` as users of its svd_merge_lora.py
know it, on small hand-made kohya-layout files: no model needed.

The expected ranks are worked out by hand from the documented rule (docs/lora.md): n = the count of singular values
above s_max / param (sv_ratio), or the fewest leading values whose sum (sv_cumulative) or sum of squares (sv_fro,
against param^2) reaches that share; the rank kept is n + 1, at most --rank (--conv-rank for convolutions)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ot_dist.lora_tools.files import read_lora_file
from ot_dist.lora_tools.resize import resize_command

SPECTRUM = [10.0, 5.0, 3.0, 2.0, 1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005]  # the linear module's singular values


def orthonormal(rows: int, cols: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)))
    return q


def write_file(path, metadata=None):
    """A kohya-layout file: a Linear (16 x 12) whose up @ down has SPECTRUM, at alpha 3 (scale 3 / 12), and a 3x3 and
    a 1x1 convolution of rank 4 at alpha 1 (the same scale)."""
    s = torch.tensor(SPECTRUM)
    tensors = {"lora_unet_lin.lora_up.weight": (orthonormal(16, 12, 0) * s).contiguous(),
               "lora_unet_lin.lora_down.weight": orthonormal(12, 12, 1).T.contiguous(),
               "lora_unet_lin.alpha": torch.tensor(3.0)}
    g = torch.Generator().manual_seed(2)
    for name, kernel in (("conv3", 3), ("conv1", 1)):
        tensors[f"lora_unet_{name}.lora_down.weight"] = torch.randn(4, 6, kernel, kernel, generator=g)
        tensors[f"lora_unet_{name}.lora_up.weight"] = torch.randn(8, 4, 1, 1, generator=g)
        tensors[f"lora_unet_{name}.alpha"] = torch.tensor(1.0)
    save_file(tensors, str(path), metadata={"ss_network_dim": "12", "ss_network_alpha": "3.0", **(metadata or {})})
    return path


def resized(tmp_path, rank, **options):
    out = tmp_path / "resized.safetensors"
    resize_command(str(write_file(tmp_path / "lora.safetensors")), rank, str(out), log=lambda *_: None, **options)
    return read_lora_file(out)


@pytest.mark.parametrize("method,param,rank", [
    ("sv_ratio", 4.0, 4),  # 10, 5, 3 above 10 / 4: n = 3
    ("sv_ratio", 100.0, 6),  # 7 above 0.1: 8, capped at --rank 6
    ("sv_fro", 0.9, 3),  # squares 100, 125 of 139.29: 125 >= 0.81 x 139.29 after n = 2
    ("sv_cumulative", 0.5, 3),  # sums 10, 15 of 22.885: 15 >= 11.44 after n = 2
    ("sv_cumulative", 0.3, 2),  # 10 >= 6.87 after n = 1
])
def test_dynamic_resize_keeps_the_ranks_kohyas_resize_lora_keeps(tmp_path, method, param, rank):
    lora = resized(tmp_path, 6, dynamic_method=method, dynamic_param=param)
    assert lora.pairs["lora_unet_lin"].rank == rank
    assert lora.metadata["ss_network_dim"] == "Dynamic"
    # the kept change is the best one of that rank (Eckart-Young), at the module's scale
    original = read_lora_file(tmp_path / "lora.safetensors").pairs["lora_unet_lin"].delta()
    u, s, vh = torch.linalg.svd(original, full_matrices=False)
    torch.testing.assert_close(lora.pairs["lora_unet_lin"].delta(), (u[:, :rank] * s[:rank]) @ vh[:rank],
                               rtol=1e-4, atol=1e-6)


def test_conv_rank_applies_to_every_convolution_and_rank_to_linear_modules(tmp_path):
    lora = resized(tmp_path, 3, conv_rank=2)
    assert {name: pair.rank for name, pair in lora.pairs.items()} == {
        "lora_unet_lin": 3, "lora_unet_conv3": 2, "lora_unet_conv1": 2}
    assert lora.metadata["ss_network_dim"] == "3"


def test_the_resized_file_keeps_each_modules_scale_and_drops_the_old_files_hashes(tmp_path):
    """alpha / rank of a module is what it was (3 / 12 -> alpha 1.0 at rank 4), as training would continue at the
    original's scale; the old file's hashes, which A1111 / Forge take as the LoRA's own, are not copied."""
    out = tmp_path / "resized.safetensors"
    write_file(tmp_path / "lora.safetensors", {"sshs_model_hash": "ab" * 32, "sshs_legacy_hash": "abababab",
                                               "modelspec.title": "mine"})
    resize_command(str(tmp_path / "lora.safetensors"), 4, str(out), log=lambda *_: None, conv_rank=4)
    with safe_open(str(out), framework="pt") as f:
        metadata = f.metadata()
        lin_alpha = float(f.get_tensor("lora_unet_lin.alpha"))
    assert lin_alpha == 1.0 and metadata["ss_network_alpha"] == "1.0" and metadata["ss_network_dim"] == "4"
    assert "sshs_model_hash" not in metadata and "sshs_legacy_hash" not in metadata
    assert metadata["modelspec.title"] == "mine"
    before, after = read_lora_file(tmp_path / "lora.safetensors"), read_lora_file(out)
    for name in ("lora_unet_conv3", "lora_unet_conv1"):  # rank 4 already: the change is kept whole
        torch.testing.assert_close(after.pairs[name].delta(), before.pairs[name].delta(), rtol=1e-4, atol=1e-5)


def test_merge_loras_is_the_best_low_rank_sum_of_the_weighted_changes(tmp_path):
    """`ot-dist lora merge-loras` (kohya's svd_merge_lora.py): per module sum of weight x change over the files that
    have it, then the best approximation at --rank (--conv-rank for the 3x3 convolution only; the 1x1 one is ranked
    as a Linear, as kohya's script ranks it), alpha = rank; a module only one file has is kept too, at --rank as
    kohya keeps it (min(rank, out, in)) though its change has rank 2."""
    from ot_dist.lora_tools.merge_loras import merge_loras_command

    first = write_file(tmp_path / "a.safetensors", {"modelspec.title": "a", "modelspec.architecture": "x/lora"})
    second = tmp_path / "b.safetensors"
    resize_command(str(first), 2, str(second), log=lambda *_: None)  # another file of the same modules
    only_b = {"lora_unet_extra.lora_down.weight": torch.randn(2, 5),
              "lora_unet_extra.lora_up.weight": torch.randn(7, 2)}
    save_file({**load_file(str(second)), **only_b}, str(second), metadata={"modelspec.title": "b"})
    out = tmp_path / "m.safetensors"
    merge_loras_command([str(first), str(second)], [0.7, -0.4], 3, str(out), conv_rank=1, log=lambda *_: None)
    a, b, merged = read_lora_file(first), read_lora_file(second), read_lora_file(out)
    assert {n: p.rank for n, p in merged.pairs.items()} == {
        "lora_unet_lin": 3, "lora_unet_conv1": 3, "lora_unet_conv3": 1, "lora_unet_extra": 3}
    for name, pair in merged.pairs.items():
        total = (0.7 * a.pairs[name].delta() if name in a.pairs else 0) - 0.4 * b.pairs[name].delta()
        u, s, vh = torch.linalg.svd(total.flatten(1), full_matrices=False)
        best = (u[:, :pair.rank] * s[:pair.rank]) @ vh[:pair.rank]
        torch.testing.assert_close(pair.delta().flatten(1), best, rtol=1e-4, atol=1e-5, msg=name)
    assert merged.metadata["ss_network_dim"] == "3" and merged.metadata["ss_network_alpha"] == "3.0"
    assert merged.metadata["modelspec.title"] == "m" and merged.metadata["modelspec.merged_from"] == "a, b"


def test_a_comfyui_extract_with_bias_differences_is_refused_naming_them(tmp_path):
    """ComfyUI's "Extract and Save Lora" node (bias_diff on by default) writes `.diff_b` for every bias and `.diff`
    for every 1-d weight beside the pairs: the tools cannot apply them, and the error says what they are and how to
    extract without them (before: "Tucker factors, an older layout")."""
    from ot_dist.errors import InputFileError

    path = tmp_path / "ComfyUI_extracted_lora_00001_.safetensors"
    save_file({"diffusion_model.out.2.lora_up.weight": torch.zeros(4, 2, 1, 1),
               "diffusion_model.out.2.lora_down.weight": torch.zeros(2, 8, 3, 3),
               "diffusion_model.out.2.diff_b": torch.zeros(4), "diffusion_model.out.0.diff": torch.zeros(8)},
              str(path))
    with pytest.raises(InputFileError, match=r"diff_b.*ComfyUI's \"Extract and Save Lora\".*bias_diff off"):
        read_lora_file(path)


def test_merge_loras_refuses_loras_of_different_base_models(tmp_path):
    """An SD 1.x and an SDXL LoRA share no module name, so a merge by names would write a file of both halves."""
    from ot_dist.errors import InputFileError
    from ot_dist.lora_tools.merge_loras import merge_loras_command

    sd1 = write_file(tmp_path / "sd1.safetensors", {"ss_base_model_version": "sd_v1"})
    sdxl = write_file(tmp_path / "sdxl.safetensors", {"ss_base_model_version": "sdxl_base_v1-0"})
    with pytest.raises(InputFileError, match="different base models.*sd_v1.*sdxl_base_v1-0"):
        merge_loras_command([str(sd1), str(sdxl)], [1.0, 1.0], 2, str(tmp_path / "m.safetensors"), log=lambda *_: None)
