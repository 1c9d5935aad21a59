"""Key maps of the transformer families' original single files (Flux.1, Chroma, SD3 / 3.5 + VAE).

Every weight of the tiny models is re-drawn at random (diffusers initialises norms to ones and some
projections to zeros, which would hide swapped names), and the checks compare keys, shapes and
values exactly:
* round trips diffusers -> original -> diffusers, for each variant;
* the original side against diffusers' own readers: SD3 (and its VAE) through ``from_single_file``
  on the written file; Flux.1 / Chroma, whose diffusers converters hard-code width 3072 and MLP ratio
  4, on real-width models with one double and one single block (bfloat16, ~1 GB) through both the
  converter function and ``from_single_file``;
* the header validator names missing, unexpected and wrong-shaped keys, and the family a file looks like.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ot_dist.errors import InputFileError
from ot_dist.models.families import flux_single_file as F
from ot_dist.models.families import hidream_single_file as H
from ot_dist.models.families import sd3_single_file as S
from ot_dist.models.families import z_image_single_file as Z
from ot_dist.models.families.ernie_image_single_file import ERNIE_IMAGE
from ot_dist.models.families.flux2_single_file import FLUX2
from ot_dist.models.families.qwen_image_single_file import QWEN_IMAGE
from ot_dist.models.families.krea2_single_file import KREA2
from ot_dist.models.families.single_file_keys import KeyLayoutError, read_safetensors_header

TINY_FLUX = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24, axes_dims_rope=(4, 6, 6),
)  # fmt: skip
TINY_CHROMA = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    approximator_num_channels=8, approximator_hidden_dim=24, approximator_layers=2,
)  # fmt: skip
TINY_SD3 = dict(
    sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=24, out_channels=4, pos_embed_max_size=16,
)  # fmt: skip
SD3_VARIANTS = {
    "sd3": {},
    "sd35_large": {"qk_norm": "rms_norm"},
    "sd35_medium": {"qk_norm": "rms_norm", "dual_attention_layers": (0, 1)},
}
TINY_VAE = dict(
    in_channels=3, out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(8, 16, 16), latent_channels=16, layers_per_block=1, norm_num_groups=4,
    use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5305,
)  # fmt: skip


def _randomized(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn_like(t))
    return model


def _flux(**kw):
    from diffusers import FluxTransformer2DModel

    return _randomized(FluxTransformer2DModel(**{**TINY_FLUX, **kw}))


def _chroma():
    from diffusers import ChromaTransformer2DModel

    return _randomized(ChromaTransformer2DModel(**TINY_CHROMA))


def _sd3(variant):
    from diffusers import SD3Transformer2DModel

    return _randomized(SD3Transformer2DModel(**TINY_SD3, **SD3_VARIANTS[variant]))


def _vae():
    from diffusers import AutoencoderKL

    return _randomized(AutoencoderKL(**TINY_VAE))


def _assert_same(got: dict, want: dict):
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:10]
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def _header(state: dict) -> dict:
    return {k: tuple(v.shape) for k, v in state.items()}


# ---- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_flux_round_trip(guidance):
    model = _flux(guidance_embeds=guidance)
    state = model.state_dict()
    original = F.FLUX.to_original(state, model.config)
    # Every original tensor is one of the model's values, fused or swapped, never recomputed.
    assert sum(t.numel() for t in original.values()) == sum(t.numel() for t in state.values())
    assert ("guidance_in.in_layer.weight" in original) == guidance
    assert original["single_blocks.1.linear1.weight"].shape == (3 * 32 + 4 * 32, 32)
    half = model.config.num_attention_heads * model.config.attention_head_dim
    assert torch.equal(original["final_layer.adaLN_modulation.1.weight"][:half], state["norm_out.linear.weight"][half:])
    _assert_same(F.FLUX.from_original(original, model.config), state)
    assert F.FLUX.check_header(_header(original), model.config).ok

    # ComfyUI: the same keys under model.diffusion_model., beside other components (ignored).
    comfy = F.FLUX.to_original(state, model.config, prefix=F.COMFY_PREFIX)
    assert all(k.startswith("model.diffusion_model.double_blocks.") for k in comfy if "double_blocks" in k)
    comfy["vae.decoder.conv_in.weight"] = torch.zeros(1)
    _assert_same(F.FLUX.from_original(comfy, model.config), state)
    assert F.FLUX.check_header(_header(comfy), model.config).ok


def test_chroma_round_trip():
    model = _chroma()
    state = model.state_dict()
    original = F.CHROMA.to_original(state, model.config)
    assert "distilled_guidance_layer.norms.1.scale" in original
    assert not any("_mod." in k or "modulation" in k or k.startswith("time_in") for k in original)
    _assert_same(F.CHROMA.from_original(original, model.config), state)
    assert F.CHROMA.check_header(_header(original), model.config).ok


@pytest.mark.parametrize("variant", list(SD3_VARIANTS))
def test_sd3_round_trip(variant):
    model = _sd3(variant)
    state = model.state_dict()
    original = S.sd3_to_original(state, model.config)
    assert all(k.startswith("model.diffusion_model.") for k in original)
    assert ("model.diffusion_model.joint_blocks.0.x_block.attn.ln_q.weight" in original) == (variant != "sd3")
    assert ("model.diffusion_model.joint_blocks.1.x_block.attn2.qkv.weight" in original) == (variant == "sd35_medium")
    assert "model.diffusion_model.joint_blocks.2.context_block.mlp.fc1.weight" not in original  # pre-only
    _assert_same(S.sd3_from_original(original, model.config), state)
    # A bare transformer file (no prefix) reads the same.
    bare = S.sd3_to_original(state, model.config, prefix="")
    _assert_same(S.sd3_from_original(bare, model.config), state)


def test_vae_round_trip():
    vae = _vae()
    state = vae.state_dict()
    original = S.sd3_vae_to_original(state, vae.config)
    assert original["first_stage_model.encoder.mid.attn_1.q.weight"].shape == (16, 16, 1, 1)
    _assert_same(S.sd3_vae_from_original(original, vae.config), state)


# ---- against diffusers' own readers ------------------------------------------------------------


@pytest.mark.parametrize("variant", list(SD3_VARIANTS))
def test_sd3_file_loads_in_diffusers(tmp_path, variant):
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    model, vae = _sd3(variant), _vae()
    model.save_config(tmp_path / "cfg" / "transformer")
    vae.save_config(tmp_path / "cfg" / "vae")
    full = S.sd3_to_original(model.state_dict(), model.config)
    full.update(S.sd3_vae_to_original(vae.state_dict(), vae.config))
    save_file(full, tmp_path / "sd3.safetensors")
    S.validate_sd3_file(tmp_path / "sd3.safetensors", model.config, vae.config)

    loaded = SD3Transformer2DModel.from_single_file(
        str(tmp_path / "sd3.safetensors"), config=str(tmp_path / "cfg"), subfolder="transformer", local_files_only=True
    )
    assert tuple(loaded.config.dual_attention_layers) == tuple(model.config.dual_attention_layers)
    _assert_same(loaded.state_dict(), model.state_dict())
    loaded_vae = AutoencoderKL.from_single_file(
        str(tmp_path / "sd3.safetensors"), config=str(tmp_path / "cfg"), subfolder="vae", local_files_only=True
    )
    _assert_same(loaded_vae.state_dict(), vae.state_dict())
    # And diffusers' VAE converter on the dict agrees key for key with ours.
    _assert_same(convert_ldm_vae_checkpoint(dict(full), vae.config), S.sd3_vae_from_original(full, vae.config))


# diffusers' Flux / Chroma converters split linear1 with inner_dim = 3072 and MLP ratio 4 fixed, so the
# check needs the real width: 24 heads x 128, one double and one single block, small embedders.
REAL_FLUX = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
REAL_CHROMA = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=64, axes_dims_rope=(16, 56, 56), approximator_num_channels=16, approximator_hidden_dim=64,
    approximator_layers=2,
)  # fmt: skip


def _real_width(cls, kwargs):
    """A bfloat16 state dict of the real width without a float32 model: each tensor is a random row
    vector plus a random column vector (distinct rows and columns, so a wrong split or swap shows; one
    pass to fill instead of a normal draw per element)."""
    with torch.device("meta"):
        meta = cls(**kwargs)
    g = torch.Generator().manual_seed(0)
    state = {}
    for k, t in meta.state_dict().items():
        rows = torch.randn(t.shape[0], *([1] * (t.ndim - 1)), generator=g)
        cols = torch.randn(1, *t.shape[1:], generator=g) if t.ndim > 1 else 0
        state[k] = (rows + cols).to(torch.bfloat16)
    return meta.config, state


@pytest.fixture(scope="module")
def real_flux():
    from diffusers import FluxTransformer2DModel

    return _real_width(FluxTransformer2DModel, REAL_FLUX)


@pytest.fixture(scope="module")
def real_chroma():
    from diffusers import ChromaTransformer2DModel

    return _real_width(ChromaTransformer2DModel, REAL_CHROMA)


@pytest.mark.parametrize("family", ["flux", "chroma"])
def test_flux_matches_diffusers_converter(family, real_flux, real_chroma):
    from diffusers.loaders import single_file_utils as U

    config, state = real_flux if family == "flux" else real_chroma
    if family == "flux":
        to, fr = F.FLUX.to_original, F.FLUX.from_original
    else:
        to, fr = F.CHROMA.to_original, F.CHROMA.from_original
    convert = getattr(U, f"convert_{family}_transformer_checkpoint_to_diffusers")
    original = to(state, config)
    ours = fr(original, config)
    _assert_same(ours, state)
    # diffusers' converter pops from its argument and reads ComfyUI's prefix too.
    _assert_same(convert({"model.diffusion_model." + k: v for k, v in original.items()}), state)


@pytest.mark.parametrize("family", ["flux", "chroma"])
def test_flux_file_loads_in_diffusers(tmp_path, family, real_flux, real_chroma):
    from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

    cls = FluxTransformer2DModel if family == "flux" else ChromaTransformer2DModel
    config, state = real_flux if family == "flux" else real_chroma
    to = F.FLUX.to_original if family == "flux" else F.CHROMA.to_original
    (tmp_path / "cfg" / "transformer").mkdir(parents=True)
    (tmp_path / "cfg" / "transformer" / "config.json").write_text(json.dumps({"_class_name": cls.__name__, **config}))
    path = tmp_path / f"{family}.safetensors"
    save_file(to(state, config), path)
    try:
        (F.FLUX.validate if family == "flux" else F.CHROMA.validate)(path, config)
        loaded = cls.from_single_file(
            str(path), config=str(tmp_path / "cfg"), subfolder="transformer", torch_dtype=torch.bfloat16,
            local_files_only=True,
        )  # fmt: skip
        _assert_same(loaded.state_dict(), state)
    finally:
        path.unlink()  # ~1 GB


# ---- validation --------------------------------------------------------------------------------


def test_header_validator_names_keys(tmp_path):
    model = _flux(guidance_embeds=True)
    header = _header(F.FLUX.to_original(model.state_dict(), model.config))
    assert F.FLUX.check_header(header, model.config).ok

    damaged = dict(header)
    del damaged["double_blocks.1.img_attn.qkv.weight"]
    damaged["single_blocks.0.linear1.weight"] = (3 * 32 + 2 * 32, 32)  # an MLP ratio of 2
    damaged["single_blocks.2.linear2.weight"] = (32, 160)  # a layer the config does not have
    report = F.FLUX.check_header(damaged, model.config)
    assert report.missing == ["double_blocks.1.img_attn.qkv.weight"]
    assert report.unexpected == ["single_blocks.2.linear2.weight"]
    assert report.wrong_shape == [("single_blocks.0.linear1.weight", (160, 32), (224, 32))]
    message = report.message()
    assert "double_blocks.1.img_attn.qkv.weight" in message and "single_blocks.2.linear2.weight" in message
    assert "single_blocks.0.linear1.weight is [160, 32], expected [224, 32]" in message

    # schnell file for a dev config: the guidance embedder is missing.
    schnell = _flux(guidance_embeds=False)
    report = F.FLUX.check_header(_header(F.FLUX.to_original(schnell.state_dict(), schnell.config)), model.config)
    assert sorted(report.missing) == [
        f"guidance_in.{layer}.{p}" for layer in ("in_layer", "out_layer") for p in ("bias", "weight")
    ]

    # A real file: damaged on disk, read through its header only.
    state = F.FLUX.to_original(model.state_dict(), model.config, prefix=F.COMFY_PREFIX)
    state["model.diffusion_model.img_in.weight"] = torch.zeros(32, 8)
    save_file(state, tmp_path / "bad.safetensors")
    wrong = r"bad\.safetensors: .*model\.diffusion_model\.img_in\.weight is \[32, 8\], expected \[32, 16\]"
    with pytest.raises(InputFileError, match=wrong):
        F.FLUX.validate(tmp_path / "bad.safetensors", model.config)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(InputFileError, match="junk.safetensors"):
        read_safetensors_header(tmp_path / "junk.safetensors")


TINY_HIDREAM = dict(
    patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
    num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=64, num_routed_experts=4, num_activated_experts=2,
    axes_dims_rope=(8, 4, 4), max_resolution=(16, 16), llama_layers=[0, 0],
)  # fmt: skip


@pytest.mark.parametrize("layout, name, config", [(F.FLUX, "Flux.1", TINY_FLUX), (F.CHROMA, "Chroma", TINY_CHROMA),
                                                  (Z.Z_IMAGE, "Z-Image", {}), (H.HIDREAM, "HiDream-I1", TINY_HIDREAM),
                                                  (QWEN_IMAGE, "Qwen-Image", {}), (FLUX2, "FLUX.2", {}),
                                                  (ERNIE_IMAGE, "ERNIE-Image", {}), (KREA2, "Krea 2", {})])
def test_each_layout_names_its_model_and_reads_comfyuis_prefix(layout, name, config):
    # one right key and one stray key under ComfyUI's prefix; the header is all that is read (no tensor is made)
    key, shape = next(iter(layout.expected_header(config).items()))
    report = layout.check_header({F.COMFY_PREFIX + key: shape, F.COMFY_PREFIX + "stray.weight": (1,)}, config)
    assert report.message().startswith(f"not a {name} checkpoint for this config: missing ")
    assert F.COMFY_PREFIX + key not in report.missing
    assert report.unexpected == [F.COMFY_PREFIX + "stray.weight"]


def test_validator_names_the_wrong_family():
    flux, chroma, sd3 = _flux(guidance_embeds=False), _chroma(), _sd3("sd35_large")
    chroma_header = _header(F.CHROMA.to_original(chroma.state_dict(), chroma.config))
    report = F.FLUX.check_header(chroma_header, flux.config)
    assert "distilled_guidance_layer.in_proj.weight" in report.unexpected
    assert "double_blocks.0.img_mod.lin.weight" in report.missing
    assert "look like a Chroma checkpoint" in report.message()

    sd3_header = _header(S.sd3_to_original(sd3.state_dict(), sd3.config))
    with pytest.raises(InputFileError, match="look like a SD3 checkpoint"):
        F.FLUX.check_header(sd3_header, flux.config).raise_if_bad("x.safetensors")
    # SD3.5 file (qk-norm) for an SD3 config: the norms are unexpected, named with the file's prefix.
    plain = _sd3("sd3")
    (report,) = S.check_sd3_header(sd3_header, plain.config)
    assert "model.diffusion_model.joint_blocks.0.x_block.attn.ln_q.weight" in report.unexpected
    # A transformer-only file checked for its VAE too: every VAE key is missing, under first_stage_model.
    _, vae_report = S.check_sd3_header(sd3_header, sd3.config, _vae().config)
    assert not vae_report.unexpected and "first_stage_model.encoder.conv_in.weight" in vae_report.missing


def test_comfyuis_scaled_fp8_files_are_refused_by_what_they_are():
    """ComfyUI's `*_fp8_scaled` files (its SD3.5 / Flux downloads) hold the right model with fp8 weights, a
    `.scale_weight` per layer and a `scaled_fp8` marker (comfy/utils.py convert_old_quants): the error says so and asks
    for the unquantized file, instead of only calling it not a checkpoint of the model it is."""
    model = _flux(guidance_embeds=True)
    header = _header(F.FLUX.to_original(model.state_dict(), model.config))
    header |= {k[: -len(".weight")] + ".scale_weight": () for k, shape in header.items() if len(shape) == 2}
    header["scaled_fp8"] = (0,)
    message = F.FLUX.check_header(header, model.config).message()
    assert "scaled-fp8" in message and "unquantized" in message
    # an ordinary stray key is no quantization
    plain = _header(F.FLUX.to_original(model.state_dict(), model.config)) | {"single_blocks.2.linear2.weight": (32, 160)}
    assert "scaled-fp8" not in F.FLUX.check_header(plain, model.config).message()


def test_converters_refuse_mismatched_state():
    model = _flux(guidance_embeds=True)
    original = F.FLUX.to_original(model.state_dict(), model.config)
    broken = dict(original)
    del broken["double_blocks.0.txt_attn.proj.bias"]
    with pytest.raises(KeyLayoutError, match=r"missing double_blocks\.0\.txt_attn\.proj\.bias"):
        F.FLUX.from_original(broken, model.config)
    broken = dict(original, **{"double_blocks.0.img_attn.qkv.weight": torch.zeros(95, 32)})
    with pytest.raises(KeyLayoutError, match=r"img_attn\.qkv\.weight has 95 rows"):
        F.FLUX.from_original(broken, model.config)
    # diffusers side: a key no rule covers (a LoRA-wrapped layer, say) is named, not dropped.
    state = dict(model.state_dict(), **{"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(1)})
    with pytest.raises(KeyLayoutError, match=r"unexpected transformer_blocks\.0\.attn\.to_q\.lora_A\.weight"):
        F.FLUX.to_original(state, model.config)
