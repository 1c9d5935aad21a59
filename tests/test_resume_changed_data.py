"""A run resumed after its images changed (data.resume_with_changed_data): the checkpoint's position is in an epoch
planned from the old images. Refused before training by default; with next_epoch the run goes on from the start of
the next epoch. The reader's side (the plans compared, the messages) is in test_data_shards.py."""

import shutil

import pytest

from conftest import base_config
from ot_dist.config.load import validate
from ot_dist.errors import InputFileError
from ot_dist.train.trainer import Trainer


def test_a_resume_after_images_were_removed_is_refused_or_goes_on_from_the_next_epoch(small_sd1, shapes_data,
                                                                                          tmp_path, capsys):
    data = tmp_path / "images"
    shutil.copytree(shapes_data, data)
    out = tmp_path / "run"

    def raw(**overrides):  # 16 images, global batch 4: 4 steps an epoch
        return base_config(small_sd1, data, out, epochs=2, **{"checkpoint.every_n_steps": 1, **overrides})

    Trainer(validate(raw(max_steps=1)), log=lambda *_: None).train()  # stopped after step 1, in epoch 0
    unchanged = Trainer(validate(raw(max_steps=2)), log=lambda *_: None, resume="auto")
    assert (unchanged.position.step, unchanged.position.epoch, unchanged.reader.resume_position(0)) == (1, 0, 1)
    del unchanged
    for image in sorted(p for p in data.iterdir() if p.suffix != ".txt")[:4]:  # 12 images left: 3 steps an epoch
        image.unlink()
    with pytest.raises(InputFileError, match=r"16 samples, 4 steps an epoch then, 12 samples, 3 steps an epoch now"):
        Trainer(validate(raw(max_steps=2)), log=lambda *_: None, resume="auto")
    moved_on = Trainer(validate(raw(max_steps=6, **{"data.resume_with_changed_data": "next_epoch"})),
                       log=lambda *_: None, resume="auto")
    assert (moved_on.position.step, moved_on.position.epoch, moved_on.reader.resume_position(1)) == (1, 1, 0)
    assert len(moved_on.train().losses) == 3  # the whole of epoch 1, with the 12 images
    assert "going on from the start of epoch 1" in capsys.readouterr().out  # each rank's reader says it
