"""Tiny, randomly initialised models of the real architectures: the shared parts (offline tokenizers, small
CLIP / VAE / scheduler configs) and the entry points; each family module builds its own (`Family.build_tiny`).

Nothing can be downloaded from a model hub here, so tests and the demo build these and save them as
ordinary diffusers folders; training then loads them through exactly the code path a user's
checkpoint takes. The block layout (down/up block types, cross-attention, SDXL's text-time
conditioning, two text encoders, OpenCLIP-style GELU for SD 2.x) is the real one; only the widths
and depths are small so that a training step runs in well under a second on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path


# Words the demo captions use; each gets whole-word BPE merges so captions tokenize to one token per
# word, like the real CLIP vocabulary does for common English words.
DEMO_WORDS = (
    "a photo of an image the on in with and background big small "
    "red green blue yellow white black purple orange "
    "circle square triangle cross stripe stripes dot dots ring "
    "left right top bottom center"
).split()

TEXT_HIDDEN = 32
MAX_TOKENS = 77


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level alphabet: every byte gets a printable unicode character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def write_tokenizer(folder: Path, words=DEMO_WORDS, pad_token: str = "<|endoftext|>") -> None:
    """Write vocab.json / merges.txt / tokenizer_config.json of a small but real CLIP BPE tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for symbol in alphabet + [c + "</w>" for c in alphabet]:
        vocab.setdefault(symbol, len(vocab))
    merges: list[str] = []
    for word in words:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            merged = parts[0] + parts[1]
            merge = f"{parts[0]} {parts[1]}"
            if merge not in merges:
                merges.append(merge)
            vocab.setdefault(merged, len(vocab))
            parts = [merged] + parts[2:]
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab.setdefault(special, len(vocab))
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "CLIPTokenizer",
                "model_max_length": MAX_TOKENS,
                "bos_token": "<|startoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "pad_token": pad_token,
                "do_lower_case": True,
            }
        )
    )


def clip_text_config(vocab_size: int, hidden_act: str, projection_dim: int = TEXT_HIDDEN):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=MAX_TOKENS,
        hidden_act=hidden_act,
        projection_dim=projection_dim,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )


def tiny_vae(scaling_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=scaling_factor,
    )


def tiny_ddim(prediction_type: str):
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type=prediction_type,
    )


def tiny_clip_tokenizer():
    """A CLIPTokenizer over the demo words, built offline."""
    import tempfile

    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp))
        return CLIPTokenizer.from_pretrained(tmp)


def build_tiny_pipeline(family: str, seed: int = 0, prediction_type: str | None = None, inpainting: bool = False,
                        **options):
    """A randomly initialised pipeline of the given family (any registered name); `inpainting`: the family's
    inpainting pipeline with its inpainting denoiser (a 9-channel UNet, Flux.1 Fill's 384-channel transformer).
    `options` go to the family's tiny build (e.g. a variant)."""
    from ot_dist.models.families.registry import get_family

    spec = get_family(family)
    if prediction_type is not None:
        options["prediction_type"] = prediction_type
    if not inpainting:
        return spec.build_tiny(seed=seed, **options)
    if spec.inpaint_pipeline_class is None:
        raise ValueError(f"family {family} has no inpainting models")
    from ot_dist.models.inpainting import as_inpainting_pipeline

    pipeline = spec.build_tiny(seed=seed, in_channels=spec.inpainting_in_channels, **options)
    return as_inpainting_pipeline(pipeline, spec.inpaint_pipeline_class)


def make_tiny_model(folder: str | Path, family: str = "sd1", seed: int = 0, prediction_type: str | None = None,
                    inpainting: bool = False, dtype=None, **options) -> Path:
    """Build a tiny model and save it as a normal diffusers folder (safetensors weights); `dtype`: the weights' dtype
    in the files (float32 unless given: published models are mostly bfloat16 or float16)."""
    folder = Path(folder)
    pipe = build_tiny_pipeline(family, seed=seed, prediction_type=prediction_type, inpainting=inpainting, **options)
    if dtype is not None:
        import torch

        stages = getattr(pipe, "decoder_stages", None)  # Stable Cascade's decoder stages (save_demo_extras)
        for module in [*pipe.components.values(), *(stages.components.values() if stages is not None else ())]:
            if isinstance(module, torch.nn.Module):
                module.to(dtype)
    pipe.save_pretrained(folder, safe_serialization=True)
    from ot_dist.models.families.registry import get_family

    get_family(family).save_extras(pipe, folder)
    get_family(family).save_demo_extras(pipe, folder)
    from ot_dist.file_modes import share_with_umask

    share_with_umask(folder)  # diffusers writes its safetensors 0600
    return folder


T5_EXTRA_IDS = 8


def tiny_t5_tokenizer(max_length: int = 32):
    """A T5TokenizerFast built offline: a `tokenizers` Unigram model over the demo words (each a piece, with
    "▁" marking a word start as sentencepiece does) and single letters, in T5's real layout (<pad> 0, </s> 1,
    <unk> 2, the extra ids at the end). `max_length` becomes model_max_length (real T5s: 256 / 512)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + word, -5.0) for word in DEMO_WORDS]
    pieces += [(c, -10.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    pieces += [("▁" + c, -11.0) for c in "abcdefghijklmnopqrstuvwxyz" if c not in DEMO_WORDS]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=T5_EXTRA_IDS)
    tokenizer.model_max_length = max_length
    return tokenizer


def tiny_t5_encoder(vocab_size: int, d_model: int = TEXT_HIDDEN):
    """A T5EncoderModel of the real T5 v1.1 layout (gated GELU), two blocks."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4, feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                                   relative_attention_max_distance=16, is_encoder_decoder=False, use_cache=False))
