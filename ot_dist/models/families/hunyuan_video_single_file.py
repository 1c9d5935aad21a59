"""HunyuanVideo single files: the transformer in Tencent's original layout (the HunyuanVideo repository's
`mp_rank_00_model_states` keys, which Comfy-Org's `hunyuan_video_t2v_720p_bf16.safetensors` holds bare) <->
diffusers HunyuanVideoTransformer3DModel.

The renames are the inverse of diffusers' convert_hunyuan_video_transformer_to_diffusers (what from_single_file
applies to such a file); ComfyUI reads the same keys (comfy/model_detection.py tells the file by
`txt_in.individual_token_refiner.blocks.0.norm1.weight`, supported_models.HunyuanVideo.process_unet_state_dict renames
them into its own modules). What the original fuses, diffusers keeps apart:
- a double block's `img_attn_qkv` / `txt_attn_qkv` are `attn.to_q|to_k|to_v` / `attn.add_q|k|v_proj` (weight and
  bias, rows q | k | v), a single block's `linear1` is `attn.to_q|to_k|to_v` then `proj_mlp`, the token refiner's
  `self_attn_qkv` its `attn.to_q|to_k|to_v`;
- the final layer's `adaLN_modulation.1` emits shift, scale where diffusers' `norm_out.linear` emits scale, shift
  (the halves swap; the refiner's adaLN is renamed only).
Everything else is a rename (hunyuan_video_lora.py names the Linear modules the same way for LoRA files). ComfyUI's
own saved checkpoints (`model.model.` + its internal names, `self_attn.qkv`) are another layout and are refused by name.
The file is the transformer alone, bare or under `model.diffusion_model.`; the rest comes from the `model.config`
folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffusers import HunyuanVideoTransformer3DModel

from ot_dist.models.families import single_file_keys as K
from ot_dist.models.families.single_file_keys import CAT, SWAP, Rule

_INPUT_PREFIXES = ("model.diffusion_model.",)
# diffusers key prefix -> original, outside the blocks (the first that matches)
TOP = (("x_embedder.", "img_in."),
       ("time_text_embed.timestep_embedder.linear_1.", "time_in.mlp.0."),
       ("time_text_embed.timestep_embedder.linear_2.", "time_in.mlp.2."),
       ("time_text_embed.guidance_embedder.linear_1.", "guidance_in.mlp.0."),
       ("time_text_embed.guidance_embedder.linear_2.", "guidance_in.mlp.2."),
       ("time_text_embed.text_embedder.linear_1.", "vector_in.in_layer."),
       ("time_text_embed.text_embedder.linear_2.", "vector_in.out_layer."),
       ("context_embedder.proj_in.", "txt_in.input_embedder."),
       ("context_embedder.time_text_embed.timestep_embedder.linear_1.", "txt_in.t_embedder.mlp.0."),
       ("context_embedder.time_text_embed.timestep_embedder.linear_2.", "txt_in.t_embedder.mlp.2."),
       ("context_embedder.time_text_embed.text_embedder.", "txt_in.c_embedder."),
       ("norm_out.linear.", "final_layer.adaLN_modulation.1."),
       ("proj_out.", "final_layer.linear."))


@dataclass(frozen=True)
class BlockKind:
    """One kind of block: its diffusers and original prefixes (before the block's number), the modules renamed one to
    one, and the original fused modules with their diffusers parts in row order."""

    ours: str
    theirs: str
    renames: dict[str, str]
    fused: dict[str, tuple[str, ...]]


BLOCKS = (
    BlockKind("transformer_blocks.", "double_blocks.",
              {"norm1.linear": "img_mod.linear", "norm1_context.linear": "txt_mod.linear",
               "attn.norm_q": "img_attn_q_norm", "attn.norm_k": "img_attn_k_norm",
               "attn.norm_added_q": "txt_attn_q_norm", "attn.norm_added_k": "txt_attn_k_norm",
               "attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj",
               "ff.net.0.proj": "img_mlp.fc1", "ff.net.2": "img_mlp.fc2",
               "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2"},
              {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
               "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}),
    BlockKind("single_transformer_blocks.", "single_blocks.",
              {"attn.norm_q": "q_norm", "attn.norm_k": "k_norm", "norm.linear": "modulation.linear",
               "proj_out": "linear2"},
              {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}),
    BlockKind("context_embedder.token_refiner.refiner_blocks.", "txt_in.individual_token_refiner.blocks.",
              {"norm1": "norm1", "norm2": "norm2", "attn.to_out.0": "self_attn_proj", "ff.net.0.proj": "mlp.fc1",
               "ff.net.2": "mlp.fc2", "norm_out.linear": "adaLN_modulation.1"},
              {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}),
)


def hunyuan_video_rules(config: Any) -> list[Rule]:
    """The key map of a HunyuanVideoTransformer3DModel with this config."""
    cfg = K.full_config(HunyuanVideoTransformer3DModel, config)
    state = K.meta_state_dict(HunyuanVideoTransformer3DModel, cfg)
    rules: list[Rule] = []
    for key in state:
        kind = next((b for b in BLOCKS if key.startswith(b.ours)), None)
        if kind is None:
            ours, theirs = next(((o, t) for o, t in TOP if key.startswith(o)), (None, None))
            if ours is None:  # a module this diffusers version added: no original name is known for it
                raise K.KeyLayoutError(f"no original HunyuanVideo name for the transformer's {key}")
            rules.append(Rule(theirs + key[len(ours):], (key,), SWAP if ours == "norm_out.linear." else K.SAME))
            continue
        number, rest = key[len(kind.ours):].split(".", 1)
        module, parameter = rest.rsplit(".", 1)
        block, original = f"{kind.ours}{number}.", f"{kind.theirs}{number}."
        fused = next((name for name, parts in kind.fused.items() if module in parts), None)
        if fused is None:
            rules.append(Rule(f"{original}{kind.renames[module]}.{parameter}", (key,)))
        elif module == kind.fused[fused][0]:  # one rule per fused tensor, at its first part
            pieces = tuple(f"{block}{part}.{parameter}" for part in kind.fused[fused])
            rules.append(Rule(f"{original}{fused}.{parameter}", pieces, CAT, tuple(state[p].shape[0] for p in pieces)))
    return rules


HUNYUAN_VIDEO = K.TransformerFileLayout(HunyuanVideoTransformer3DModel, hunyuan_video_rules, "HunyuanVideo",
                                        _INPUT_PREFIXES)
