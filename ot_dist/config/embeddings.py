"""The `additional_embeddings` list: new tokens trained together with a LoRA or a full finetune (pivotal tuning;
OneTrainer's additional_embeddings), and the checks that span the list and the rest of the config."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from ot_dist.config.section import Section


def safetensors_only(value: str | None, key: str) -> str | None:
    # .pt / .bin embeddings (A1111's, kohya's, OneTrainer's old ones) are pickles, which can run code when loaded
    if value is not None and not value.lower().endswith(".safetensors"):
        raise ValueError(f"{key}: {value} is not a .safetensors file; .pt / .bin embeddings are Python pickles, which "
                         "can run code when loaded (convert it to .safetensors first)")
    return value


# A vector count: a number, or "auto" (OneTrainer's token_count null): one vector per token of init_text, counted by
# the model's tokenizers when it is loaded (methods/token_vectors.py auto_vector_count).
VectorCount = Annotated[int, Field(ge=1)] | Literal["auto"]
AUTO_VECTORS = ('"auto": one per token of init_text, as the model\'s tokenizers count them when it loads '
                "(OneTrainer's token_count null; the encoders' tokenizers must agree)")


def lower_case_for_several_vectors(token: str, vectors: int | str, key: str) -> None:
    # CLIP tokenizers lower-case the prompt, and diffusers expands TOKEN to TOKEN TOKEN_1 ... only when the
    # lower-cased word is the registered one (loaders/textual_inversion.py `maybe_convert_prompt`): an upper-case
    # token would train all its vectors but give one in diffusers' pipelines and in ot_dist's own samples.
    if (vectors == "auto" or vectors > 1) and token != token.lower():
        raise ValueError(f"{key}: {token!r} with {vectors} vectors must be lower case ({token.lower()!r}): CLIP "
                         "tokenizers lower-case the prompt, so diffusers' pipelines would expand an upper-case token "
                         "to its first vector only")


def check_token_case(config, family) -> None:
    """Every embedding token lower case where the family lower-cases the prompt (`Family.lowercases_prompts`): an
    upper-case token would never be found there, so its vectors would not train (or not be read by the samples)."""
    if not family.lowercases_prompts:
        return
    tokens = [("embedding.token", config.embedding.token)] if config.method == "embedding" else []
    tokens += [(f"additional_embeddings[{i}].token", e.token) for i, e in enumerate(config.additional_embeddings)]
    for key, token in tokens:
        if token != token.lower():
            raise ValueError(f"{key}: {token!r} must be lower case ({token.lower()!r}) for {config.model.family}: "
                             f"{family.lowercases_prompts}")


def file_stem(token: str) -> str:
    """The file name an additional embedding is written under (output_dir/embeddings/<stem>.safetensors): the token
    without the characters Windows refuses in file names (`<sks>` -> `sks`). A1111 and ComfyUI take the file name as
    the prompt word (ComfyUI: `embedding:<stem>`); diffusers reads the token from the file's metadata-free key."""
    return re.sub(r'[<>:"/\\|?*\s]', "", token) or "embedding"


OUTPUT_EMBEDDING_DESCRIPTION = (
    "OneTrainer's is_output_embedding: the vectors live in the text encoders' output space. The tokens' input rows "
    "are zeros (frozen) and the encoders' hidden states at the tokens' positions are replaced by the trained vectors, "
    "in training and in the samples. Without init_from they start as OneTrainer starts them: the encoder's hidden "
    "states (the layer the model reads) of init_text followed by one '*' per vector, at the positions after the "
    "first. The file is OneTrainer's (<key> zeros, <key>_out the vectors: emp_params for SD 1.x / 2.x, "
    "clip_l / clip_g for SDXL, clip_l / clip_g / t5 for SD3, t5 for Flux, PixArt and Chroma, gemma for Sana), which "
    "only OneTrainer reads; init_from reads <key>_out, else an input embedding's vectors. SD 1.x / 2.x and Sana "
    "(without a text_encoder_layer_skip), SDXL, SD3 / 3.5 (both CLIPs' penultimate layer and the T5), Flux.1 (the "
    "T5; its CLIP-L trains input vectors beside them, written as clip_l, as OneTrainer's Flux embedding), Stable "
    "Cascade and Würstchen v2 (clip_g), PixArt-α / Σ and Chroma (their T5's last hidden state)."
)

SUPPORTED_OUTPUT_EMBEDDINGS = ("SD 1.x / 2.x, SDXL, SD3, Flux.1, Sana, Stable Cascade, Würstchen v2, PixArt and Chroma "
                               "do")


def check_output_embedding(key: str, config, family) -> None:
    """An output embedding (`key` names its output_embedding field) against the family and the model section."""
    if not family.output_embedding_keys:
        raise ValueError(f"{key}: model family {config.model.family} takes no output embeddings in ot_dist "
                         f"({SUPPORTED_OUTPUT_EMBEDDINGS}; OneTrainer's output embeddings of HiDream's T5 / Llama are "
                         "not supported yet)")
    conflict = family.output_embedding_conflict(config.model)
    if conflict is not None:
        field, why = conflict
        raise ValueError(f"{key}: with {field}: {why}")


class AdditionalEmbeddingConfig(Section):
    """One additional embedding (OneTrainer's TrainEmbeddingConfig): a new token whose vectors train beside the
    method's weights, in their own parameter group."""

    token: str = Field(
        min_length=1,
        description="The placeholder (OneTrainer's placeholder). Captions that contain it (in any case) use it there "
        "(expanded to its vectors' words); unlike method embedding it is never prepended: write it into the captions "
        "(a concept's caption_prefix does). No spaces; no '.' (the bundled LoRA keys split the name there). Lower "
        "case when vectors > 1.",
    )
    vectors: VectorCount = Field(default=1, description="Number of vectors (OneTrainer's token_count), or "
                                 f"{AUTO_VECTORS}. With init_from the file sets it (a different number here is an "
                                 "error).")
    init_text: str = Field(
        default="*", min_length=1,
        description="Text whose token embeddings start the vectors (unless init_from), repeated up to the count.",
    )
    init_from: str | None = Field(
        default=None,
        description="An embedding .safetensors to start from (OneTrainer's model_name), in any layout "
        "embedding.init_from reads. With train: false the vectors stay as the file has them.",
    )
    train: bool = Field(default=True, description="Train the vectors; false uses them (from init_from) unchanged.")
    learning_rate: float | None = Field(
        default=None, gt=0, description="Learning rate of these vectors; unset = embedding.learning_rate, else the "
        "top-level learning_rate.",
    )
    stop_training_after: int | None = Field(
        default=None, ge=0, description="Stop training these vectors after this many epochs or steps (unit below); "
        "strategies single and ddp.",
    )
    stop_training_after_unit: Literal["epoch", "step"] = Field(default="epoch",
                                                               description="Unit of stop_training_after.")
    output_embedding: bool = Field(default=False, description=OUTPUT_EMBEDDING_DESCRIPTION)

    @field_validator("init_from")
    @classmethod
    def _safetensors_only(cls, value: str | None) -> str | None:
        return safetensors_only(value, "additional_embeddings[].init_from")

    def stopped(self, epoch: int, step: int) -> bool:
        """The rule of PartConfig.stopped: no longer trained in `epoch` once `step` optimizer steps are done."""
        if self.stop_training_after is None:
            return False
        return (epoch if self.stop_training_after_unit == "epoch" else step) >= self.stop_training_after

    def group_name(self) -> str:
        return f"embedding/{self.token}"

    @model_validator(mode="after")
    def _token(self) -> "AdditionalEmbeddingConfig":
        if re.search(r"\s", self.token):
            raise ValueError(f"additional_embeddings[].token: {self.token!r} has a space; the tokenizer would split it "
                             "into several words")
        if "." in self.token:
            raise ValueError(f"additional_embeddings[].token: {self.token!r} has a '.'; A1111 / Forge read a bundled "
                             "embedding's name up to the first '.' of its key (bundle_emb.<name>.<vectors>)")
        lower_case_for_several_vectors(self.token, self.vectors, "additional_embeddings[].token")
        if not self.train and not self.init_from:
            raise ValueError(f"additional_embeddings[] {self.token!r}: train false keeps the vectors as they start; "
                             "without init_from they are init_text's own rows, which the words themselves give (set "
                             "init_from, or train: true)")
        return self


def check_additional_embeddings(config, family) -> None:
    """The list against itself and the rest of the config; raises ValueError naming the entry."""
    entries = config.additional_embeddings
    if not entries:
        if config.bundle_additional_embeddings:
            raise ValueError("bundle_additional_embeddings: there are no additional_embeddings to bundle")
        return
    if not family.embedding_keys:
        raise ValueError(f"additional_embeddings: model family {config.model.family} has no text encoder that takes "
                         "embeddings; remove them")
    if config.data.cache_text:
        raise ValueError("data.cache_text: the additional embeddings change what the text encoders read (and train "
                         "while the run goes on); turn cache_text off")
    if config.bundle_additional_embeddings and config.method != "lora":
        raise ValueError(f"bundle_additional_embeddings: bundles them into the LoRA file; method {config.method} "
                         "writes each as its own file only (set it to false)")
    tokens = [("embedding.token", config.embedding.token)] if config.method == "embedding" else []
    tokens += [(f"additional_embeddings[{i}].token", e.token) for i, e in enumerate(entries)]
    for i, (key, token) in enumerate(tokens):
        for other_key, other in tokens[:i]:
            if token.lower() in other.lower() or other.lower() in token.lower():
                raise ValueError(f"{key}: {token!r} and {other_key} {other!r} overlap (the same token, or one inside "
                                 "the other; CLIP reads captions lower-cased): give each embedding its own token")
    stems = {}
    for i, entry in enumerate(entries):
        stem = file_stem(entry.token).lower()
        if stem in stems:
            raise ValueError(f"additional_embeddings[{i}].token: {entry.token!r} would be written to the same file as "
                             f"additional_embeddings[{stems[stem]}] (embeddings/{file_stem(entry.token)}.safetensors)")
        stems[stem] = i
        if entry.output_embedding:
            check_output_embedding(f"additional_embeddings[{i}].output_embedding", config, family)
            if config.bundle_additional_embeddings:
                raise ValueError(f"bundle_additional_embeddings: additional_embeddings[{i}] is an output embedding, "
                                 "which ot_dist writes as its own file only (OneTrainer's layout; set it to false)")
        if entry.stop_training_after is not None and config.strategy not in ("single", "ddp"):
            raise ValueError(f"additional_embeddings[{i}].stop_training_after: not supported with strategy "
                             f"{config.strategy} yet (sharded parameters cannot leave training mid-run); use strategy "
                             "single or ddp")
