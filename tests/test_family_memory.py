"""The memory table's transformer rows and the sharding figures, from the published configs on the meta device:
the parameter counts are the published ones, every FSDP unit of Flux / SD3.5 is a few % of the model (never the
whole block list), and a rank holds 1/N of the 16 bytes a parameter of sharded state."""

import pytest

from ot_dist.memory.table import build_components, fsdp_rank_bytes, sharding_units, DENOISERS
from ot_dist.models.families.registry import get_family

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
