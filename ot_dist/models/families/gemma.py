"""Gemma 2 as a text encoder: what the families conditioned on it (Sana, Lumina 2) share.

- the LoRA targets of its decoder layers (attention q / k / v / o and the gated MLP), its embedding-file key;
- its sharding units: the embedding table is a unit of its own beside the decoder layers. 256 k x 2304 is 23 % of
  Gemma-2-2B (1.1 GiB in bf16), one tensor that no unit choice splits, and the root's unit stays gathered from
  forward to the end of backward (FSDP2 never reshards the root after forward). The other text encoders leave
  theirs in the root: T5-XXL's `shared` is 2.8 % of it, CLIP-L's / bigG's tables 72 / 121 MiB in bf16;
- the tiny model of the tests and the demo: a real `Gemma2Model` and an offline GemmaTokenizer.
"""

from __future__ import annotations

GEMMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Gemma's key in an embedding file: OneTrainer's (modules/modelSaver/sana/SanaEmbeddingSaver.py). ComfyUI's Gemma
# tokenizers name theirs gemma2_2b but load no embeddings (comfy/text_encoders/lumina2.py passes no
# embedding_directory), so no copy is written.
GEMMA_EMBEDDING_KEY = "gemma"
GEMMA_SHARD_UNITS = ("embed_tokens", "layers")
TINY_GEMMA_WIDTH = 32


def tiny_gemma(vocab_size: int):
    """A randomly initialised two-layer Gemma2Model, TINY_GEMMA_WIDTH wide (eager attention: Gemma 2's soft-capping)."""
    from transformers import Gemma2Config, Gemma2Model

    return Gemma2Model(Gemma2Config(
        vocab_size=vocab_size, hidden_size=TINY_GEMMA_WIDTH, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        max_position_embeddings=512, attn_implementation="eager"))


def tiny_gemma_tokenizer(max_length: int = 32):
    """A GemmaTokenizer built offline: a byte-level-free BPE over the demo words (each word with and without the
    "▁" that marks a space, merged letter by letter) and single letters, in Gemma's layout (<pad> 0, <eos> 1,
    <bos> 2, <unk> 3) with <bos> put in front as Gemma's tokenizer.json does. `max_length` becomes
    model_max_length."""
    from tokenizers import processors
    from transformers import GemmaTokenizer

    from ot_dist.models.tiny import DEMO_WORDS

    vocab = {token: i for i, token in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))}
    merges: list[tuple[str, str]] = []
    for char in "▁abcdefghijklmnopqrstuvwxyz0123456789":
        vocab.setdefault(char, len(vocab))
    for piece in [prefix + word for prefix in ("▁", "") for word in DEMO_WORDS]:
        merged = piece[0]
        for char in piece[1:]:
            if (merged, char) not in merges:
                merges.append((merged, char))
            merged += char
            vocab.setdefault(merged, len(vocab))
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])])
    tokenizer.model_max_length = max_length
    return tokenizer
