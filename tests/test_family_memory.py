"""The memory table's transformer rows and the sharding figures, from the published configs on the meta device:
the parameter counts are the published ones, every FSDP unit of Flux / SD3.5 is a few % of the model (never the
whole block list), and a rank holds 1/N of the 16 bytes a parameter of sharded state."""

import pytest

from ot_dist.memory.table import build_components, fsdp_rank_bytes, sharding_units, DENOISERS
from ot_dist.models.families.registry import get_family

NF4_OFFLOADED = "LoRA r16, frozen nf4 (Linear weights), text encoders + VAE offloaded"
FLOAT8_STREAMED = "LoRA r16, frozen float8, text encoders + VAE offloaded, half the blocks streamed"
NF4_STREAMED = "LoRA r16, frozen nf4 (Linear weights), text encoders + VAE offloaded, 80 % of the blocks streamed"

PUBLISHED = {"Flux.1 dev": 11.9e9, "SD3.5 Large": 8.1e9}  # BFL's and Stability's model cards
T5_XXL_ENCODER = 4.76e9


@pytest.fixture(scope="module")
def models():
    return {name: build_components(name) for name in PUBLISHED}


def test_parameter_counts_are_the_published_ones(models):
    for name, count in PUBLISHED.items():
        found = sum(p.numel() for p in models[name]["transformer"].parameters())
        assert abs(found - count) / count < 0.01, (name, found)
    t5 = models["Flux.1 dev"]["text_encoder_2"]
    assert abs(sum(p.numel() for p in t5.parameters()) - T5_XXL_ENCODER) / T5_XXL_ENCODER < 0.01


@pytest.mark.parametrize("name,family", [("Flux.1 dev", "flux"), ("SD3.5 Large", "sd3")])
def test_sharding_units_are_blocks_a_few_percent_each(models, name, family):
    transformer = models[name]["transformer"]
    # the table counts with the family module's own units
    assert DENOISERS[name][2] == get_family(family).shard_units["transformer"]
    units = sharding_units(transformer, DENOISERS[name][2])
    total = sum(p.numel() for p in transformer.parameters())
    assert len(units) == sum(len(getattr(transformer, p)) for p in DENOISERS[name][2])
    assert max(sum(p.numel() for p in u.parameters()) for u in units) / total < 0.05
    for ranks in (8, 64):
        figures = fsdp_rank_bytes(models[name], name, ranks)
        assert figures["sharded_state"] == 16 * total / ranks and figures["largest_unit_fraction"] < 0.05


# -- the sharding benchmark's figures (tests/benchmarks/bench_family_sharding.py, ot_dist.memory.sharding) ----------

FAMILIES = {"Flux.1 dev": "flux", "SD3.5 Large": "sd3"}


def build_transformer(name):
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from ot_dist.memory.table import FLUX_DEV, SD35_LARGE

    with torch.device("meta"):
        return FluxTransformer2DModel(**FLUX_DEV) if name == "Flux.1 dev" else SD3Transformer2DModel(**SD35_LARGE)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_block_units_are_small_and_whole_lists_are_not(name):
    from ot_dist.memory.sharding import sharding

    transformer = build_transformer(name)
    patterns = get_family(FAMILIES[name]).shard_units["transformer"]
    blocks, lists = sharding(transformer, patterns), sharding(transformer, patterns, per_block=False)
    total = sum(p.numel() for p in transformer.parameters())
    for s in (blocks, lists):  # units + root remainder partition the model
        assert s.parameters == total == sum(s.unit_parameters) + s.root_parameters
    assert blocks.root_parameters == lists.root_parameters < 0.01 * total  # embedders and final layer only
    assert len(blocks.unit_parameters) == sum(len(getattr(transformer, p)) for p in patterns)
    assert blocks.largest_fraction < 0.05  # every all-gather a few % of the model
    assert lists.largest_fraction > 0.5  # without block granularity one gather is over half of it
    for ranks in (8, 64):
        even = 16 * total / ranks  # float32 weight + grad + 2 AdamW moments, split evenly
        assert even <= blocks.state_bytes_per_rank(ranks) < 1.001 * even  # FSDP2's dim-0 padding is negligible
        assert blocks.state_bytes_per_rank(ranks) == lists.state_bytes_per_rank(ranks)  # grouping only moves gathers
        # the gathered bf16 copies at the worst moment: root + 2 units, a few % beside the sharded state at 8 ranks
        assert blocks.gather_peak_bytes(ranks) <= 2 * (blocks.root_parameters + 2 * blocks.largest) * 1.001
        assert blocks.gather_peak_bytes(8) < 0.1 * blocks.state_bytes_per_rank(8)


@pytest.mark.parametrize("name,ranks", [("Flux.1 dev", 8), ("Flux.1 dev", 64), ("SD3.5 Large", 8)])
def test_counted_shards_are_fsdp2s(name, ranks):
    """fully_shard the meta transformer as ot_dist's fsdp strategy does (wrap_units + root) over a fake process
    group of N ranks: rank 0's padded shards and the largest parameter group's all-gather are what the counting
    says."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ot_dist.memory.sharding import sharding
    from ot_dist.parallel.fsdp import wrap_units

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    transformer = build_transformer(name)
    patterns = get_family(FAMILIES[name]).shard_units["transformer"]
    counted = sharding(transformer, patterns)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        mesh = init_device_mesh("cpu", (ranks,))
        for unit in wrap_units(transformer, patterns):
            fully_shard(unit, mesh=mesh)
        fully_shard(transformer, mesh=mesh)
        groups = [m._get_fsdp_state()._fsdp_param_group for m in transformer.modules() if hasattr(m, "_get_fsdp_state")]
        groups = [g for g in groups if g is not None]
        assert len(groups) == len(counted.unit_parameters) + 1
        shards = [sum(fp._sharded_param_data.numel() for fp in g.fsdp_params) for g in groups]
        assert 16 * sum(shards) == counted.state_bytes_per_rank(ranks)
        assert 2 * ranks * max(shards) == counted.largest_gather_bytes(ranks)
    finally:
        dist.destroy_process_group()


def test_qwen_image_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's Qwen-Image row (ot-dist init's reference for the family) is Qwen/Qwen-Image as its configs
    build it on the meta device: the 20 B transformer (20.43 B), Qwen2.5-VL-7B-Instruct as the text encoder (8.29 B
    on its model card, the untied lm_head and the vision tower included) and the VAE; LoRA counted on the family's
    default targets, FSDP on its blocks, each a few % of the transformer; `ot-dist init` chooses from it."""
    from ot_dist.errors import ConfigError
    from ot_dist.starter.choose import choose

    family = get_family("qwen_image")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts == {"transformer": 20_430_401_088, "text_encoder": 8_292_166_656, "vae": 126_892_531}
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    units = sharding_units(components["transformer"], DENOISERS[name][2])
    assert len(units) == len(components["transformer"].transformer_blocks) == 60
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.05
    # LoRA: 28.8 B frozen parameters, 53.7 GiB in bfloat16, 26.9 GiB in float8, the transformer alone 19.0 GiB
    assert choose(family, "lora", 80, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 48, 1).setup.label == "LoRA r16, frozen float8"
    # float8 with the encoders offloaded and half the blocks streamed (OneTrainer's 24 GB preset: float8 and layer
    # offloading); nf4 with 80 % streamed on 16 GiB; nothing on 8
    assert choose(family, "lora", 24, 1).setup.label == FLOAT8_STREAMED
    assert choose(family, "lora", 16, 1).setup.label == NF4_STREAMED
    with pytest.raises(ConfigError, match="--gpu-memory"):
        choose(family, "lora", 8, 1)


def test_sana_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's Sana row (ot-dist init's reference for the family) is Sana_1600M_1024px as its configs build
    it on the meta device: the 1.6 B transformer (1,604,462,752, the diffusers conversion's count), Gemma-2-2B-IT's
    decoder as the text encoder (2.61 B on its model card, the embedding included) and the DC-AE f32c32; LoRA counted on
    the family's default targets, FSDP on its 20 blocks, each under 5 % of the transformer; `ot-dist init` chooses
    from it."""
    from ot_dist.errors import ConfigError
    from ot_dist.starter.choose import choose

    family = get_family("sana")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts == {"transformer": 1_604_462_752, "text_encoder": 2_614_341_888, "vae": 312_250_275}
    assert components["vae"].config.scaling_factor == 0.41407  # what Sana's latents are scaled by
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    units = sharding_units(components["transformer"], DENOISERS[name][2])
    assert len(units) == len(components["transformer"].transformer_blocks) == 20
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.05
    # LoRA: 4.2 B frozen parameters, 7.8 GiB in bfloat16 (+ 2.5 GiB activations), 3.9 GiB in float8
    assert choose(family, "lora", 24, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 8, 1).setup.label == "LoRA r16, frozen float8"
    # a full finetune: AdamW on one 48 GB GPU, sharded AdamW over 8 smaller ones, none on one 8 GB GPU
    assert choose(family, "full", 48, 1).setup.label == "full denoiser, AdamW, frozen bfloat16"
    assert choose(family, "full", 16, 8).strategy == "fsdp"
    with pytest.raises(ConfigError, match="--gpu-memory"):
        choose(family, "full", 8, 1)


def test_lumina2_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's Lumina 2 row (ot-dist init's reference for the family) is Lumina-Image-2.0 as its configs
    build it on the meta device: the 2.61 B transformer, Gemma-2-2B's decoder (2.61 B) and the Flux VAE; LoRA counted
    on the family's default targets; FSDP on its 2 + 2 refiner and 26 joint blocks (Lumina2Transformer2DModel's
    _no_split_modules, each 3.3 % of the transformer), the root's remainder (embedders, final layer) under 1 %;
    Gemma's units are Sana's (its embedding table one of them); `ot-dist init` chooses from it."""
    from ot_dist.errors import ConfigError
    from ot_dist.memory.sharding import sharding
    from ot_dist.starter.choose import choose

    family = get_family("lumina2")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts == {"transformer": 2_609_769_152, "text_encoder": 2_614_341_888, "vae": 83_819_683}
    assert components["transformer"].config.cap_feat_dim == components["text_encoder"].config.hidden_size
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    transformer = components["transformer"]
    units = sharding_units(transformer, DENOISERS[name][2])
    assert len(units) == 2 + 2 + 26
    assert {type(unit).__name__ for unit in units} == set(transformer._no_split_modules)
    sharded = fsdp_rank_bytes(components, name, 8)
    assert sharded["largest_unit_fraction"] < 0.05
    assert 1 - sum(sum(p.numel() for p in unit.parameters()) for unit in units) / counts["transformer"] < 0.01
    gemma = sharding(components["text_encoder"], family.shard_units["text_encoder"])
    assert gemma.unit_parameters[0] == components["text_encoder"].embed_tokens.weight.numel()
    assert len(gemma.unit_parameters) == 1 + 26
    # LoRA: 5.3 B frozen parameters, 10.0 GiB in bfloat16 (+ 6 GiB activations), 5.1 GiB in float8
    assert choose(family, "lora", 24, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 12, 1).setup.label == "LoRA r16, frozen float8"
    # a full finetune: AdamW on one 80 GB GPU, sharded AdamW over 8 24 GB ones, the fused bfloat16 Adafactor setup
    # (4.9 GiB + 6 GiB activations) on one 12 GB GPU, with 80 % of its blocks' trained weights streamed (1.5 GiB
    # + 6 GiB) on one 8 GB GPU, none on one 6 GB GPU
    assert choose(family, "full", 80, 1).setup.label == "full denoiser, AdamW, frozen bfloat16"
    assert choose(family, "full", 24, 8).strategy == "fsdp"
    assert choose(family, "full", 12, 1).setup.fused_back_pass and not choose(family, "full", 12, 1).setup.streamed
    assert choose(family, "full", 8, 1).setup.streamed == 0.8
    with pytest.raises(ConfigError, match="--gpu-memory"):
        choose(family, "full", 6, 1)


def test_z_image_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's Z-Image row (ot-dist init's reference for the family) is Tongyi-MAI/Z-Image-Turbo as its
    configs build it on the meta device: the 6 B transformer (6,154,908,736), Qwen3-4B's decoder as the text encoder
    (4.02 B on its model card, the tied embedding once) and the Flux VAE; LoRA counted on the family's default targets,
    FSDP on its 30 layers and 2 + 2 refiner blocks, each under 3 % of the transformer; `ot-dist init` chooses from it."""
    from ot_dist.starter.choose import choose

    family = get_family("z_image")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts == {"transformer": 6_154_908_736, "text_encoder": 4_022_468_096, "vae": 83_819_683}
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    units = sharding_units(components["transformer"], DENOISERS[name][2])
    assert len(units) == 30 + 2 + 2
    # the units are the transformer's own _no_split_modules (ZImageTransformerBlock), the refiners' included
    assert {type(unit).__name__ for unit in units} == set(components["transformer"]._no_split_modules)
    assert sum(len(getattr(components["transformer"], n)) for n in DENOISERS[name][2]) == len(units)
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.03
    # Qwen3's embedding table is its own text-encoder unit: 10 % of the encoder, never held whole in the root
    text_units = sharding_units(components["text_encoder"], family.shard_units["text_encoder"])
    assert components["text_encoder"].embed_tokens in text_units and len(text_units) == 1 + 36
    # LoRA: 10.3 B frozen parameters, 19.1 GiB in bfloat16, 9.6 GiB in float8
    assert choose(family, "lora", 48, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 24, 1).setup.label == "LoRA r16, frozen float8"
    assert choose(family, "full", 24, 8).strategy == "fsdp"


@pytest.mark.parametrize("name,expected", [
    # FLUX.2 [dev]: the 32 B transformer, Mistral-Small-3.1-24B (vision tower and untied lm_head included), the VAE
    ("flux2", {"transformer": 32_223_281_152, "text_encoder": 24_011_361_280, "vae": 84_046_115}),
    # FLUX.2 [klein] base 9B: 9.08 B, Qwen3-8B with its untied lm_head
    ("flux2_klein", {"transformer": 9_078_581_248, "text_encoder": 8_190_735_360, "vae": 84_046_115})])
def test_flux2_memory_rows_are_the_published_models_sharded_by_block(name, expected):
    """The memory table's FLUX.2 rows are the published configs built on the meta device; LoRA counted on the family's
    default targets, FSDP on its double and single blocks: [dev]'s double blocks are its largest units at 3.1 % of the
    transformer (0.98 B each), the root (embedders, the shared modulations) 2.5 %; each text-encoder layer a few %
    of Mistral-3 / Qwen3. `ot-dist init` chooses from the rows."""
    from ot_dist.errors import ConfigError
    from ot_dist.memory.sharding import sharding
    from ot_dist.memory.table import lora_shapes
    from ot_dist.starter.choose import choose

    family = get_family(name)
    components = build_components(family.memory_reference)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts == expected
    assert DENOISERS[family.memory_reference][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[family.memory_reference][2] == family.shard_units["transformer"]
    transformer = components["transformer"]
    units = sharding(transformer, family.shard_units["transformer"])
    blocks = len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
    assert len(units.unit_parameters) == blocks == (56 if name == "flux2" else 32)
    # [klein] 9B: double blocks 4.8 %, the root 3.9 % (its modulations are as wide as the blocks)
    assert units.largest_fraction < 0.05 and units.root_parameters / units.parameters < (0.03 if name == "flux2" else 0.04)
    assert fsdp_rank_bytes(components, family.memory_reference, 8)["largest_unit_fraction"] < 0.05
    text = sharding(components["text_encoder"], family.shard_units["text_encoder"])
    assert len(text.unit_parameters) == (40 if name == "flux2" else 36)
    assert max(text.unit_parameters) / text.parameters < 0.03
    # the LoRA on the default targets: q / k / v / out of the double blocks, both projections of every single block
    shapes = lora_shapes(transformer, targets=family.denoiser_lora_presets["default"])
    assert len(shapes) == 2 * (4 * len(transformer.transformer_blocks) + 2 * len(transformer.single_transformer_blocks))
    if name == "flux2":
        # LoRA: 56 B frozen parameters: float8 and the encoders offloaded on a 48 GiB GPU; on 24 GiB nf4 with 80 % of
        # the blocks streamed; none on 16 GiB
        assert choose(family, "lora", 48, 1).setup.label == "LoRA r16, frozen float8, text encoders + VAE offloaded"
        assert choose(family, "lora", 24, 1).setup.label == NF4_STREAMED
        assert choose(family, "full", 80, 8).strategy == "fsdp"
        with pytest.raises(ConfigError, match="--gpu-memory"):
            choose(family, "lora", 16, 1)


def test_hidream_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's HiDream-I1 row (ot-dist init's reference for the family) is HiDream-I1-Full as its configs
    build it on the meta device: the 17 B transformer with its experts, CLIP-L and CLIP-G (248 positions), T5-XXL's
    encoder, Llama-3.1-8B-Instruct (8.03 B on its model card, untied lm_head) and the Flux VAE; FSDP on its 48 blocks,
    each a few % of the transformer (a block holds its 4 routed experts, its shared one and its gate); Llama's
    embedding table and lm_head units of their own; `ot-dist init` chooses from it."""
    from ot_dist.errors import ConfigError
    from ot_dist.memory.sharding import sharding
    from ot_dist.starter.choose import choose

    family = get_family("hidream")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts["transformer"] == 17_105_733_184 and counts["text_encoder_4"] == 8_030_261_248
    assert abs(counts["text_encoder_3"] - T5_XXL_ENCODER) / T5_XXL_ENCODER < 0.01
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    units = sharding(components["transformer"], family.shard_units["transformer"])
    assert len(units.unit_parameters) == 16 + 32 and units.largest_fraction < 0.05
    assert units.root_parameters / units.parameters < 0.05  # embedders, caption projections, final layer
    llama = components["text_encoder_4"]
    units = sharding(llama, family.shard_units["text_encoder_4"])
    assert len(units.unit_parameters) == 1 + 32 + 1 and units.largest_fraction < 0.07
    assert units.root_parameters == llama.model.norm.weight.numel()
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.05
    # LoRA: 30.8 B frozen parameters, 57.6 GiB in bfloat16, 28.9 GiB in float8
    assert choose(family, "lora", 80, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 48, 1).setup.label == "LoRA r16, frozen float8"
    assert choose(family, "full", 80, 8).strategy == "fsdp"
    assert choose(family, "lora", 12, 1).setup.label == NF4_STREAMED  # 80 % of the blocks in CPU memory
    with pytest.raises(ConfigError, match="--gpu-memory"):
        choose(family, "lora", 8, 1)


def test_flux_kontext_memory_row_is_flux_devs_weights_with_more_activations():
    """Flux.1 Kontext dev's row (ot-dist init's reference for flux_kontext) counts Flux.1 dev's published weights and
    sharding units; its activation allowance is larger (twice the image tokens), so init needs more per GPU."""
    from ot_dist.starter.choose import ACTIVATIONS_GIB, choose

    kontext = build_components("Flux.1 Kontext dev")
    total = sum(p.numel() for p in kontext["transformer"].parameters())
    assert abs(total - PUBLISHED["Flux.1 dev"]) / PUBLISHED["Flux.1 dev"] < 0.01
    assert DENOISERS["Flux.1 Kontext dev"][2] == get_family("flux_kontext").shard_units["transformer"]
    assert fsdp_rank_bytes(kontext, "Flux.1 Kontext dev", 8)["largest_unit_fraction"] < 0.05
    assert ACTIVATIONS_GIB["Flux.1 Kontext dev"] > ACTIVATIONS_GIB["Flux.1 dev"]
    flux, edit = (choose(get_family(name), "lora", 80, 1) for name in ("flux", "flux_kontext"))
    assert edit.reference == "Flux.1 Kontext dev" and edit.need_gib > flux.need_gib


def test_qwen_image_edit_memory_row_is_qwen_images_weights_with_more_activations():
    """Qwen-Image-Edit's row (ot-dist init's reference for qwen_image_edit) counts Qwen-Image's published weights and
    sharding units; its activation allowance is larger (the reference's latent and vision tokens), so init needs more."""
    from ot_dist.starter.choose import ACTIVATIONS_GIB, choose

    edit = build_components("Qwen-Image-Edit")
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in edit.items()}
    assert counts == {"transformer": 20_430_401_088, "text_encoder": 8_292_166_656, "vae": 126_892_531}  # Qwen-Image's
    assert DENOISERS["Qwen-Image-Edit"][2] == get_family("qwen_image_edit").shard_units["transformer"]
    assert fsdp_rank_bytes(edit, "Qwen-Image-Edit", 8)["largest_unit_fraction"] < 0.05
    assert ACTIVATIONS_GIB["Qwen-Image-Edit"] > ACTIVATIONS_GIB["Qwen-Image"]
    plain, edited = (choose(get_family(name), "lora", 80, 1) for name in ("qwen_image", "qwen_image_edit"))
    assert edited.reference == "Qwen-Image-Edit" and edited.need_gib > plain.need_gib


def test_wan_memory_row_is_the_published_14b_model_sharded_by_block():
    """The memory table's Wan row (ot-dist init's reference for the family) is Wan2.1-T2V-14B as its configs build it on
    the meta device: the 14.3 B transformer (the model card's 14 B), UMT5-XXL's encoder (5.68 B, its 256 k vocabulary
    included) and the Wan VAE (127 M, the 508 MB float32 Wan2.1_VAE.pth); LoRA counted on the family's default
    targets, FSDP on its 40 blocks (WanTransformer3DModel._no_split_modules), each 2.5 % of the transformer."""
    from ot_dist.errors import ConfigError
    from ot_dist.starter.choose import choose

    family = get_family("wan")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert abs(counts["transformer"] - 14.0e9) / 14.0e9 < 0.03
    assert abs(counts["text_encoder"] - 5.68e9) / 5.68e9 < 0.01 and abs(counts["vae"] - 127e6) / 127e6 < 0.01
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    units = sharding_units(components["transformer"], DENOISERS[name][2])
    assert len(units) == len(components["transformer"].blocks) == 40
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.03
    assert choose(family, "lora", 48, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 24, 1).setup.label == "LoRA r16, frozen float8"
    assert choose(family, "full", 48, 8).strategy == "fsdp"
    # streamed blocks: float8 with half of them on 16 GiB, nf4 (Linear weights in 0.52 bytes) with 80 % on 12 and 8
    assert choose(family, "lora", 16, 1).setup.label == FLOAT8_STREAMED
    assert choose(family, "lora", 12, 1).setup.label == choose(family, "lora", 8, 1).setup.label == NF4_STREAMED
    with pytest.raises(ConfigError, match="--gpu-memory"):
        choose(family, "lora", 6, 1)


def test_krea2_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's Krea 2 row (ot-dist init's reference for the family) is krea/Krea-2-Raw as its configs build it
    on the meta device: the 12.8 B transformer (28 blocks 6144 wide and the text fusion), Qwen3-VL-4B's Qwen3VLModel
    (the 4.02 B language model, as Qwen3-4B's, and the 0.42 B vision tower) and Qwen-Image's VAE; LoRA counted on the
    family's default targets (the training script's), FSDP on its 28 blocks and 2 + 2 text-fusion blocks
    (_no_split_modules), each 3.4 % of the transformer at most; Qwen3-VL's embedding table is its own unit."""
    from ot_dist.errors import ConfigError
    from ot_dist.starter.choose import choose

    family = get_family("krea2")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts == {"transformer": 12_820_073_036, "text_encoder": 4_437_815_808, "vae": 126_892_531}
    text = components["text_encoder"]
    assert sum(p.numel() for p in text.language_model.parameters()) == 4_022_468_096  # Qwen3-4B's decoder
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    units = sharding_units(components["transformer"], DENOISERS[name][2])
    assert len(units) == 28 + 2 + 2
    assert {type(unit).__name__ for unit in units} == {"Krea2TransformerBlock", "Krea2TextFusionBlock"}
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.035
    text_units = sharding_units(text, family.shard_units["text_encoder"])
    assert text.language_model.embed_tokens in text_units and len(text_units) == 1 + 36
    # LoRA: 17.4 B frozen parameters, 32 GiB in bfloat16 (+ 6.5 GiB activations), 16 GiB in float8
    assert choose(family, "lora", 48, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 24, 1).setup.label == "LoRA r16, frozen float8"
    assert choose(family, "full", 48, 8).strategy == "fsdp"
    # streamed blocks: float8 with half of them on 16 GiB, nf4 (Linear weights in 0.52 bytes) with 80 % on 12
    assert choose(family, "lora", 16, 1).setup.label == FLOAT8_STREAMED
    assert choose(family, "lora", 12, 1).setup.label == NF4_STREAMED
    with pytest.raises(ConfigError, match="--gpu-memory"):
        choose(family, "lora", 8, 1)


def test_ernie_image_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's ERNIE-Image row (ot-dist init's reference for the family) built on the meta device: the 8 B
    transformer (ComfyUI's ERNIE-Image defaults, the model card's "8B DiT"), Mistral3Model of Ministral-3 3B (its card's
    3.4 B language model and 0.4 B vision tower) and FLUX.2's VAE; LoRA counted on the family's default targets, FSDP
    on its 36 layers, each under 3 % of the transformer; `ot-dist init` chooses from it."""
    from ot_dist.starter.choose import choose

    family = get_family("ernie_image")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts == {"transformer": 8_033_490_048, "text_encoder": 3_849_090_048, "vae": 84_046_115}
    language = sum(p.numel() for p in components["text_encoder"].language_model.parameters())
    assert 3.4e9 < language < 3.45e9
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    assert len(sharding_units(components["transformer"], DENOISERS[name][2])) == 36
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.03
    assert len(sharding_units(components["text_encoder"], family.shard_units["text_encoder"])) == 26
    # LoRA: 11.97 B frozen parameters, 22.3 GiB in bfloat16, 11.1 GiB in float8
    assert choose(family, "lora", 48, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 24, 1).setup.label == "LoRA r16, frozen float8"
    assert choose(family, "full", 24, 8).strategy == "fsdp"


def test_anima_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's Anima row (ot-dist init's reference for the family) is circlestone-labs/Anima as diffusers'
    convert_anima_to_diffusers.py builds it on the meta device: the 1.96 B transformer (Cosmos-Predict2 2B's config),
    Qwen3-0.6B's decoder (0.6 B), the LLM adapter (AnimaTextConditioner's defaults) and the Qwen-Image VAE (127 M); LoRA
    counted on the family's default targets, FSDP on its 28 blocks (CosmosTransformer3DModel._no_split_modules), each
    3.5 % of the transformer; the adapter's and Qwen3's embedding tables are units of their own."""
    from ot_dist.starter.choose import choose

    family = get_family("anima")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts == {"transformer": 1_956_405_248, "text_encoder": 596_049_920, "text_conditioner": 134_663_680,
                      "vae": 126_892_531}
    assert set(components) - {"vae"} == {family.denoiser, *family.text_encoders}
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    units = sharding_units(components["transformer"], DENOISERS[name][2])
    assert len(units) == len(components["transformer"].transformer_blocks) == 28
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.04
    for part, embedding in (("text_encoder", "embed_tokens"), ("text_conditioner", "embed")):
        text_units = sharding_units(components[part], family.shard_units[part])
        assert getattr(components[part], embedding) in text_units
    # 2.8 B frozen parameters beside a LoRA: 5.2 GiB in bfloat16, 2.6 GiB in float8
    assert choose(family, "lora", 16, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 8, 1).setup.label == "LoRA r16, frozen float8"
    assert choose(family, "full", 16, 8).strategy == "fsdp"


def test_ideogram4_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's Ideogram 4 row (ot-dist init's reference for the family): two transformers of
    Ideogram4Transformer2DModel's default config (9.28 B each: 34 blocks of 4608 wide, the 53248-wide text projection),
    Qwen3-VL-8B-Instruct's Qwen3VLModel (its model card's 8.77 B less the 0.62 B untied lm_head the pipeline does not
    load) and the FLUX.2 VAE; LoRA counted on the family's default targets, FSDP on its 34 blocks
    (_no_split_modules), each under 3.2 % of the transformer. The frozen unconditional transformer stays on the device
    in every setup (sampling runs it, Family.sampling_modules), offloaded ones too."""
    from ot_dist.errors import ConfigError
    from ot_dist.memory.table import RESIDENT_COMPONENTS, SETUPS, model_sizes, setup_bytes
    from ot_dist.starter.choose import choose

    family = get_family("ideogram4")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert counts == {"transformer": 9_279_288_448, "unconditional_transformer": 9_279_288_448,
                      "text_encoder": 8_144_793_840, "vae": 84_046_115}
    lm_head = 151936 * 4096
    assert abs(counts["text_encoder"] + lm_head - 8.77e9) / 8.77e9 < 0.005
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    units = sharding_units(components["transformer"], DENOISERS[name][2])
    assert len(units) == 34
    assert {type(unit).__name__ for unit in units} == set(components["transformer"]._no_split_modules)
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.032
    # Qwen3-VL's embedding table is its own text-encoder unit (7.6 % of it), beside its 36 decoder layers
    text_units = sharding_units(components["text_encoder"], family.shard_units["text_encoder"])
    assert components["text_encoder"].language_model.embed_tokens in text_units and len(text_units) == 1 + 36
    # the offloaded LoRA setup keeps both transformers: 18.6 B frozen parameters in float8
    assert "unconditional_transformer" in RESIDENT_COMPONENTS
    offloaded = next(s for s in SETUPS if s.trained == "lora" and s.offload)
    sizes = model_sizes(components, DENOISERS[name][1])
    assert setup_bytes(offloaded, sizes) > 2 * counts["transformer"]
    assert choose(family, "lora", 80, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 48, 1).setup.label == "LoRA r16, frozen float8"
    assert choose(family, "full", 48, 8).strategy == "fsdp"
    # nf4 (its Linear weights in 0.52 bytes) with the encoders offloaded: the last setup that fits
    assert choose(family, "lora", 16, 1).setup.label == NF4_OFFLOADED
    with pytest.raises(ConfigError, match="--gpu-memory"):
        choose(family, "lora", 12, 1)


def test_hunyuan_video_memory_row_is_the_published_model_sharded_by_block():
    """The memory table's HunyuanVideo row (ot-dist init's reference for the family) as hunyuanvideo-community/
    HunyuanVideo's configs build it on the meta device: the 12.8 B transformer (the model card's 13 B),
    Llava-Llama-3-8B's LlamaModel (7.50 B: Llama-3-8B's 8.03 B less its lm_head, with LLaVA's 64 added tokens),
    CLIP-L's text model and the 246 M VAE; LoRA counted on the family's default targets, FSDP on its 20 dual- and 40
    single-stream blocks (HunyuanVideoTransformer3DModel._no_split_modules), the largest unit (the root: embedders and
    token refiner) under 3 % of the transformer."""
    from ot_dist.errors import ConfigError
    from ot_dist.starter.choose import choose

    family = get_family("hunyuan_video")
    name = family.memory_reference
    components = build_components(name)
    counts = {part: sum(p.numel() for p in module.parameters()) for part, module in components.items()}
    assert abs(counts["transformer"] - 12.8e9) / 12.8e9 < 0.01
    assert abs(counts["text_encoder"] - 7.50e9) / 7.50e9 < 0.01 and abs(counts["vae"] - 246e6) / 246e6 < 0.01
    assert abs(counts["text_encoder_2"] - 123e6) / 123e6 < 0.01
    assert DENOISERS[name][1] == family.denoiser_lora_presets["default"]
    assert DENOISERS[name][2] == family.shard_units["transformer"]
    transformer = components["transformer"]
    units = sharding_units(transformer, DENOISERS[name][2])
    assert len(units) == len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks) == 60
    assert fsdp_rank_bytes(components, name, 8)["largest_unit_fraction"] < 0.03
    assert choose(family, "lora", 48, 1).setup.label == "LoRA r16, frozen bfloat16"
    assert choose(family, "lora", 24, 1).setup.label == "LoRA r16, frozen float8, text encoders + VAE offloaded"
    assert choose(family, "full", 48, 8).strategy == "fsdp"
    # float8 with half the blocks streamed on 16 GiB; nf4 (Linear weights in 0.52 bytes) whole on 12, 80 % streamed
    # on 8
    assert choose(family, "lora", 16, 1).setup.label == FLOAT8_STREAMED
    assert choose(family, "lora", 12, 1).setup.label == NF4_OFFLOADED
    assert choose(family, "lora", 8, 1).setup.label == NF4_STREAMED
    with pytest.raises(ConfigError, match="--gpu-memory"):
        choose(family, "lora", 6, 1)


@pytest.mark.parametrize("family_name", ["sd1", "sdxl", "sd3", "flux", "hidream", "stable_cascade", "hunyuan_video"])
def test_every_text_encoder_shards_by_layer(family_name):
    """Each text encoder's declared units are found in the published architecture (on the meta device): a pattern
    naming a level the class lacks (CLIPTextModel has no `text_model.` level in transformers 5) would leave the
    whole encoder one FSDP unit, gathered at once, when a text encoder trains under fsdp."""
    family = get_family(family_name)
    components = build_components(family.memory_reference)
    for part in family.text_encoders:
        if part not in components or part not in family.shard_units:
            continue
        encoder = components[part]
        units = sharding_units(encoder, family.shard_units[part])
        total = sum(p.numel() for p in encoder.parameters())
        assert len(units) >= 12, (part, len(units))
        assert max(sum(p.numel() for p in unit.parameters()) for unit in units) < 0.1 * total, part
