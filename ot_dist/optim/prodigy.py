"""Prodigy (Mishchenko & Defazio) that gives the same step-size estimate d on one process and on any
number of ranks, whatever holds the parameters: whole tensors, FSDP2 DTensor shards or ZeRO's flat
fp32 partitions.

The math is prodigyopt 1.1's (its defaults, its update). What differs is how the estimate is summed:

- d needs two sums over every trained element: <g, p0 - p> and |s|. Each rank sums the elements it
  owns in float32 blocks aligned to each parameter's start, adds the blocks in float64 (so a ZeRO
  partition of a billion elements is not summed in float32 end to end, and where a parameter is cut
  barely matters) into one pair on the parameters' device and, when the parameters are sharded, one
  all-reduce of that pair per optimizer step completes it. The estimate (d, d_max, its sums, k) stays
  on the device as float64 0-dim tensors and the step uses it there (torch.where / maximum for prodigyopt's
  branches), so the step reads nothing on the host (prodigyopt syncs twice per tensor and calls `.cuda()`
  on whatever it reduces). It is read when logged (d x lr, with the log window's one copy) and when a
  checkpoint saves the group settings (`state_dict` / the trainer state: plain numbers).
- `slice_p` keeps every p-th element *of each parameter* (counted from the parameter's start, via
  the strategy's ownership map), so the estimate does not depend on how the parameter is cut.
- The collective happens on every rank or on none: it depends only on the learning rate, which the
  schedule makes identical everywhere, never on what a rank happens to hold (an empty shard, a
  parameter without gradient); prodigyopt lets such a rank skip it and the others hang.
- A step at learning rate 0 (warmup from 0) changes nothing and is not counted, as in prodigyopt for
  unsharded parameters (its sharded path fails there).
- Before any gradient (the summed |s| is 0) prodigyopt returns before updating; here the estimate and the
  parameters are kept by a device-side select (the moments decay as in prodigyopt; only the per-tensor
  `step` counters, bookkeeping no formula reads, count that step).
- A parameter group whose learning rate is 0 is not stepped at all (prodigyopt still moves it by the
  largest group's step).
- `found_inf` (a 0-dim device tensor set as `optimizer.found_inf` during `step`, as torch's fused optimizers
  take it; ot_dist's lagged step guard passes the all-ranks non-finite-loss flag): when it is 1 the step
  changes no parameter, moment, s or estimate, decided on the device (the gradients are zeroed after weight
  decay, the moments' decay factors become 1, the estimate's update is masked, the step size is 0).

Without `attach_ownership` (plain use), every parameter is owned whole and nothing is reduced.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ot_dist.parallel.ownership import Ownership, local, sum_by_parameter_blocks, whole


class ShardedProdigy(torch.optim.Optimizer):
    skips_on_found_inf = True  # step honours `self.found_inf` (ot_dist/train/device_skip.py)

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
        d0 = first["d0"]
        # The estimate lives on the device (float64 0-dim tensors): nothing of it is read on the host here
        estimate = self._estimate(first)
        d, d_max, k = estimate["d"], estimate["d_max"], estimate["k"]
        found_inf = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf.to(d.device, non_blocking=True) != 0
        bias_correction = (
            torch.sqrt(1 - beta2 ** (k + 1)) / (1 - beta1 ** (k + 1)) if first["use_bias_correction"] else 1.0
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
                numerator, denominator = accumulate(*chunk, group, beta1, beta2, beta3, d, s_rate, skip)
                numerators += numerator
                denominators += denominator
            active.append((group, chunks))

        totals = torch.zeros(2, dtype=torch.float64, device=d.device)
        if numerators:
            totals[0] = torch.stack(numerators).sum() * ((d / d0) * dlr)
            totals[1] = torch.stack(denominators).sum()
        if self.ownership is not None and self.ownership.sharded:
            # e.g. NCCL needs it on the GPU under CPU offload (then the result comes back to the parameters')
            on_device = totals.to(self.ownership.device, non_blocking=True)
            dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=self.ownership.group)
            totals = on_device if on_device.device == totals.device else on_device.to(totals.device)
        delta_numerator, d_denom = totals[0], totals[1]
        # No gradient anywhere yet (decided on the global sum, so on every rank alike): the step changes no
        # parameter and no estimate. prodigyopt returns early; here the same is a device-side select.
        live = d_denom != 0
        if skip is not None:
            live = live & ~skip  # a skipped step leaves the estimate (and, through dlr 0, the parameters)

        d_numerator = torch.where(live, estimate["d_numerator"] * beta3 + delta_numerator, estimate["d_numerator"])
        d_hat = torch.where(live, first["d_coef"] * d_numerator / d_denom, estimate["d_hat"])
        grown = torch.where(d == d0, torch.maximum(d, d_hat), d)
        new_d_max = torch.where(live, torch.maximum(d_max, d_hat), d_max)
        new_d = torch.where(live, torch.minimum(new_d_max, grown * first["growth_rate"]), d)
        update = dict(d_numerator=d_numerator, d_denom=torch.where(live, d_denom, estimate["d_denom"]), d=new_d,
                      d_max=new_d_max, d_hat=d_hat, k=k + live)
        for group in self.param_groups:
            group.update(update)
        dlr = torch.where(live, dlr, 0.0)  # a step of 0 leaves every parameter as it is
        for group, chunks in active:
            for params, grads, states in chunks:
                take_step(params, grads, states, group, beta1, new_d, dlr)
        return loss

    ESTIMATE = ("d", "d_max", "d_numerator", "d_denom", "d_hat", "k")

    def _estimate(self, group: dict) -> dict[str, torch.Tensor]:
        """The estimate as float64 0-dim tensors on the parameters' device: as left by the last step, or made
        once from the plain numbers of a new optimizer / a loaded state (a host -> device copy, no read)."""
        device = self._device()
        return {key: torch.as_tensor(group.get(key, 0.0), dtype=torch.float64, device=device) for key in self.ESTIMATE}

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
        # The estimate is read here, at checkpoint time (outside the step): plain numbers, as prodigyopt's
        for group in state["param_groups"]:
            for key in self.ESTIMATE:
                if isinstance(group.get(key), torch.Tensor):
                    group[key] = int(group[key].item()) if key == "k" else group[key].item()
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


def accumulate(params, grads, states, group, beta1, beta2, beta3, d, s_rate, skip=None):
    """Phase 1 of the step, with the current d: the moments, s, and this chunk's terms of the two
    sums d is estimated from. Returns ([<g, p0 - p> per tensor], [|s| per tensor]), float64.
    d and s_rate are device tensors (never read on the host). `skip` (a 0-dim bool device tensor, or None):
    where true, the gradients are zeroed and the decay factors are 1, so nothing here changes."""
    if group["weight_decay"] != 0 and not group["decouple"]:
        add_scaled_(grads, params, group["weight_decay"])
    decays = (beta1, beta2, beta3)
    if skip is not None:
        for g in grads:
            g.masked_fill_(skip, 0.0)  # a NaN gradient times 0 would still be NaN
        decays = tuple(torch.where(skip, 1.0, torch.tensor(b, dtype=torch.float64, device=skip.device)) for b in decays)
    selected_grads = [g.reshape(-1)[s["selection"].index] for g, s in zip(grads, states)]
    numerators = []
    for g, p, s in zip(selected_grads, params, states):
        products = torch.sub(s["p0"], p.reshape(-1)[s["selection"].index]).mul_(g)
        numerators.append(sum_by_parameter_blocks(products, s["selection"].runs))
    if beta1 > 0:
        exp_avgs = [s["exp_avg"] for s in states]
        torch._foreach_mul_(exp_avgs, factor(decays[0], exp_avgs))
        add_(exp_avgs, scaled(grads, d * (1 - beta1)))
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    torch._foreach_mul_(exp_avg_sqs, factor(decays[1], exp_avg_sqs))
    # addcmul_'s order (value * g) * g, with value d * d * (1 - beta2)
    addcmul_(exp_avg_sqs, scaled(grads, d * d * (1 - beta2)), grads)
    ss = [s["s"] for s in states]
    torch._foreach_mul_(ss, factor(decays[2], ss))
    add_(ss, scaled(selected_grads, s_rate))
    magnitudes = [ss[0].abs()] if len(ss) == 1 else torch._foreach_abs(ss)
    denominators = [sum_by_parameter_blocks(a, s["selection"].runs) for a, s in zip(magnitudes, states)]
    return numerators, denominators


def take_step(params, grads, states, group, beta1, d, dlr):
    """Phase 2, with the new d: the Adam-like update of prodigyopt (d and dlr device tensors)."""
    denoms = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
    if len(denoms) == 1:
        denoms[0].add_(d * group["eps"])
    else:
        torch._foreach_add_(denoms, like(d * group["eps"], denoms))
    if group["weight_decay"] != 0 and group["decouple"]:
        add_(params, scaled(params, -group["weight_decay"] * dlr))
    # addcdiv_'s order: p + (value * m) / denom
    steps = scaled([s["exp_avg"] for s in states] if beta1 > 0 else grads, -dlr if beta1 > 0 else -dlr * d)
    if len(steps) == 1:
        steps[0].div_(denoms[0])
    else:
        torch._foreach_div_(steps, denoms)
    add_(params, steps)
    for s in states:
        s["step"] += 1


def factor(value, tensors: list):
    """A decay factor for _foreach_mul_: a Python float as it is, a 0-dim device tensor (masked by a skip) in the
    tensors' dtype (the same float32 rounding a Python float gets)."""
    return like(value, tensors) if isinstance(value, torch.Tensor) else value


def like(scale: torch.Tensor, tensors: list) -> torch.Tensor:
    """A 0-dim float64 scale in the tensors' dtype when that is float32 (the foreach kernels' fast path
    wants one dtype; a Python float scale is rounded the same way by the kernels)."""
    return scale.to(torch.float32) if tensors[0].dtype == torch.float32 else scale


def scaled(tensors: list, scale: torch.Tensor) -> list:
    """tensors * scale, new tensors (scale a 0-dim device tensor)."""
    if len(tensors) == 1:
        return [tensors[0] * scale]
    return torch._foreach_mul(tensors, like(scale, tensors))


def add_(targets: list, sources: list) -> None:
    if len(targets) == 1:
        targets[0].add_(sources[0])
    else:
        torch._foreach_add_(targets, sources)


def addcmul_(targets: list, first: list, second: list) -> None:
    if len(targets) == 1:
        targets[0].addcmul_(first[0], second[0])
    else:
        torch._foreach_addcmul_(targets, first, second)


def add_scaled_(targets: list, sources: list, alpha: float) -> None:
    """targets += alpha * sources. One tensor: the fused in-place op (torch's foreach with alpha falls
    back to a multiply into a new tensor and an add on the CPU)."""
    if len(targets) == 1:
        targets[0].add_(sources[0], alpha=alpha)
    else:
        torch._foreach_add_(targets, sources, alpha=alpha)
