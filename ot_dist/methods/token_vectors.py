"""New token vectors in the text encoders: what textual inversion (method embedding) and the additional embeddings
trained beside a LoRA or a full finetune (pivotal tuning, OneTrainer's additional_embeddings) share.

An embedding is a token and its n vectors. The token stands for the words TOKEN TOKEN_1 ... TOKEN_{n-1}, the
multi-vector naming diffusers' load_textual_inversion registers; each is added to every tokenizer whose encoder takes
embeddings (the family's `embedding_keys`), and the encoder's frozen token embedding is wrapped so that the ids after
its vocabulary read trainable rows (rather than training the whole vocabulary matrix and masking its gradient: the
optimizer state, and later the sharded state, are the size of the vectors, not of the vocabulary). The file written is
the one diffusers' `load_textual_inversion`, A1111 and ComfyUI read: {TOKEN: [n, dim]} for SD 1.x/2.x and
{"clip_l": ..., "clip_g": ...} for SDXL (A1111's SDXL layout), with OneTrainer's "t5" (and ComfyUI's copy "t5xxl"),
"gemma", "llama" for the language-model encoders of SD3, Flux, Chroma, PixArt, Sana, Lumina 2 and HiDream; the token
is also in its metadata ("token"). Those encoders' rows follow the tokenizer's vocabulary (a T5's table is longer).
An output embedding (OneTrainer's is_output_embedding) adds its tokens the same way with zero rows and trains vectors
that replace the encoder's output at them instead: output_vectors.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import AddedToken

from ot_dist.checkpoint.export import atomic_path
from ot_dist.errors import ConfigError
from ot_dist.methods.embedding_file import read_family_file
from ot_dist.methods.output_vectors import attach, read_output_vectors, start_output_vectors
from ot_dist.models.loading import LoadedModel


# The names of the encoders' token-embedding modules that ExtendedTokenEmbedding wraps: CLIP's `token_embedding`, a
# T5's `shared` (which its encoder also holds as `encoder.embed_tokens`: a state dict names the rows twice), Gemma's,
# Llama's and Qwen's `embed_tokens`.
EMBEDDING_MODULES = r"(?:token_embedding|shared|embed_tokens)"


class ExtendedTokenEmbedding(torch.nn.Module):
    """A frozen nn.Embedding plus rows for the ids that follow its tokenizer's vocabulary: `extra` (method embedding's
    vectors, the name its checkpoints hold) and then `additional.<i>`, one parameter per additional embedding, in the
    order their tokens were added. `vocabulary`: the tokenizer's size; a matrix with more rows than that (a T5's 32128
    for 32100 tokens, rounded up for the GPU) reads its first `vocabulary` rows, the new ids follow them (OneTrainer's
    AdditionalEmbeddingWrapper does the same); the rows beyond, which no token names, stay in `base` for exports."""

    token_rows = True  # the encoder reads its trained rows in eval mode (memory/placement.py store_by_role)

    def __init__(self, base: torch.nn.Embedding, extra: torch.Tensor | None = None, vocabulary: int | None = None):
        super().__init__()
        self.base = base
        self.vocabulary = base.num_embeddings if vocabulary is None else vocabulary
        if self.vocabulary > base.num_embeddings:
            raise ValueError(f"the tokenizer has {self.vocabulary} tokens, the text encoder {base.num_embeddings} "
                             "embedding rows")
        if extra is not None:
            self.extra = torch.nn.Parameter(extra.float())
        self.additional = torch.nn.ParameterList()  # empty: nothing in the state dict

    def rows(self) -> list[torch.Tensor]:
        main = self._parameters.get("extra")
        return ([main] if main is not None else []) + list(self.additional)

    @property
    def num_embeddings(self) -> int:
        return self.vocabulary + sum(r.shape[0] for r in self.rows())

    @property
    def embedding_dim(self) -> int:
        return self.base.embedding_dim

    @property
    def weight(self) -> torch.Tensor:
        base = self.base.weight[:self.vocabulary]
        return torch.cat([base, *[r.to(base.dtype) for r in self.rows()]])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.weight)
        # Gemma's table scales what it reads (transformers 5's Gemma2TextScaledWordEmbedding: x sqrt(width)); the new
        # rows are scaled with the vocabulary's, as OneTrainer's (whose transformers scaled the inputs after the table)
        scale = getattr(self.base, "embed_scale", None)
        return rows if scale is None else rows * scale.to(rows.dtype)


def token_strings(token: str, count: int) -> list[str]:
    """The words an embedding of `count` vectors stands for: tok, tok_1, tok_2, ... (diffusers' naming)."""
    return [token] + [f"{token}_{i}" for i in range(1, count)]


def auto_vector_count(model: LoadedModel, text: str, key: str) -> int:
    """`vectors: auto`, OneTrainer's token_count null: one vector per token of `text` (without special tokens, as its
    _create_new_embedding counts them), in the tokenizer of every encoder that takes embeddings. OneTrainer gives each
    encoder its own count; ot_dist's token expands to one list of words for all of them, so the tokenizers must
    agree (SD3's and Flux's CLIP and T5 split some words differently): otherwise the counts are named."""
    counts = {tokenizer_name: len(model.tokenizers[tokenizer_name](text, add_special_tokens=False).input_ids)
              for encoder_name, tokenizer_name in zip(model.family.text_encoders, model.family.tokenizers)
              if encoder_name in model.family.embedding_keys}
    if not counts or min(counts.values()) == 0:
        raise ConfigError(f"{key}.init_text: {text!r} has no tokens, so vectors: auto gives none")
    if len(set(counts.values())) > 1:
        raise ConfigError(f"{key}.vectors: auto: {key}.init_text {text!r} is "
                          + ", ".join(f"{n} tokens for {name}" for name, n in counts.items())
                          + "; set vectors to a number (each encoder's vectors start from its tokens, repeated)")
    return next(iter(counts.values()))


def init_token_ids(tokenizer, text: str, count: int, key: str = "embedding.init_text") -> list[int]:
    """The vocabulary rows that start the `count` vectors: the text's tokens, repeated up to the count (kohya's
    way) and cut at it. `ot-dist import onetrainer` appends a "*" per vector to OneTrainer's initial text, which
    gives OneTrainer's rows (the text's tokens, then the token of "*")."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if not ids:
        raise ConfigError(f"{key}: {text!r} has no tokens")
    return (ids * -(-count // len(ids)))[:count]


def expand_in_caption(caption: str, expansions: dict[str, str]) -> str:
    """Each token of `expansions` (token -> its words) replaced by its words wherever the caption has it, in any case
    (the tokenizer lower-cases the caption, so `<Sks>` reads as the token), in one pass with the longest token tried
    first, so that a token inside another (`sks` in `sksdog`) never rewrites part of it."""
    if not expansions:
        return caption
    by_lower = {token.lower(): words for token, words in expansions.items()}
    pattern = re.compile("|".join(re.escape(t) for t in sorted(expansions, key=len, reverse=True)), re.IGNORECASE)
    return pattern.sub(lambda m: by_lower[m.group(0).lower()], caption)


def start_vectors(model: LoadedModel, init_from: str | None, output: bool = False,
                  key: str = "embedding.init_from") -> dict[str, torch.Tensor] | None:
    """An embedding file's vectors per encoder (embedding.init_from, an additional embedding's init_from), checked
    against each encoder's embedding width; None without a file (the vectors start from init_text). `output`: an
    output embedding's vectors, by OneTrainer's rule (output_vectors.py `read_output_vectors`)."""
    if not init_from:
        return None
    widths = {name: model.text_encoders[name].get_input_embeddings().embedding_dim
              for name in model.family.embedding_keys}
    if output:
        return read_output_vectors(init_from, model.family, widths, key)
    return read_family_file(init_from, model.family, widths)


def add_vectors(model: LoadedModel, tokens: list[str], start: dict[str, torch.Tensor] | None, init_text: str,
                key: str, main: bool = False, output: bool = False) -> dict[str, torch.nn.Parameter]:
    """Add `tokens` to every tokenizer whose encoder takes embeddings and their rows to the encoder, as a new
    parameter after those already there. The rows start from `start` (encoder name -> [n, dim]) or, for an encoder it
    lacks (the family's embedding_keys_optional), from the init_text's vocabulary rows. Returns encoder name -> the
    new parameter. `key` names the config entry in errors; `main`: method embedding's own vectors (`extra`, added
    before any additional embedding). `output`: an output embedding (output_vectors.py): the encoders of the family's
    output_embedding_keys get zero input rows, frozen, and the returned parameters are the output vectors, from
    `start` or OneTrainer's start from init_text; the family's other embedding encoders (Flux's CLIP-L) get trainable
    input rows as for any embedding, as OneTrainer's FluxModelEmbedding gives them."""
    added = {}
    for encoder_name, tokenizer_name in zip(model.family.text_encoders, model.family.tokenizers):
        if encoder_name not in model.family.embedding_keys:
            continue  # an encoder that takes no embedding reads the new words as ordinary text
        tokenizer, encoder = model.tokenizers[tokenizer_name], model.text_encoders[encoder_name]
        as_output = output and encoder_name in model.family.output_embedding_keys
        given = (start or {}).get(encoder_name)
        if tokenizer.convert_tokens_to_ids(tokens[0]) not in (tokenizer.unk_token_id, None):
            raise ConfigError(f"{key}.token: {tokens[0]!r} is already in the {tokenizer_name} vocabulary")
        if as_output and given is None:  # before the tokens exist: the init text reads as ordinary words
            out_start = start_output_vectors(model, tokenizer_name, encoder_name, init_text, len(tokens))
        embedding = encoder.get_input_embeddings()
        if not isinstance(embedding, ExtendedTokenEmbedding):
            embedding = ExtendedTokenEmbedding(embedding, vocabulary=len(tokenizer))
            encoder.set_input_embeddings(embedding)
        size = embedding.num_embeddings
        init_ids = (init_token_ids(tokenizer, init_text, len(tokens), f"{key}.init_text")
                    if given is None and not as_output else None)
        tokenizer.add_tokens([added_token(tokenizer, token) for token in tokens])
        if tokenizer.convert_tokens_to_ids(tokens) != list(range(size, size + len(tokens))):
            raise ConfigError(f"{key}.token: {tokenizer_name} ({len(tokenizer)} tokens) and {encoder_name} "
                              f"({size} embeddings) disagree on the vocabulary size")
        if as_output:
            # OneTrainer's BaseModelEmbedding: the input vector of an output embedding is zeros, never trained
            rows = new_rows(embedding, torch.zeros(len(tokens), embedding.embedding_dim), main)
            rows.requires_grad_(False)
            name = "extra" if main else f"additional.{len(embedding.additional) - 1}"
            vectors = given if given is not None else out_start
            added[encoder_name] = attach(encoder, embedding).add(name, size, vectors)
            continue
        rows = given if given is not None else embedding.base.weight.detach()[torch.tensor(init_ids)]
        added[encoder_name] = new_rows(embedding, rows.clone(), main)
    return added


def added_token(tokenizer, token: str) -> str | AddedToken:
    """`token` as the tokenizer is to find it in a caption. Where a space before it would be a piece of its own
    (Gemma's tokenizer reads "a <tok>" as "a", "▁", "<tok>"; Llama 3's as "a", "Ġ", "<tok>"), the token takes that
    space (lstrip, matched in the raw text, where it is still a space). Elsewhere (CLIP, T5, which split words on
    spaces) the plain token, matched as before in the normalized text (CLIP's lower-cased: a prompt's <TOK> reads as
    <tok>), and whose `tokenize` piece is the token itself, which diffusers' maybe_convert_prompt looks up to expand a
    token of several vectors (an lstrip token's piece carries the space)."""
    def pieces(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    if pieces("a ") > pieces("a"):
        return AddedToken(token, lstrip=True, normalized=False)
    return token


def new_rows(embedding: ExtendedTokenEmbedding, rows: torch.Tensor, main: bool) -> torch.nn.Parameter:
    """`rows` as the next parameter of `embedding`: `extra` for method embedding's vectors (the first rows), else the
    next `additional.<i>`."""
    parameter = torch.nn.Parameter(rows.float())
    if main:
        assert not embedding.rows(), "method embedding's vectors come first"
        embedding.extra = parameter
        return embedding.extra
    embedding.additional.append(parameter)
    return embedding.additional[len(embedding.additional) - 1]


def rows_in_state(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The rows called `name` ("extra", "additional.0", ...) of the encoder's ExtendedTokenEmbedding in its full state
    dict (what a strategy's `state_dict_of` returns); a T5's state names them under `shared.` and
    `encoder.embed_tokens.`, the same rows."""
    pattern = re.compile(rf"(?:^|\.){EMBEDDING_MODULES}\.{re.escape(name)}$")
    rows, *_ = [v for k, v in state.items() if pattern.search(k)]
    return rows


TOKEN_ROWS = re.compile(rf"(?:^|\.){EMBEDDING_MODULES}\.(outputs\.)?(extra|additional\.\d+)$")


def token_rows(key: str) -> bool:
    """Whether an encoder's state-dict key names added token rows (input or output ones): all an embedding file needs
    of the encoder, so all its export asks a strategy to gather (`state_dict_of`'s keep), not the whole encoder."""
    return TOKEN_ROWS.search(key) is not None


def without_token_rows(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An encoder's state dict as the model had it before tokens were added: the wrapped embedding's base weight under
    its own name, the new rows left out (they are written as embedding files)."""
    plain = {}
    for key, value in state.items():
        if token_rows(key):
            continue
        plain[re.sub(rf"(^|\.)({EMBEDDING_MODULES})\.base\.", r"\1\2.", key)] = value
    return plain


def with_key_copies(vectors: dict[str, torch.Tensor], copies: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """`vectors` (file key -> [n, dim]) with each key's copies (the family's embedding_key_copies: `t5xxl` beside `t5`)
    after it, as separate tensors (safetensors stores no shared memory)."""
    out = {}
    for key, value in vectors.items():
        out[key] = value
        out.update({copy: value.clone() for copy in copies.get(key, ())})
    return out


def write_embedding_file(target: Path, vectors: dict[str, torch.Tensor], token: str, dtype: torch.dtype,
                         metadata: dict[str, str], copies: dict[str, tuple[str, ...]] | None = None) -> None:
    """One embedding file: `vectors` (file key -> [n, dim]) and their `copies` in `dtype`, the token in the metadata,
    written atomically."""
    tensors = {key: v.detach().to("cpu", dtype).contiguous()
               for key, v in with_key_copies(vectors, copies or {}).items()}
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        save_file(tensors, tmp, metadata={"token": token, **metadata})
