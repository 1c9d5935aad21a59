"""What every section of the OneTrainer import shares: the part sections OneTrainer stores (the result, reading its
JSON files and paths saved on Windows: ot_dist/migrate/common.py, shared with the kohya import). Kept apart so the
section modules need not import the entry module that imports them."""

from __future__ import annotations

# Every part section OneTrainer has stored (TrainConfig's TrainModelPartConfig fields).
PART_SECTIONS = ("unet", "prior", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4",
                 "vae", "effnet_encoder", "decoder", "decoder_text_encoder", "decoder_vqgan")

