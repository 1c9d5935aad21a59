"""diffusers' scaled-dot-product attention processor without its division by a rescale factor of 1.

`AttnProcessor2_0` (the UNets' attention, SD 1.x / 2.x / SDXL, and PixArt's) ends every call with
`hidden_states / attn.rescale_output_factor`. The factor is 1.0 in every denoiser ot_dist trains, yet the division is
a full-size op in forward and another in backward (and again in a recomputation): on an SDXL UNet 140 attention calls
per step, 280 launches of the ~8,200 a LoRA step makes (issue 21: those steps are paced by the host that launches
them). Dividing by 1.0 returns every value unchanged (x / 1.0 == x in IEEE arithmetic, signed zeros, infinities and
NaN included), and so does its backward: leaving it out gives the same bits.

The processor below computes what `AttnProcessor2_0` computes for an attention module that uses none of its options
(no spatial or group norm, no cross-attention norm, no residual connection, no mask, 3-D hidden states, factor 1);
any other call goes to diffusers' own processor, kept for it. The weights, their names and the LoRA targets are the
module's own: only the processor object changes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LeanAttnProcessor:
    """`AttnProcessor2_0` for plain attention calls, without the division by 1; the rest to `fallback`."""

    def __init__(self, fallback):
        self.fallback = fallback  # diffusers' processor the module had

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None, *args, **kwargs):
        if args or kwargs or attention_mask is not None or hidden_states.ndim != 3 or not plain(attn):
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        batch = hidden_states.shape[0]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query, key, value = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))  # the output projection and its dropout


def plain(attn) -> bool:
    """Whether the module uses none of the options the lean processor leaves out."""
    return (attn.spatial_norm is None and attn.group_norm is None and not attn.norm_cross
            and not attn.residual_connection and attn.rescale_output_factor == 1.0)


def use_lean_attention(module: torch.nn.Module) -> int:
    """Give every attention module of `module` whose processor is diffusers' `AttnProcessor2_0` the lean one.
    Returns how many."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    changed = 0
    for attn in module.modules():
        if isinstance(attn, Attention) and type(attn.processor) is AttnProcessor2_0 and plain(attn):
            attn.processor = LeanAttnProcessor(attn.processor)  # set_processor would log the swap for every module
            changed += 1
    return changed
