"""Losses of the SD 1.x / 2.x / SDXL families for fixed seeds, recorded before the family-contract
refactor (tests/data/family_regression.json) and compared bit for bit after it.

`python tests/helpers/family_regression.py record` rewrites the file: only ever do that on a commit whose
losses are known good, since the test then guards those values.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

RECORD = Path(__file__).resolve().parent.parent / "data" / "family_regression.json"

# Each case: family, method, config overrides. Together they exercise every branch of the objective the
# refactor moves: epsilon and v targets, min-SNR, offset noise, input perturbation, masked training,
# inpainting's 9 channels, cached latents and text, SDXL's pooled text and time ids, text-encoder training,
# LoRA and embeddings.
CASES = {
    "sd1_full_eps": ("sd1", "full", {}),
    "sd1_full_text_encoder": ("sd1", "full", {"text_encoder.train": True}),
    "sd1_options": ("sd1", "full", {"loss.min_snr_gamma": 5.0, "loss.offset_noise_weight": 0.1,
                                     "loss.input_perturbation": 0.1}),
    "sd1_masked": ("sd1", "full", {"masked_training.enabled": True, "masked_training.unmasked_weight": 0.1}),
    "sd1_cached": ("sd1", "lora", {"data.cache_latents": True, "data.cache_text": True}),
    "sd2_v_min_snr": ("sd2", "full", {"loss.min_snr_gamma": 5.0}),
    "sd2_embedding": ("sd2", "embedding", {"embedding.token": "<zz>", "embedding.vectors": 2,
                                           "embedding.init_text": "circle"}),
    "sdxl_lora_text": ("sdxl", "lora", {"text_encoder.train": True, "text_encoder_2.train": True}),
    "sdxl_full": ("sdxl", "full", {}),
    "sd1_inpainting": ("sd1-inpainting", "full", {}),
}


def run_cases(root: Path) -> dict[str, list[float]]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums split over threads would make "bit-identical" machine-dependent
    try:
        return _run_cases(root)
    finally:
        torch.set_num_threads(threads)


def _run_cases(root: Path) -> dict[str, list[float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from conftest import base_config
    from PIL import Image

    from ot_dist.config.load import validate
    from ot_dist.demo import make_demo_dataset
    from ot_dist.models.tiny import make_tiny_model
    from ot_dist.parallel.runtime import start_runtime
    from ot_dist.train.trainer import Trainer

    data = make_demo_dataset(root / "data", count=8)
    masked_data = make_demo_dataset(root / "masked", count=8)
    for i in range(8):  # the left half (plus a sample-dependent column) is what trains
        mask = Image.new("L", (64, 64), 0)
        mask.paste(255, (0, 0, 24 + i, 64))
        mask.save(masked_data / f"{i:04d}-masklabel.png")
    models = {}
    runtime = start_runtime(5, needs_group=False)
    losses = {}
    for name, (family, method, overrides) in CASES.items():
        if family not in models:
            base, inpainting = family.split("-")[0], family.endswith("-inpainting")
            models[family] = make_tiny_model(root / family, base, inpainting=inpainting)
        folder = masked_data if overrides.get("masked_training.enabled") else data
        raw = base_config(models[family], folder, root / "out" / name, family=family.split("-")[0], method=method,
                          epochs=2, **{"batch_size": 2, "optimizer.name": "SGD", "learning_rate": 0.05,
                                       "clip_grad_norm": None, **overrides})
        result = Trainer(validate(raw), runtime=runtime, log=lambda *_: None).train()
        losses[name] = result.losses
    return losses


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        values = run_cases(Path(tmp))
    if sys.argv[1:] == ["record"]:
        RECORD.write_text(json.dumps(values, indent=1) + "\n")
    print(json.dumps(values, indent=1))
