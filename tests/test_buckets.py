"""Buckets as OneTrainer makes and assigns them (mgds AspectBucketing, the module OneTrainer's data loaders use):
its sizes at the family's step, an image going to the bucket whose rounded size has the nearest height / width,
and data.bucket_assignment: log_ratio keeping ot_dist's earlier rule."""

from __future__ import annotations

import pytest

from ot_dist.config.load import validate
from ot_dist.data.buckets import ASPECTS, bucket_of, bucket_size

# mgds AspectBucketing.__create_automatic_buckets (Nerogar/mgds 0ad64a64e8a2e19afcbb81f7c96401a96cef216f): the
# (height, width) buckets of a target resolution and quantization, as it computes them.
MGDS_SIZES = {
    (512, 8): [(256, 1024), (272, 960), (296, 888), (320, 808), (360, 728), (384, 680), (416, 624), (456, 576),
               (512, 512), (576, 456), (624, 416), (680, 384), (728, 360), (808, 320), (888, 296), (960, 272),
               (1024, 256)],
    (1024, 64): [(512, 2048), (576, 1792), (576, 1920), (640, 1600), (704, 1472), (768, 1344), (832, 1280),
                 (896, 1152), (1024, 1024), (1152, 896), (1280, 832), (1344, 768), (1472, 704), (1600, 640),
                 (1792, 576), (1920, 576), (2048, 512)],
}

# (resolution, step, image width, image height) -> (mgds's bucket by bucket_for_aspect: argmin |rounded aspect -
# aspect|, the bucket ot_dist's log-ratio rule picks). Every case is one where the two rules differ.
ASSIGNED = [
    ((512, 8, 200, 651), (888, 296), (960, 272)),
    ((512, 8, 274, 446), (624, 416), (680, 384)),
    ((512, 8, 385, 528), (576, 456), (624, 416)),
    ((512, 8, 607, 1676), (808, 320), (888, 296)),
    ((512, 8, 829, 1553), (680, 384), (728, 360)),
    ((512, 8, 940, 1061), (512, 512), (576, 456)),
]


@pytest.mark.parametrize("resolution,step", list(MGDS_SIZES))
def test_sizes_are_mgds(resolution, step):
    ours = {bucket_size(i, resolution, step) for i in range(len(ASPECTS))}
    assert sorted(ours) == MGDS_SIZES[(resolution, step)]


@pytest.mark.parametrize("image,onetrainer,log_ratio", ASSIGNED)
def test_assignment_is_onetrainers_and_log_ratio_is_kept(image, onetrainer, log_ratio):
    resolution, step, width, height = image
    assert bucket_size(bucket_of(width, height, resolution, step), resolution, step) == onetrainer
    assert bucket_size(bucket_of(width, height, resolution, step, "log_ratio"), resolution, step) == log_ratio


def test_the_bucket_step_is_the_familys_unless_set():
    def config(family, **data):
        return validate({"model": {"family": family, "path": "m"}, "method": "lora", "output_dir": "o",
                         "resolution": 512, "data": {"path": "d", **data}}).data

    assert config("sd1").bucket_step == 8 and config("sd2").bucket_step == 8  # OneTrainer's SD data loader
    assert config("sdxl").bucket_step == 64 and config("flux").bucket_step == 64
    assert config("sd1", bucket_step=64).bucket_step == 64
    assert config("sd1").bucket_assignment == "rounded_aspect"
    assert config("sd1", bucket_assignment="log_ratio").bucket_assignment == "log_ratio"


def test_square_puts_every_image_in_the_square_bucket():
    """data.bucket_assignment: square, OneTrainer's aspect_ratio_bucketing false (mgds SingleAspectCalculation: the
    image scaled to cover a resolution x resolution square, then cropped): tall, wide and square images alike."""
    for width, height in ((200, 651), (940, 1061), (1676, 607), (512, 512)):
        assert bucket_size(bucket_of(width, height, 512, 8, "square"), 512, 8) == (512, 512)
    assert bucket_size(bucket_of(200, 651, 512, 8), 512, 8) != (512, 512)  # the image has a bucket of its own
