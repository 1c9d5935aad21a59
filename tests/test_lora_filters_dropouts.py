"""lora.layer_filter (OneTrainer's layer filter) and lora.rank_dropout / lora.module_dropout (kohya's networks.lora)."""

from __future__ import annotations

import re

import pytest
import torch
from test_lora_variants import adapted_layers, lora_b_inputs, variant_config

from ot_dist.errors import ConfigError
from ot_dist.methods.lora import LoraMethod, add_adapter, suffix_matched_extras
from ot_dist.methods.lora_variants import peft_config
from ot_dist.models.loading import load_model


def onetrainer_rule(module: torch.nn.Module, patterns: list[str], regex: bool) -> set[str]:
    """OneTrainer's documented rule (ModuleFilter): a Linear / Conv2d layer whose path contains a pattern (regex:
    re.search finds it); an empty pattern selects every one."""
    def hit(pattern, path):
        return not pattern or (re.search(pattern, path) is not None if regex else pattern in path)

    return {path for path, sub in module.named_modules() if isinstance(sub, (torch.nn.Linear, torch.nn.Conv2d))
            and any(hit(p, path) for p in patterns)}


def adapted(config, rule=lambda denoiser: None) -> tuple[set[str], object]:
    """(the adapted denoiser paths, `rule` applied to the denoiser before it is adapted)."""
    model = load_model(config.model)
    expected = rule(model.denoiser)
    LoraMethod(config).prepare(model)
    return set(adapted_layers(model.denoiser)), expected


# OneTrainer's own ModuleFilter, run on these tiny UNets (see the report of the branch), selected the same layers:
# sd1 80, 100, 6, 12, 181 layers; sdxl 110.
@pytest.mark.parametrize("family, patterns, regex", [
    ("sd1", ["attn"], False),
    ("sd1", ["transformer_block"], False),  # the "blocks" preset
    ("sd1", [r"down_blocks\.[01]\..*(to_q|conv1)$"], True),
    ("sd1", [r"^conv_(in|out)$", r"ff\.net\.2"], True),
    ("sd1", ["attn", ""], False),  # OneTrainer's "attn," has an empty pattern: every layer
    ("sdxl", ["transformer_block"], False),
])
def test_layer_filter_adapts_the_layers_onetrainer_selects(tiny_models, shapes_data, tmp_path, family, patterns, regex):
    config = variant_config(tiny_models, shapes_data, tmp_path, "lora", family=family, **{
        "lora.layer_filter": patterns, "lora.layer_filter_regex": regex, "text_encoder.train": False})
    got, (expected, every) = adapted(config, lambda denoiser: (onetrainer_rule(denoiser, patterns, regex),
                                                               onetrainer_rule(denoiser, [""], False)))
    assert got == expected
    assert got and (len(got) < len(every) or "" in patterns)  # a selection, but with the empty pattern


def test_layer_filter_takes_exactly_the_selected_paths_not_their_suffix_namesakes():
    """peft adapts a target and every module whose path ends in ".<target>": a filter selecting a top-level proj_out
    must leave the blocks' proj_out alone (Flux's single blocks have one)."""
    toy = torch.nn.Module()
    toy.proj_out = torch.nn.Linear(4, 4)
    toy.blocks = torch.nn.ModuleList([torch.nn.Module()])
    toy.blocks[0].proj_out = torch.nn.Linear(4, 4)
    config = peft_config("lora", 2, 1.0, 0.0, ["proj_out"])
    config.exclude_modules = suffix_matched_extras(toy, ["proj_out"])
    add_adapter(toy, config)
    assert set(adapted_layers(toy)) == {"proj_out"}


def test_flux_filter_on_the_top_level_proj_out_adapts_it_alone(family_models, shapes_data, tmp_path):
    """The wiring of the above: Flux's single blocks have a proj_out each, which peft took too."""
    config = variant_config(family_models, shapes_data, tmp_path, "lora", family="flux", **{
        "lora.layer_filter": ["^proj_out$"], "lora.layer_filter_regex": True, "text_encoder.train": False})
    got, expected = adapted(config, lambda denoiser: onetrainer_rule(denoiser, ["^proj_out$"], True))
    assert got == expected == {"proj_out"}


def test_layer_filter_errors_name_the_field(tiny_models, shapes_data, tmp_path):
    with pytest.raises(Exception, match=r"lora\.layer_filter\[1\]: .*not a regular expression"):
        variant_config(tiny_models, shapes_data, tmp_path, "lora", **{
            "lora.layer_filter": ["attn", "attn(1|2"], "lora.layer_filter_regex": True})
    config = variant_config(tiny_models, shapes_data, tmp_path, "lora", **{"lora.layer_filter": ["attn", "to_qq"]})
    with pytest.raises(ConfigError, match=r"lora\.layer_filter\[1\]: 'to_qq' selects no"):
        adapted(config)
    with pytest.raises(Exception, match=r"lora\.layer_filter: .*lora\.unet_targets"):
        variant_config(tiny_models, shapes_data, tmp_path, "lora", **{"lora.layer_filter": ["attn"],
                                                                      "lora.unet_targets": ["to_q"]})
    with pytest.raises(Exception, match=r"lora\.layer_filter_regex"):
        variant_config(tiny_models, shapes_data, tmp_path, "lora", **{"lora.layer_filter_regex": True})


# ---- kohya's rank_dropout / module_dropout ------------------------------------------------------------------------
def kohya_rank_features(lx: torch.Tensor, rank_dropout: float) -> torch.Tensor:
    """kohya's networks/lora.py LoRAModule.forward, rank dropout (drawn after its module dropout): a mask of
    rand(batch, rank) > p, unsqueezed at dim 1 for [B, T, r] and at the end for a conv's [B, r, H, W], and the
    product scaled by 1 / (1 - p)."""
    mask = torch.rand((lx.size(0), lx.size(1) if lx.dim() == 4 else lx.size(-1))) > rank_dropout
    mask = mask.unsqueeze(-1).unsqueeze(-1) if lx.dim() == 4 else mask.unsqueeze(1) if lx.dim() == 3 else mask
    return lx * mask / (1 - rank_dropout)


def sample_input(layer) -> torch.Tensor:
    base = layer.get_base_layer()
    return torch.randn(3, base.in_channels, 5, 5) if isinstance(base, torch.nn.Conv2d) else \
        torch.randn(3, 7, base.in_features)


@pytest.fixture
def rank_dropped_layers(tiny_models, shapes_data, tmp_path):
    config = variant_config(tiny_models, shapes_data, tmp_path, "lora", **{
        "lora.rank_dropout": 0.25, "lora.module_dropout": 0.4, "lora.preset": "all_layers", "text_encoder.train": False})
    model = load_model(config.model)
    LoraMethod(config).prepare(model)
    layers = list(adapted_layers(model.denoiser).values())
    assert {type(layer.get_base_layer()) for layer in layers} == {torch.nn.Linear, torch.nn.Conv2d}
    return layers


def test_rank_and_module_dropout_are_kohyas_forward_with_the_same_draws(rank_dropped_layers):
    """With the same seed each layer drops what kohya's LoRAModule drops: the whole adapter when torch.rand(1) < 0.4,
    else the rank features of kohya's mask, scaled; about 40% of the forwards skip the adapter; in eval mode nothing
    is dropped."""
    skipped = forwards = 0
    for i, layer in enumerate(rank_dropped_layers[::6]):
        x = sample_input(layer)
        layer.train()
        for seed in range(6 * i, 6 * i + 6):
            torch.manual_seed(seed)
            received, down = lora_b_inputs(layer, x)
            torch.manual_seed(seed)
            if torch.rand(1) < 0.4:
                expected = torch.zeros_like(down)
                skipped += 1
            else:
                expected = kohya_rank_features(down, 0.25)
            torch.testing.assert_close(received, expected)
            forwards += 1
        layer.eval()
        received, down = lora_b_inputs(layer, x)
        torch.testing.assert_close(received, down)
    assert forwards > 100 and abs(skipped / forwards - 0.4) < 0.1


def test_rank_dropout_keeps_the_mean_and_one_mask_per_sample(rank_dropped_layers):
    """Statistics, without kohya's draws: a kept rank feature keeps every token of its sample (one mask per sample,
    over tokens and pixels), about 75% are kept, and the scale keeps the mean change (E = the undropped one)."""
    layer = next(layer for layer in rank_dropped_layers if isinstance(layer.get_base_layer(), torch.nn.Linear))
    layer.train()
    x = torch.randn(400, 7, layer.get_base_layer().in_features)
    torch.manual_seed(0)
    kept = []
    for _ in range(50):
        received, down = lora_b_inputs(layer, x)
        if received.abs().sum() == 0:  # a forward module dropout skipped
            continue
        keep = received != 0
        assert (keep == keep[:, :1, :]).all()  # the same ranks for every token of a sample
        torch.testing.assert_close(received[keep], down[keep] / 0.75)
        kept.append(keep[:, 0, :].float().mean())
    assert 15 < len(kept) < 45 and abs(torch.stack(kept).mean() - 0.75) < 0.02


def test_rank_and_module_dropout_are_refused_for_the_variants(tiny_models, shapes_data, tmp_path):
    for variant in ("dora", "loha", "lokr"):
        for key in ("rank_dropout", "module_dropout"):
            with pytest.raises(Exception, match=rf"lora\.{key}: .*variant {variant}"):
                variant_config(tiny_models, shapes_data, tmp_path, variant, **{f"lora.{key}": 0.1})


def test_kohya_import_maps_rank_and_module_dropout_of_networks_lora(tmp_path):
    from test_import_kohya import imported, images, minimal

    images(tmp_path / "d" / "1_x", 1)
    config, _, err = imported(tmp_path, minimal(tmp_path) + 'network_module = "networks.lora"\n'
                              'network_args = ["rank_dropout=0.1", "module_dropout=0.2"]\n', "--script",
                              "train_network.py")
    assert (config["lora"]["rank_dropout"], config["lora"]["module_dropout"]) == (0.1, 0.2)
    assert "rank_dropout" not in err and "module_dropout" not in err
    config, _, err = imported(tmp_path, minimal(tmp_path) + 'network_module = "lycoris.kohya"\n'
                              'network_args = ["algo=locon", "rank_dropout=0.1"]\n', "--script", "train_network.py")
    assert "rank_dropout" not in config["lora"] and "network_args rank_dropout=0.1: LyCORIS'" in err
