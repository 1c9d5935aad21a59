"""Prodigy (Mishchenko & Defazio) that gives the same step-size estimate d on one process and on any
number of ranks, whatever holds the parameters: whole tensors, FSDP2 DTensor shards or ZeRO's flat
fp32 partitions.

The math is prodigyopt 1.1's (its defaults, its update). What differs is how the estimate is summed:

- d needs two sums over every trained element: <g, p0 - p> and |s|. Each rank sums the elements it
  owns in float32 blocks aligned to each parameter's start, adds the blocks in float64 (so a ZeRO
  partition of a billion elements is not summed in float32 end to end, and where a parameter is cut
  barely matters) into one pair on the parameters' device and, when the parameters are sharded, one
  all-reduce of that pair per optimizer step completes it. One host sync per step reads the result
  (prodigyopt syncs twice per tensor and calls `.cuda()` on whatever it reduces).
- `slice_p` keeps every p-th element *of each parameter* (counted from the parameter's start, via
  the strategy's ownership map), so the estimate does not depend on how the parameter is cut.
- The collective happens on every rank or on none: it depends only on the learning rate, which the
  schedule makes identical everywhere, never on what a rank happens to hold (an empty shard, a
  parameter without gradient); prodigyopt lets such a rank skip it and the others hang.
- A step at learning rate 0 (warmup from 0) changes nothing and is not counted, as in prodigyopt for
  unsharded parameters (its sharded path fails there).
- A parameter group whose learning rate is 0 is not stepped at all (prodigyopt still moves it by the
  largest group's step).

Without `attach_ownership` (plain use), every parameter is owned whole and nothing is reduced.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ot_dist.parallel.ownership import Ownership, local, sum_by_parameter_blocks, whole


class ShardedProdigy(torch.optim.Optimizer):
    def __init__(
        self, params, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, weight_decay=0.0, decouple=True,
        use_bias_correction=False, safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=float("inf"),
        fsdp_in_use=False, slice_p=1,
    ):
        if not d0 > 0:
            raise ValueError(f"Invalid d0 value: {d0}")
        if not lr > 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps > 0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"Invalid betas: {betas}")
        if slice_p < 1:
            raise ValueError(f"Invalid slice_p: {slice_p}")
        defaults = dict(
            lr=lr, betas=betas, beta3=beta3, eps=eps, weight_decay=weight_decay, d=d0, d0=d0, d_max=d0,
            d_numerator=0.0, d_coef=d_coef, k=0, growth_rate=growth_rate, use_bias_correction=use_bias_correction,
            decouple=decouple, safeguard_warmup=safeguard_warmup, fsdp_in_use=fsdp_in_use, slice_p=slice_p,
        )
        super().__init__(params, defaults)
        self.ownership: Ownership | None = None
        self.chunking = "auto"  # "per_tensor" / "whole" force one branch of `in_chunks` (tests run both on CPU)

    def attach_ownership(self, ownership: Ownership) -> None:
        """How the parameters this rank steps map onto the full ones, and the group to sum over."""
        self.ownership = ownership
        for group in self.param_groups:
            group["fsdp_in_use"] = ownership.sharded

    def _selection(self, p: torch.Tensor, state: dict, every: int):
        if "selection" not in state:
            owned = self.ownership.of(p) if self.ownership else None
            if owned is None:
                if self.ownership is not None and self.ownership.sharded:
                    raise RuntimeError("ShardedProdigy: a parameter the strategy's ownership map does not know")
                owned = whole(p, "")
            state["selection"] = owned.selection(every)
        return state["selection"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = self.param_groups[0]
        lr = max(group["lr"] for group in self.param_groups)
        if lr == 0.0:
            return loss
        beta1, beta2 = first["betas"]
        beta3 = first["beta3"] if first["beta3"] is not None else math.sqrt(beta2)
        d, d_max, d0, k = first["d"], first["d_max"], first["d0"], first["k"]
        bias_correction = (
            ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)) if first["use_bias_correction"] else 1.0
        )
        dlr = d * lr * bias_correction

        active = []  # (group, chunks of (params, grads, states)) of the groups that step
        numerators, denominators = [], []
        for group in self.param_groups:
            if group["lr"] == 0.0:
                continue
            params, grads, states = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                params.append(local(p))
                grads.append(local(p.grad))
                states.append(self._state_for(p, params[-1], beta1, group["slice_p"]))
            chunks = in_chunks(params, grads, states, self.chunking)
            s_rate = (d / d0) * (d if group["safeguard_warmup"] else dlr)
            for chunk in chunks:
                numerator, denominator = accumulate(*chunk, group, beta1, beta2, beta3, d, s_rate)
                numerators += numerator
                denominators += denominator
            active.append((group, chunks))

        totals = torch.zeros(2, dtype=torch.float64, device=self._device())
        if numerators:
            totals[0] = torch.stack(numerators).sum() * ((d / d0) * dlr)
            totals[1] = torch.stack(denominators).sum()
        if self.ownership is not None and self.ownership.sharded:
            on_device = totals.to(self.ownership.device)  # e.g. NCCL needs it on the GPU under CPU offload
            dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=self.ownership.group)
            totals = on_device
        delta_numerator, d_denom = totals.tolist()  # the one host sync of the step
        if d_denom == 0:
            return loss  # no gradient anywhere yet (decided on the global sum: every rank returns)

        d_numerator = first["d_numerator"] * beta3 + delta_numerator
        d_hat = first["d_coef"] * d_numerator / d_denom
        if d == d0:
            d = max(d, d_hat)
        d_max = max(d_max, d_hat)
        d = min(d_max, d * first["growth_rate"])

        for group in self.param_groups:
            group.update(d_numerator=d_numerator, d_denom=d_denom, d=d, d_max=d_max, d_hat=d_hat, k=k + 1)
        for group, chunks in active:
            for params, grads, states in chunks:
                take_step(params, grads, states, group, beta1, d, dlr)
        return loss

    def _state_for(self, p: torch.Tensor, values: torch.Tensor, beta1: float, slice_p: int) -> dict:
        state = self.state[p]
        if "step" not in state:
            selection = self._selection(p, state, slice_p)
            state["step"] = 0
            state["p0"] = values.reshape(-1)[selection.index].clone()
            state["s"] = torch.zeros_like(state["p0"])
            if beta1 > 0:
                state["exp_avg"] = torch.zeros_like(values)
            state["exp_avg_sq"] = torch.zeros_like(values)
        elif "selection" not in state:  # restored from a state dict
            self._selection(p, state, slice_p)
        return state

    def _device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return local(p).device
        return torch.device("cpu")

    def checkpoint_state(self, p: torch.Tensor) -> dict:
        """p's state for a checkpoint, every entry shaped like p's local tensor: p0 and s (kept only at the
        slice_p selection) are spread back to their elements, so they reshard like the moments."""
        state = {k: v for k, v in self.state.get(p, {}).items() if k != "selection"}
        if "p0" in state:
            shape, index = local(p).shape, self.state[p]["selection"].index
            for key in ("p0", "s"):
                full = torch.zeros(shape.numel(), dtype=state[key].dtype, device=state[key].device)
                full[index] = state[key]
                state[key] = full.view(shape)
        return state

    def load_checkpoint_state(self, p: torch.Tensor, state: dict) -> None:
        """The inverse of `checkpoint_state`, on this run's layout."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        entry: dict = {}
        index = self._selection(p, entry, group["slice_p"]).index
        entry.update({k: (v.reshape(-1)[index].clone() if k in ("p0", "s") else v) for k, v in state.items()})
        self.state[p] = entry

    def state_dict(self):
        # The selection is derived from the layout (and may be a slice): rebuilt after loading.
        state = super().state_dict()
        state["state"] = {
            key: {name: value for name, value in entry.items() if name != "selection"}
            for key, entry in state["state"].items()
        }
        return state


def in_chunks(params: list, grads: list, states: list, chunking: str = "auto") -> list[tuple[list, list, list]]:
    """On the CPU one tensor at a time: every operation of the step on a tensor while it is in cache
    (what makes prodigyopt's per-tensor loop fast there). On accelerators one chunk of everything:
    foreach kernels, few launches. `chunking` "per_tensor" / "whole" forces one of the two."""
    if not params:
        return []
    if chunking not in ("auto", "per_tensor", "whole"):
        raise ValueError(f"chunking must be auto, per_tensor or whole, not {chunking!r}")
    if chunking == "per_tensor" or (chunking == "auto" and params[0].device.type == "cpu"):
        return [([p], [g], [s]) for p, g, s in zip(params, grads, states)]
    return [(params, grads, states)]


def accumulate(params, grads, states, group, beta1, beta2, beta3, d, s_rate):
    """Phase 1 of the step, with the current d: the moments, s, and this chunk's terms of the two
    sums d is estimated from. Returns ([<g, p0 - p> per tensor], [|s| per tensor]), float64."""
    if group["weight_decay"] != 0 and not group["decouple"]:
        add_scaled_(grads, params, group["weight_decay"])
    selected_grads = [g.reshape(-1)[s["selection"].index] for g, s in zip(grads, states)]
    numerators = []
    for g, p, s in zip(selected_grads, params, states):
        products = torch.sub(s["p0"], p.reshape(-1)[s["selection"].index]).mul_(g)
        numerators.append(sum_by_parameter_blocks(products, s["selection"].runs))
    if beta1 > 0:
        exp_avgs = [s["exp_avg"] for s in states]
        torch._foreach_mul_(exp_avgs, beta1)
        add_scaled_(exp_avgs, grads, d * (1 - beta1))
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=d * d * (1 - beta2))
    ss = [s["s"] for s in states]
    torch._foreach_mul_(ss, beta3)
    add_scaled_(ss, selected_grads, s_rate)
    magnitudes = [ss[0].abs()] if len(ss) == 1 else torch._foreach_abs(ss)
    denominators = [sum_by_parameter_blocks(a, s["selection"].runs) for a, s in zip(magnitudes, states)]
    return numerators, denominators


def take_step(params, grads, states, group, beta1, d, dlr):
    """Phase 2, with the new d: the Adam-like update of prodigyopt."""
    denoms = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
    torch._foreach_add_(denoms, d * group["eps"])
    if group["weight_decay"] != 0 and group["decouple"]:
        add_scaled_(params, params, -group["weight_decay"] * dlr)
    if beta1 > 0:
        torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states], denoms, value=-dlr)
    else:
        torch._foreach_addcdiv_(params, grads, denoms, value=-dlr * d)
    for s in states:
        s["step"] += 1


def add_scaled_(targets: list, sources: list, alpha: float) -> None:
    """targets += alpha * sources. One tensor: the fused in-place op (torch's foreach with alpha falls
    back to a multiply into a new tensor and an add on the CPU)."""
    if len(targets) == 1:
        targets[0].add_(sources[0], alpha=alpha)
    else:
        torch._foreach_add_(targets, sources, alpha=alpha)

