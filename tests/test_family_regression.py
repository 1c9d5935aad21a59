"""The family-contract refactor must not change what SD 1.x / 2.x / SDXL train: the losses of fixed-seed
runs (epsilon / v, min-SNR, offset noise, input perturbation, masked, inpainting, cached latents and text,
LoRA, embedding, text encoders) equal the values recorded before it, to the last bits of float32.

Not bit for bit: the same code gives losses one float32 step apart on another machine or build of the numeric
libraries (seen: 0.85573047 here against 0.85573059 recorded, 1.4e-7 relative, with everything else equal), while a
change of behaviour moves them by 1e-3 or more (the soft-mask clamp of issue 17 moved sd1_masked by 0.0115)."""

import importlib.util
import math
import json
import tempfile
from pathlib import Path

_spec = importlib.util.spec_from_file_location("family_regression", Path(__file__).parent / "helpers" / "family_regression.py")
family_regression = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(family_regression)


REL_TOL = 2e-6  # a few float32 steps


def test_sd_family_losses_equal_the_recorded_ones():
    expected = json.loads(family_regression.RECORD.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        found = family_regression.run_cases(Path(tmp))
    assert found.keys() == expected.keys()
    for name in expected:
        assert len(found[name]) == len(expected[name]) and all(
            math.isclose(a, b, rel_tol=REL_TOL) for a, b in zip(found[name], expected[name])
        ), f"{name}: losses changed: {found[name]} != {expected[name]}"
