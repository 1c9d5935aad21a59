"""The family-contract refactor must not change what SD 1.x / 2.x / SDXL train: the losses of fixed-seed
runs (epsilon / v, min-SNR, offset noise, input perturbation, masked, inpainting, cached latents and text,
LoRA, embedding, text encoders) equal, bit for bit, the values recorded before it."""

import importlib.util
import json
import tempfile
from pathlib import Path

_spec = importlib.util.spec_from_file_location("family_regression", Path(__file__).parent / "helpers" / "family_regression.py")
family_regression = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(family_regression)


def test_sd_family_losses_are_bit_identical_to_the_recorded_ones():
    expected = json.loads(family_regression.RECORD.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        found = family_regression.run_cases(Path(tmp))
    assert found.keys() == expected.keys()
    for name in expected:
        assert found[name] == expected[name], f"{name}: losses changed: {found[name]} != {expected[name]}"
