"""OneTrainer's additional_embeddings (TrainConfig: a list of TrainEmbeddingConfig trained beside the LoRA / finetune,
ModelSetupEmbeddingMixin) and bundle_additional_embeddings (its LoRA savers' `bundle_emb.<placeholder>.*` keys) as
ot_dist's additional_embeddings / bundle_additional_embeddings."""

from __future__ import annotations

import re

from ot_dist.migrate import onetrainer_defaults as defaults
from ot_dist.migrate.common import Imported, local_path


def import_additional_embeddings(ot: dict, c: dict, method: str, out: Imported) -> None:
    skip = out.not_honoured.append
    entries = []
    for i, raw in enumerate(ot.get("additional_embeddings") or []):
        entry = _entry(f"additional_embeddings[{i}]", {**defaults.EMBEDDING, **(raw or {})}, ot, out)
        if entry is not None:
            entries.append(entry)
    if not entries:
        return
    c["additional_embeddings"] = entries
    if method != "embedding":  # method embedding's own import lists these already
        if ot.get("preserve_embedding_norm"):
            skip("preserve_embedding_norm: true is not supported")
        if ot.get("embedding_weight_dtype") not in ("FLOAT_32", None):
            skip(f"embedding_weight_dtype: {ot['embedding_weight_dtype']} (the vectors train in float32) is not "
                 "supported")
    if method == "lora" and ot.get("bundle_additional_embeddings", True):  # OneTrainer's default: bundled
        c["bundle_additional_embeddings"] = True
        out.notes.append("bundle_additional_embeddings: true (OneTrainer's default): lora.safetensors holds the "
                         "embeddings as bundle_emb.* keys, which A1111 reads, ComfyUI warns about and diffusers' "
                         "load_lora_weights refuses; the embeddings/ files are written either way (false keeps the "
                         "LoRA file plain)")


def _entry(key: str, embedding: dict, ot: dict, out: Imported) -> dict | None:
    """One TrainEmbeddingConfig as an additional_embeddings entry, or None (listed) where ot_dist cannot train it."""
    skip = out.not_honoured.append
    token = embedding["placeholder"]
    if embedding["is_output_embedding"]:
        skip(f"{key}.is_output_embedding: true (an embedding of the text encoder's output) is not supported; "
             f"{token} is left out")
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
    vectors = embedding["token_count"] or 1
    if (vectors > 1 or continued) and written != written.lower():
        written = written.lower()
    if written != token:
        out.notes.append(f"{key}.placeholder: {token} is written {written} (no spaces or dots; lower case for "
                         "several vectors): write it so in the captions (they match it in any case)")
    init_text = (embedding["initial_embedding_text"] or "").strip() or "*"
    # OneTrainer pads the initial text's tokens with the token of "*" (see onetrainer.py _embedding)
    entry = {"token": written, "vectors": vectors,
             "init_text": init_text + " *" * (vectors - 1) if init_text != "*" else init_text}
    if embedding["token_count"] is None and not continued:
        skip(f"{key}.token_count: null: OneTrainer makes one vector per token of "
             f"{embedding['initial_embedding_text']!r}; set vectors to that count (1 is written)")
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
