"""lora.layer_filter (OneTrainer's layer filter) and lora.rank_dropout / lora.module_dropout (kohya's networks.lora)."""

from __future__ import annotations

import re

import pytest
import torch
from test_lora_variants import adapted_layers, variant_config

from ot_dist.errors import ConfigError
from ot_dist.methods.lora import ADAPTER, LoraMethod, add_adapter, suffix_matched_extras
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
