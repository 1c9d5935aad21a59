"""OneTrainer's additional_embeddings (TrainConfig: a list of TrainEmbeddingConfig trained beside the LoRA / finetune,
ModelSetupEmbeddingMixin) and bundle_additional_embeddings (its LoRA savers' `bundle_emb.<placeholder>.*` keys) as
ot_dist's additional_embeddings / bundle_additional_embeddings."""

from __future__ import annotations

import re

from ot_dist.migrate import onetrainer_defaults as defaults
from ot_dist.migrate.common import Imported, local_path


def output_embedding_refusal(c: dict) -> str | None:
    """Why the imported model takes no output embedding (is_output_embedding), or None: the family's, or a model
    setting's (SD's layer skip) refusal, as validation would say it."""
    from types import SimpleNamespace

    from ot_dist.config.embeddings import SUPPORTED_OUTPUT_EMBEDDINGS
    from ot_dist.models.families.registry import get_family

    family = get_family(c["model"]["family"])
    if not family.output_embedding_keys:
        return f"{c['model']['family']} takes no output embeddings in ot_dist ({SUPPORTED_OUTPUT_EMBEDDINGS})"
    model = SimpleNamespace(**{**{f"{name}_layer_skip": 0 for name in family.layer_skip_encoders}, **c["model"]})
    conflict = family.output_embedding_conflict(model)
    return None if conflict is None else f"not with {conflict[0]}: {conflict[1]}"


def vector_setting(embedding: dict, continued: str) -> tuple[int | str, bool]:
    """(ot_dist's vectors, whether the token may stand for several vectors) of a OneTrainer embedding: its
    token_count, or "auto" for its null (a vector per token of the initial text, counted by the tokenizers when the
    model loads, as OneTrainer counts them). A continued file sets the count itself."""
    auto = embedding["token_count"] is None and not continued
    vectors = "auto" if auto else embedding["token_count"] or 1
    return vectors, auto or bool(continued) or vectors > 1


def padded_init_text(init_text: str, vectors: int | str) -> str:
    """OneTrainer fills the vectors the initial text's tokens leave with the token of "*" (ModelSetupEmbeddingMixin);
    ot_dist repeats the text's tokens (kohya's way). A "*" per vector after the text gives OneTrainer's rows: the
    text's tokens first, then "*"s, cut at the vector count. With "auto" the text's tokens are the vectors."""
    return init_text if vectors == "auto" or init_text == "*" else init_text + " *" * (vectors - 1)


def output_init_text(embedding: dict) -> str:
    """An output embedding's init_text: OneTrainer's initial text as it is, since both start the vectors from the
    encoder's output of that text followed by a "*" per vector (the input rows' "*" padding does not apply)."""
    return embedding["initial_embedding_text"] or "*"


def import_additional_embeddings(ot: dict, c: dict, method: str, out: Imported) -> None:
    skip = out.not_honoured.append
    entries = []
    for i, raw in enumerate(ot.get("additional_embeddings") or []):
        entry = _entry(f"additional_embeddings[{i}]", {**defaults.EMBEDDING, **(raw or {})}, ot, c, out)
        if entry is not None:
            entries.append(entry)
    if not entries:
        return
    c["additional_embeddings"] = entries
    if method != "embedding":  # method embedding's own import lists these already
        if ot.get("preserve_embedding_norm") and any(entry.get("train", True) for entry in entries):
            c["preserve_embedding_norm"] = True  # OneTrainer's rescale of the embeddings that train
        if ot.get("embedding_weight_dtype") not in ("FLOAT_32", None):
            skip(f"embedding_weight_dtype: {ot['embedding_weight_dtype']} (the vectors train in float32) is not "
                 "supported")
    outputs = [i for i, entry in enumerate(entries) if entry.get("output_embedding")]
    if method == "lora" and ot.get("bundle_additional_embeddings", True) and outputs:
        skip(f"bundle_additional_embeddings: true: additional_embeddings[{outputs[0]}] is an output embedding, which "
             "ot_dist writes as its own file only (OneTrainer's layout); none is bundled")
    elif method == "lora" and ot.get("bundle_additional_embeddings", True):  # OneTrainer's default: bundled
        c["bundle_additional_embeddings"] = True
        out.notes.append("bundle_additional_embeddings: true (OneTrainer's default): lora.safetensors holds the "
                         "embeddings as bundle_emb.* keys, which A1111 reads, ComfyUI warns about and diffusers' "
                         "load_lora_weights refuses; the embeddings/ files are written either way (false keeps the "
                         "LoRA file plain)")


def _entry(key: str, embedding: dict, ot: dict, c: dict, out: Imported) -> dict | None:
    """One TrainEmbeddingConfig as an additional_embeddings entry, or None (listed) where ot_dist cannot train it."""
    skip = out.not_honoured.append
    token = embedding["placeholder"]
    output = embedding["is_output_embedding"]
    if output and (why := output_embedding_refusal(c)):
        skip(f"{key}.is_output_embedding: true (an embedding of the text encoder's output): {why}; {token} is left "
             "out")
        return None
    continued = embedding["model_name"]
    if continued and not continued.lower().endswith(".safetensors"):
        skip(f"{key}.model_name: {continued} is not a .safetensors file (a .pt / .bin is a pickle, which can run code "
             "when loaded: convert it to continue it); the vectors start from init_text")
        continued = ""
    if not embedding["train"] and not continued:
        skip(f"{key}: train false without a model_name keeps {token}'s vectors at the initial text's rows, which the "
             "words themselves give; left out (write the initial text in the captions)")
        return None
    written = re.sub(r"[\s.]", "_", token)
    vectors, several = vector_setting(embedding, continued)
    if several and written != written.lower():
        written = written.lower()
    if written != token:
        out.notes.append(f"{key}.placeholder: {token} is written {written} (no spaces or dots; lower case for "
                         "several vectors): write it so in the captions (they match it in any case)")
    init_text = (embedding["initial_embedding_text"] or "").strip() or "*"
    entry = {"token": written, "vectors": vectors, "init_text": padded_init_text(init_text, vectors)}
    if output:
        entry.update(output_embedding=True, init_text=output_init_text(embedding))
    if continued:
        del entry["vectors"]
        entry["init_from"] = local_path(continued, f"{key}.model_name", out)
    if not embedding["train"]:
        entry["train"] = False
        return entry
    if ot.get("embedding_learning_rate"):  # OneTrainer's one rate of every embedding
        entry["learning_rate"] = ot["embedding_learning_rate"]
    unit, after = embedding["stop_training_after_unit"], embedding["stop_training_after"]
    if after is not None and unit in ("EPOCH", "STEP"):
        entry["stop_training_after"], entry["stop_training_after_unit"] = after, unit.lower()
    elif after is not None and unit != "NEVER":
        skip(f"{key}.stop_training_after_unit: {unit} (ot_dist counts epochs or steps)")
    return entry
