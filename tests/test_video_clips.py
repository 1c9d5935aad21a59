"""Video clips as samples of a video family (Wan): decoding with PyAV and the frame selection (data.video_*), clips
through the shards and the reader into (3, F, H, W) pixels, and Wan's training step on multi-frame latents."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import base_config

from ot_dist.config.load import validate
from ot_dist.data.reader import collate
from ot_dist.errors import ConfigError, InputFileError
from ot_dist.randomness import generator
from ot_dist.train.loss import diffusion_loss, encode_latents
from ot_dist.train.trainer import Trainer

av = pytest.importorskip("av")

SHIFT = 3.0  # the tiny Wan's flow_shift (test_family_wan.py)
COLOURS = [(i * 15, 255 - i * 15, (i * 37) % 256) for i in range(16)]  # one known colour per frame


def make_clip(path, colours, fps=16, size=(32, 32)):
    """A clip of solid frames, one per colour (mpeg4: in every PyAV wheel), decoded back within a few levels."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for colour in colours:
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), colour, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def frame_colours(frames) -> np.ndarray:
    return np.array([np.asarray(frame, dtype=int).reshape(-1, 3).mean(0) for frame in frames])


def test_head_frames_are_the_clips_first_frames(tmp_path):
    from ot_dist.data.video import clip_frames

    clip = make_clip(tmp_path / "a.mp4", COLOURS).read_bytes()
    frames = clip_frames(clip, 9)
    assert len(frames) == 9 and frames[0].size == (32, 32) and frames[0].mode == "RGB"
    assert np.abs(frame_colours(frames) - np.array(COLOURS[:9])).max() <= 4


def test_frames_are_skipped_to_the_sampling_rate(tmp_path):
    """A 32 fps clip at video_fps 16 gives every other frame; with video_source_fps 48 (the clip taken as 48 fps, as
    musubi-tuner's source_fps) every third."""
    from ot_dist.data.video import clip_frames, source_indices

    clip = make_clip(tmp_path / "a.mp4", COLOURS, fps=32)
    assert np.abs(frame_colours(clip_frames(clip, 5, fps=16)) - np.array(COLOURS[0:10:2])).max() <= 4
    assert np.abs(frame_colours(clip_frames(clip, 5, fps=16, source_fps=48)) - np.array(COLOURS[0:15:3])).max() <= 4
    assert source_indices(4, 30.0, 16.0) == [0, 1, 3, 5]  # 30 -> 16: the frame shown at k / 16 s
    assert source_indices(3, None, None) == [0, 1, 2]


def test_a_clip_too_short_is_named(tmp_path):
    from ot_dist.data.video import UnreadableClip, clip_frames

    clip = make_clip(tmp_path / "short.mp4", COLOURS[:8])
    with pytest.raises(UnreadableClip, match=r"short\.mp4 is too short: 9 frames need its first 9 frames, it has 8"):
        clip_frames(clip, 9, where=str(clip))
    with pytest.raises(UnreadableClip, match=r"5 frames at 8 fps from 16 need its first 9 frames, it has 8"):
        clip_frames(clip, 5, fps=8)


def clip_folder(root, count=4, frames=9, size=(64, 64), short=()):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        colours = [((i * 60 + f * 20) % 256, (f * 25) % 256, 255 - i * 50) for f in range(frames)]
        make_clip(root / f"clip{i}.mp4", colours, size=size)
        (root / f"clip{i}.txt").write_text(f"clip number {i}")
    for name in short:
        make_clip(root / name, COLOURS[:frames - 1], size=size)
        (root / name).with_suffix(".txt").write_text("a short clip")
    return root


def trainer_for(model, data, out, **overrides):
    settings = {"batch_size": 2, "learning_rate": 3e-4, "data.video_frames": 9, **overrides}
    return Trainer(validate(base_config(model, data, out, family="wan", **settings)), log=lambda *_: None)


def test_the_frame_count_must_suit_the_vae_and_the_family(family_models, tmp_path):
    """Config errors naming the field, before anything is built: a count that is not 4n + 1 for Wan, clips for a
    family that is not a video model, masked training of clips."""
    def config(family="wan", **overrides):
        return validate(base_config(family_models[family], tmp_path, tmp_path / "o", family=family,
                                    **{"data.video_frames": 9, **overrides}))

    config()
    with pytest.raises(ConfigError, match=r"data\.video_frames: 6 frames; wan's VAE compresses time 4x and needs "
                                          r"4n \+ 1 frames \(e\.g\. 5 or 9\)"):
        config(**{"data.video_frames": 6})
    with pytest.raises(ConfigError, match="data.video_frames: model.family sd1 is not a video model"):
        config("sd1")
    hunyuan = base_config(tmp_path, tmp_path, tmp_path / "o", family="hunyuan_video", **{"data.video_frames": 9})
    with pytest.raises(ConfigError, match="model.family hunyuan_video trains on images as one-frame videos only"):
        validate(hunyuan)  # a video model whose clips are not wired yet
    with pytest.raises(ConfigError, match="masked_training: video clips"):
        config(**{"masked_training.enabled": True})


def test_a_short_clip_is_named_and_skipped_at_build(family_models, tmp_path):
    from ot_dist.data.concepts import scan_folders

    data = clip_folder(tmp_path / "clips", count=2, short=("short.mp4",))
    config = validate(base_config(family_models["wan"], data, tmp_path / "o", family="wan", **{"data.video_frames": 9,
                                                                                               "data.max_bad_fraction": 0.5}))
    scan = scan_folders(config.data)
    assert [s.image.name for s in scan.samples] == ["clip0.mp4", "clip1.mp4"] and scan.samples[0].size == (64, 64)
    assert [(p.name, "too short" in e) for p, e in scan.bad] == [("short.mp4", True)]


def test_clips_load_as_frames_with_one_geometry_and_train_wan(family_models, tmp_path):
    """Clips through the shards (their own bytes) into (3, 9, 64, 64) pixels whose frames are the clip's, (B, 16, 3, 8,
    8) latents (4n + 1 frames -> n + 1), and a few steps on one batch lower the loss."""
    data = clip_folder(tmp_path / "clips")
    trainer = trainer_for(family_models["wan"], data, tmp_path / "o")
    dataset, model = trainer.dataset, trainer.model
    sample = dataset.samples[0]
    assert [m for m in sample["members"] if m.startswith("clip")] == ["clip.mp4"]
    loaded = dataset.load(0, 0)
    assert loaded["pixels"].shape == (3, 9, 64, 64)
    number = int(dataset.metadata(0)["source"].split("clip")[-1][0])
    expected = np.array([((number * 60 + f * 20) % 256, (f * 25) % 256, 255 - number * 50) for f in range(9)])
    colours = ((loaded["pixels"] + 1) * 127.5).mean(dim=(2, 3)).T.numpy()
    assert np.abs(colours - expected).max() <= 5
    batch = trainer.tokenize(collate([dataset.load(i, 0) for i in range(2)]))
    eps = torch.randn(2, 16, 3, 8, 8)
    assert encode_latents(model.family, model.vae, batch, eps).shape == (2, 16, 3, 8, 8)
    params = [p for p in model.denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    losses = []
    for _ in range(6):
        loss = diffusion_loss(model, batch, 1, 0, trainer.config.loss)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.9 * losses[0] and losses == sorted(losses, reverse=True), losses


def test_a_flip_flips_every_frame_of_a_clip(family_models, tmp_path):
    """One crop and one augmentation draw per clip: with flip_probability 1 every frame is mirrored."""
    root = tmp_path / "clips"
    root.mkdir()
    frames = []
    for f in range(9):
        frame = np.zeros((64, 64, 3), np.uint8)
        frame[:, :32] = (250, 20 * f, 0)  # left half red-ish, right half blue
        frame[:, 32:] = (0, 20 * f, 250)
        frames.append(frame)
    with av.open(str(root / "halves.mp4"), "w") as out:
        stream = out.add_stream("mpeg4", rate=16)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    (root / "halves.txt").write_text("halves")
    raw = base_config(family_models["wan"], root, tmp_path / "o", family="wan", batch_size=1,
                      **{"data.video_frames": 9})
    raw["data"] = {"concepts": [{"path": str(root), "flip_probability": 1.0}], "shards": raw["data"]["shards"],
                   "video_frames": 9}
    pixels = Trainer(validate(raw), log=lambda *_: None).dataset.load(0, 0)["pixels"]
    assert (pixels[0, :, :, :24] < 0).all() and (pixels[0, :, :, 40:] > 0).all()  # red now on the right, every frame


def test_the_step_on_clips_equals_the_diffusers_conventions(family_models, tmp_path):
    """diffusion_loss on a batch of clips against the step written out with the same draws: the VAE's posterior of the
    (B, 3, 9, H, W) clips (B, 16, 3, h, w), (x - latents_mean) / latents_std, sigma the logit-normal u shifted by
    flow_shift, x_t = (1 - s) x + s n, the transformer called as WanPipeline calls it (5-D latents of 3 frames, the
    timestep 1000 s in float32, the prompt embeddings, no mask), MSE against n - x."""
    trainer = trainer_for(family_models["wan"], clip_folder(tmp_path / "clips"), tmp_path / "o")
    model, options = trainer.model, trainer.config.loss
    batch = trainer.tokenize(collate([trainer.dataset.load(i, 0) for i in range(2)]))
    pixels, vae = batch["pixels"], model.vae
    assert pixels.shape == (2, 3, 9, 64, 64)
    shape = (16, 3, 8, 8)
    eps, noise, sigmas = [], [], []
    for sample_id in batch["sample_id"].tolist():
        g = generator(1, 0, sample_id, "diffusion")
        eps.append(torch.randn(shape, generator=g))
        noise.append(torch.randn(shape, generator=g))
        u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64)).item()
        sigmas.append(SHIFT * u / (1 + (SHIFT - 1) * u))
    eps, noise = torch.stack(eps), torch.stack(noise)
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        x = (posterior.mean + posterior.std * eps - mean) / std
        assert x.shape == (2, 16, 3, 8, 8)
        sigma = torch.tensor(sigmas, dtype=torch.float32).view(-1, 1, 1, 1, 1)
        hidden, _ = model.pipeline.encode_prompt(list(batch["caption"]), do_classifier_free_guidance=False,
                                                 device="cpu", max_sequence_length=32)
        out = model.denoiser(hidden_states=(1 - sigma) * x + sigma * noise, timestep=sigma.flatten() * 1000,
                             encoder_hidden_states=hidden, return_dict=False)[0]
        expected = torch.nn.functional.mse_loss(out, noise - x)
        ours = diffusion_loss(model, batch, 1, 0, options)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_an_image_family_still_leaves_clips_out(family_models, shapes_data, tmp_path):
    """Without data.video_frames clips stay unused files (an image family lists them; Wan refuses them:
    test_family_wan.py)."""
    from ot_dist.data.concepts import VIDEO_REASON, classify_files
    from ot_dist.config.schema import ConceptConfig

    data = clip_folder(tmp_path / "mixed", count=1)
    (data / "still.png").write_bytes((shapes_data / sorted(p.name for p in shapes_data.glob("*.png"))[0]).read_bytes())
    images, unused = classify_files("data.path", ConceptConfig(path=str(data)))
    assert [p.name for p in images] == ["still.png"] and (data / "clip0.mp4").relative_to(data) in dict(unused)
    assert dict(unused)[(data / "clip0.mp4").relative_to(data)] == VIDEO_REASON
    with pytest.raises(InputFileError, match="mixes video clips and images"):
        collate([{"pixels": torch.zeros(3, 9, 8, 8)}, {"pixels": torch.zeros(3, 8, 8)}])


def test_a_lora_run_trains_on_clips_end_to_end(family_models, tmp_path):
    """Trainer.train through the loader (a forked worker decoding the clips), the plan and the LoRA export, on clips
    alone."""
    trainer = trainer_for(family_models["wan"], clip_folder(tmp_path / "clips"), tmp_path / "o", method="lora",
                          max_steps=2, **{"lora.rank": 4, "lora.alpha": 4, "data.loader_workers": 1})
    trainer.train()
    assert trainer.dataset.manifest["clip_samples"] == 4
    assert (tmp_path / "o" / "lora.safetensors").is_file()


def test_clips_and_images_in_one_set_need_batch_size_1(family_models, shapes_data, tmp_path):
    """A set of clips and images is refused before the model loads with batch_size 2 (their pixels cannot stack)."""
    data = clip_folder(tmp_path / "mixed", count=3)
    image = sorted(shapes_data.glob("*.png"))[0]
    (data / "still.png").write_bytes(image.read_bytes())
    (data / "still.txt").write_text("a still")
    with pytest.raises(InputFileError, match="3 video clips and 1 images, which cannot share a micro batch"):
        trainer_for(family_models["wan"], data, tmp_path / "o")


def test_cached_clip_latents_train_as_encoding_on_the_fly(family_models, tmp_path):
    """data.cache_latents with clips: the cache holds each clip window's posterior (16, 2, 8, 8) (5 frames -> 2; two
    windows a clip: slide by 5 over 10 frames), the loader reads it instead of the frames, and the loss of a batch
    from the cache is the loss of the same batch encoded from its frames (the same VAE draw per sample)."""
    from ot_dist.data.caches import latent_key, vae_key

    trainer = trainer_for(family_models["wan"], clip_folder(tmp_path / "clips", count=2, frames=10), tmp_path / "o",
                          **{"data.cache_latents": True, "data.video_frames": 5, "data.video_frame_extraction": "slide",
                             "data.video_frame_stride": 5})
    dataset, model = trainer.dataset, trainer.model
    assert "latents" in dataset.caches and len(dataset) == 4
    ids = [0, 3]  # the first window of one clip, the second of the other
    cached = [dataset.load(i, 0) for i in ids]
    assert "pixels" not in cached[0] and cached[0]["latent_mean"].shape == (16, 2, 8, 8)
    from_frames = [dataset.load(i, 0, use_cache=False) for i in ids]
    assert from_frames[0]["pixels"].shape == (3, 5, 64, 64)
    with torch.no_grad():
        losses = [diffusion_loss(model, trainer.tokenize(collate(batch)), 1, 0, trainer.config.loss)
                  for batch in (cached, from_frames)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    # the frame choice is part of the key: another count, rate or extraction is another cache folder
    selection = dataset.clip_selection
    keys = {latent_key(model.vae, s) for s in (selection, {**selection, "frames": 9}, {**selection, "stride": 2})}
    assert len(keys) == 3 and latent_key(model.vae, None) == vae_key(model.vae)
    assert dataset.caches["latents"].dir.name == f"latents-{latent_key(model.vae, selection)[:16]}"


def test_a_clip_source_rate_alone_is_refused(family_models, tmp_path):
    raw = base_config(family_models["wan"], tmp_path, tmp_path / "o", family="wan", **{"data.video_frames": 9})
    with pytest.raises(Exception, match="data.video_source_fps: only with data.video_fps"):
        validate({**raw, "data": {**raw["data"], "video_source_fps": 30.0}})


def test_extraction_windows_follow_musubi_tuners_rules():
    """The windows (start, frames) of each data.video_frame_extraction on a 40-frame timeline, as musubi-tuner's
    docs/dataset_config.md draws them (target_frames 1, 13, 25 one at a time; frame_stride 10; frame_sample 4), and
    `full` as its code cuts clips of 20, 25 and 35 frames (to 4n + 1 and to max_frames, here 29: its diagram's 31 is
    no 4n + 1, and its code gives 29 for it too)."""
    from ot_dist.data.video import clip_windows

    def starts(extraction, frames, length=40, **spacing):
        windows = clip_windows(length, frames, extraction, **spacing)
        assert all(count == frames and start + count <= length for start, count in windows)
        return [start for start, _ in windows]

    assert [starts("head", f) for f in (1, 13, 25)] == [[0], [0], [0]]
    assert [starts("chunk", f) for f in (13, 25)] == [[0, 13, 26], [0]]
    assert [starts("slide", f, stride=10) for f in (1, 13, 25)] == [[0, 10, 20, 30], [0, 10, 20], [0, 10]]
    assert [starts("uniform", f, sample=4) for f in (1, 13, 25)] == [[0, 13, 26, 39], [0, 9, 18, 27], [0, 5, 10, 15]]
    assert starts("uniform", 13, length=14, sample=4) == [0, 1]  # linspace 0, 0, 0, 1: a start given twice is one
    assert [clip_windows(length, 29, "full") for length in (20, 25, 35)] == [[(0, 17)], [(0, 25)], [(0, 29)]]
    assert [clip_windows(12, 13, extraction, 1, 4) for extraction in ("head", "chunk", "slide", "uniform")] == [[]] * 4


def test_windows_take_their_frames_on_the_timeline_at_video_fps():
    """A window's start and count are timeline frames (at video_fps): at 16 fps from 32 the window starting at 5 takes
    source frames 10, 12, ...; a 16-frame clip at 30 fps has 9 frames at 16 fps (the last at 15)."""
    from ot_dist.data.video import source_indices, timeline_length

    assert source_indices(5, 32.0, 16.0, start=5) == [10, 12, 14, 16, 18]
    assert source_indices(3, None, None, start=4) == [4, 5, 6]
    assert timeline_length(16, 32.0, 16.0) == 8 and timeline_length(16, 30.0, 16.0) == 9
    assert timeline_length(16, None, None) == 16


def test_each_window_of_a_clip_is_a_sample_of_its_frames(family_models, tmp_path):
    """chunk on a 16-frame clip with 5-frame windows: three samples (frames 0-4, 5-9, 10-14) whose pixels are those
    frames; slide / uniform / full find the windows their rules give for the same clip at the build's scan."""
    from ot_dist.data.concepts import scan_folders
    from ot_dist.data.reader import ShardDataset
    from ot_dist.data.shards import build_shard_set

    root = tmp_path / "clips"
    root.mkdir()
    make_clip(root / "a.mp4", COLOURS, size=(64, 64))
    (root / "a.txt").write_text("a clip")

    def config(**video):
        return validate(base_config(family_models["wan"], root, tmp_path / "o", family="wan", batch_size=1,
                                    **{"data.video_frames": 5, **video}))

    chunks = config(**{"data.video_frame_extraction": "chunk"})
    build_shard_set(chunks, tmp_path / "set", log=lambda *_: None)
    dataset = ShardDataset(tmp_path / "set", chunks)
    assert len(dataset) == 3 and dataset.manifest["clip_samples"] == 3
    for i, start in enumerate((0, 5, 10)):
        colours = ((dataset.load(i, 0)["pixels"] + 1) * 127.5).mean(dim=(2, 3)).T.numpy()
        assert np.abs(colours - np.array(COLOURS[start:start + 5])).max() <= 5, (start, colours)
    assert dataset.samples[1]["key"] == "c0_00000000_00005-005"  # musubi's item key: start-frames

    def windows(**video):
        return [s.window for s in scan_folders(config(**video).data, log=lambda *_: None).samples]

    assert windows(**{"data.video_frame_extraction": "slide", "data.video_frame_stride": 3}) == [(0, 5), (3, 5),
                                                                                                 (6, 5), (9, 5)]
    assert windows(**{"data.video_frame_extraction": "uniform", "data.video_frame_sample": 3}) == [(0, 5), (5, 5),
                                                                                                   (11, 5)]
    assert windows(**{"data.video_frame_extraction": "full", "data.video_frames": 13}) == [(0, 13)]
    assert windows(**{"data.video_frame_extraction": "chunk", "data.video_fps": 8.0}) == [(0, 5)]  # 8 frames at 8 fps


def test_bad_clips_and_window_settings_are_named(family_models, tmp_path):
    """An undecodable clip and one too short for any window are named at the build's scan; the window spacing of
    another extraction, clips of several lengths (full) in a micro batch and a set built with other video settings
    are refused naming the field."""
    from ot_dist.data.concepts import check_clip_batches, scan_folders
    from ot_dist.data.reader import check_clip_set

    root = clip_folder(tmp_path / "clips", count=1, frames=9, short=("short.mp4",))
    (root / "broken.mp4").write_bytes(b"\0" * 64)
    raw = base_config(family_models["wan"], root, tmp_path / "o", family="wan",
                      **{"data.video_frames": 9, "data.video_frame_extraction": "chunk", "data.max_bad_fraction": 1.0})
    scan = scan_folders(validate(raw).data, log=lambda *_: None)
    bad = dict((p.name, error) for p, error in scan.bad)
    assert [s.image.name for s in scan.samples] == ["clip0.mp4"]
    assert "broken.mp4 could not be opened" in bad["broken.mp4"]
    assert "short.mp4 is too short: its 8 frames give 8, a window of chunk needs 9" in bad["short.mp4"]
    with pytest.raises(Exception, match="data.video_frame_stride: only with video_frame_extraction slide"):
        validate({**raw, "data": {**raw["data"], "video_frame_stride": 2}})
    with pytest.raises(Exception, match="data.video_frame_sample: only with video_frame_extraction uniform"):
        validate({**raw, "data": {**raw["data"], "video_frame_sample": 2}})
    with pytest.raises(InputFileError, match=r"2 frame counts \(9, 13: .*full keeps each clip's length\)"):
        check_clip_batches({"clip_samples": 4, "sample_count": 4, "clip_frame_counts": [9, 13]}, 2)
    check_clip_batches({"clip_samples": 4, "sample_count": 4, "clip_frame_counts": [9, 13]}, 1)
    built = {"clip_samples": 1, "built_from": {"video_frames": 9, "video_fps": None, "video_source_fps": None,
                                               "video_frame_extraction": "head"}}
    check_clip_set(built, validate({**raw, "data": {**raw["data"], "video_frame_extraction": "head"}}).data, "set")
    with pytest.raises(InputFileError, match=r"data.video_frame_extraction: the shard set set was built with "
                                             r"video_frame_extraction head, this run asks for .*chunk"):
        check_clip_set(built, validate(raw).data, "set")


def test_a_build_in_parts_keeps_the_windows_of_clips(family_models, tmp_path):
    """`shard build --part`: two parts merged hold the samples (each clip's windows, in order), the clip count and the
    frame counts of a one-part build."""
    from ot_dist.data.shard_parts import build_part, merge_parts
    from ot_dist.data.shards import build_shard_set, read_manifest

    root = clip_folder(tmp_path / "clips", count=2, frames=10)
    config = validate(base_config(family_models["wan"], root, tmp_path / "o", family="wan", batch_size=1,
                                  **{"data.video_frames": 5, "data.video_frame_extraction": "chunk"}))
    whole = build_shard_set(config, tmp_path / "whole", log=lambda *_: None)
    for part in range(2):
        build_part(config, tmp_path / "parts", (part, 2), log=lambda *_: None)
    merge_parts(config, tmp_path / "parts", log=lambda *_: None)
    merged = read_manifest(tmp_path / "parts")
    assert [s["key"] for s in merged["samples"]] == [s["key"] for s in whole["samples"]] == [
        "c0_00000000_00000-005", "c0_00000000_00005-005", "c0_00000001_00000-005", "c0_00000001_00005-005"]
    assert merged["clip_samples"] == whole["clip_samples"] == 4 and merged["clip_frame_counts"] == [5]


def test_a_latent_cache_of_clips_and_images_encodes_each_kind_apart(family_models, tmp_path):
    """With batch_size 1 a set may hold clips and images: the cache encodes them in VAE batches of one frame count
    (a clip's (3, 9, H, W) pixels and an image's (3, H, W) do not stack), and holds (16, 3, 8, 8) and (16, 8, 8)."""
    from PIL import Image

    data = clip_folder(tmp_path / "mixed", count=2)
    Image.new("RGB", (64, 64), (200, 30, 90)).save(data / "still.png")
    (data / "still.txt").write_text("a still")
    trainer = trainer_for(family_models["wan"], data, tmp_path / "o", batch_size=1, **{"data.cache_latents": True})
    dataset = trainer.dataset
    shapes = sorted(tuple(dataset.load(i, 0)["latent_mean"].shape) for i in range(len(dataset)))
    assert shapes == [(16, 3, 8, 8), (16, 3, 8, 8), (16, 8, 8)]
