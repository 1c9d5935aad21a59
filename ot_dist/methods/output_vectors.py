"""Output embeddings (OneTrainer's `is_output_embedding`): an embedding whose trained vectors live in a text encoder's
OUTPUT space. Its tokens are added as every embedding's are (token_vectors.py), but their input rows are zeros and
stay frozen; the encoder's hidden states at the positions of those tokens are replaced by the trained vectors
(OneTrainer's BaseModel._apply_output_embeddings: `output[b, s] = vectors[j]` wherever `ids[b, s]` is the j-th
token). OneTrainer does it on the one hidden state its encode_text reads; here a forward hook of the encoder does it on
every hidden state of the encoder's output (last_hidden_state and each of hidden_states), so that whichever layer the
family reads (SD's last one, SDXL's penultimate, a layer skip's) and whoever calls the encoder (the family's
encode_text while training, the diffusers pipeline while sampling) sees the vectors there. The pooled outputs are
computed inside the encoder from its own states and are left as they are, as in OneTrainer. The vectors are written in
the hidden states' dtype (OneTrainer casts the whole output to float32 first; the denoiser computes in its own dtype
either way). A layer that the family
reads through a further layer norm (SD's layer skip) would get the vectors normalised, so the family refuses that pair
(`Family.output_embedding_conflict`).

The vectors are the `outputs` child of the encoder's ExtendedTokenEmbedding (`token_embedding.outputs.extra` for method
embedding's, `token_embedding.outputs.additional.<i>` for additional embedding i), so the strategies shard, gather and
checkpoint them with the encoder's other new rows, and exports of the encoder leave them out as they leave those.

The file is OneTrainer's: per encoder of the family's `output_embedding_keys` (`emp_params` for SD 1.x / 2.x, `clip_l`
/ `clip_g` for SDXL, `clip_l` / `clip_g` / `t5` for SD3, `t5` for Flux, PixArt and Chroma) the zero input rows under
`<key>` and the vectors under `<key>_out`; OneTrainer's loaders read `<key>_out` and fall back to `<key>`
(modules/modelSetup/Base*Setup.py `_setup_embeddings`), as `init_from` does here. An encoder of the family's
`embedding_keys` that takes no output vectors (Flux's CLIP-L: OneTrainer's FluxModelEmbedding builds its
text_encoder_1_embedding with is_output_embedding=False) trains ordinary input rows in the same embedding, written
under its `embedding_keys` key (`clip_l`) as FluxEmbeddingSaver writes them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ot_dist.errors import ConfigError
from ot_dist.methods.embedding_file import read_embedding_file

OUT_SUFFIX = "_out"  # OneTrainer's savers: `<key>_out` holds an encoder's output vectors


class OutputVectors(torch.nn.Module):
    """The output vectors of one text encoder: `extra` (method embedding's) and `additional.<i>`, each [n, width] and
    standing for the n token ids from its start id on."""

    def __init__(self):
        super().__init__()
        self.additional = torch.nn.ParameterDict()  # empty: nothing in the state dict
        self.starts: dict[str, int] = {}  # "extra" / "additional.<i>" -> the id of its first token

    def named_sets(self) -> list[tuple[str, torch.Tensor]]:
        main = self._parameters.get("extra")
        return ([("extra", main)] if main is not None else []) + [(f"additional.{i}", p)
                                                                  for i, p in self.additional.items()]

    def add(self, name: str, start: int, vectors: torch.Tensor) -> torch.nn.Parameter:
        parameter = torch.nn.Parameter(vectors.detach().float().clone())
        if name == "extra":
            self.extra = parameter
        else:
            self.additional[name.removeprefix("additional.")] = parameter
        self.starts[name] = start
        return dict(self.named_sets())[name]

    def forward(self, ids: torch.Tensor, states: list[torch.Tensor]) -> list[torch.Tensor]:
        """`states` ([B, S, width] each) with the rows at the output tokens' positions of `ids` ([B, S]) replaced."""
        ids = ids.to(states[0].device)
        for name, vectors in self.named_sets():
            index = ids - self.starts[name]
            hit = ((index >= 0) & (index < vectors.shape[0])).unsqueeze(-1)
            rows = vectors[index.clamp(0, vectors.shape[0] - 1)]
            states = [torch.where(hit, rows.to(state.dtype), state) for state in states]
        return states

    def substitute(self, encoder, args, kwargs, output):
        """The forward hook on the text encoder: its hidden states with the vectors in place."""
        ids = args[0] if args else kwargs.get("input_ids")
        if not hasattr(output, "last_hidden_state"):
            raise TypeError("an output embedding's text encoder must return its ModelOutput (return_dict), not a "
                            "tuple")
        hidden = output.hidden_states or ()
        last, *layers = self(ids, [output.last_hidden_state, *hidden])
        output["last_hidden_state"] = last
        if hidden:
            output["hidden_states"] = tuple(layers)
        return output


def attach(encoder: torch.nn.Module, token_embedding) -> OutputVectors:
    """The OutputVectors of `encoder` (whose input embedding is `token_embedding`, an ExtendedTokenEmbedding); the
    first call adds it and hooks the encoder's forward. The hook is a bound method of the child module, so a deep
    copy of the encoder (the sampler's inference copies) carries a hook bound to the copy's own vectors."""
    if "outputs" not in token_embedding._modules:
        token_embedding.outputs = OutputVectors()
        encoder.register_forward_hook(token_embedding.outputs.substitute, with_kwargs=True)
    return token_embedding.outputs


def start_output_vectors(model, tokenizer_name: str, encoder_name: str, init_text: str, count: int) -> torch.Tensor:
    """OneTrainer's start of an output embedding without a file (ModelSetupEmbeddingMixin._create_new_embedding with
    its create_output_embedding_fn): the encoder's hidden states, as the family reads them, of the text
    `init_text + "*" x count`, at the `count` positions after the first (a CLIP's or Gemma's start token; a T5 has
    none, and OneTrainer's `[1:]` skips its first word all the same). Padded on the right, as every family's
    conditioning pads (a Gemma tokenizer's own default is the left, which would put padding at those positions)."""
    tokenizer, encoder = model.tokenizers[tokenizer_name], model.text_encoders[encoder_name]
    text = init_text + "*" * count
    encoded = tokenizer([text], padding="max_length", max_length=model.family.max_tokens(tokenizer_name, tokenizer),
                        truncation=True, padding_side="right", return_tensors="pt")
    masked = {"attention_mask": encoded.attention_mask.to(encoder.device)} if model.family.output_states_masked else {}
    with torch.no_grad():
        output = encoder(encoded.input_ids.to(encoder.device), output_hidden_states=True, **masked)
        return model.family.text_states(encoder_name, output)[0, 1:1 + count].float().cpu()


def read_output_vectors(path: str | Path, family, widths: dict[str, int], key: str) -> dict[str, torch.Tensor]:
    """{encoder: [n, width]} from an embedding file by OneTrainer's rule: `<key>_out` where the file has it for every
    output encoder (an output embedding's file), else the vectors an input embedding's file holds (which OneTrainer,
    too, takes as the output vectors of an output embedding). Encoders of the family's embedding_keys that take input
    vectors beside them (Flux's CLIP-L) read their embedding key (`clip_l`) either way; an encoder the family lets a
    file lack (embedding_keys_optional) is left out and starts from init_text."""
    with safe_open(str(Path(path).expanduser()), framework="pt") as f:
        keys = set(f.keys())
    out_keys = {name: base + OUT_SUFFIX for name, base in family.output_embedding_keys.items()}
    read = dict(family.embedding_keys)
    if all(k in keys for k in out_keys.values()):
        read.update(out_keys)
    elif any(k in keys for k in out_keys.values()):
        raise ConfigError(f"{key}: {path} has {sorted(keys)}: an output embedding's file holds "
                          f"{sorted(out_keys.values())}")
    return read_embedding_file(path, read, widths, family.embedding_key_copies, family.embedding_keys_optional)


def file_vectors(family, states: dict[str, dict[str, torch.Tensor]], row_name: str) -> dict[str, torch.Tensor]:
    """OneTrainer's file of one output embedding: per output encoder its zero input rows under `<key>` and its vectors
    under `<key>_out`; per encoder that takes input vectors beside them (Flux's CLIP-L) its trained rows under its
    embedding key. `states`: each encoder's full state dict (what a strategy's `state_dict_of` gives); `row_name`:
    "extra" or "additional.<i>"."""
    from ot_dist.methods.token_vectors import rows_in_state

    tensors = {}
    for name, key in family.embedding_keys.items():
        base = family.output_embedding_keys.get(name)
        if base is None:
            tensors[key] = rows_in_state(states[name], row_name)
            continue
        tensors[base] = rows_in_state(states[name], row_name)
        tensors[base + OUT_SUFFIX] = rows_in_state(states[name], f"outputs.{row_name}")
    return tensors
