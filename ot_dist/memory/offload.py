"""`offload_frozen_components`: frozen text encoders and the VAE live in CPU memory and visit the
accelerator only for their own forward.

The unit of movement is each direct child of a component (the VAE's quant_conv, a CLIP model's embeddings and
projection...), or, inside a child that holds a stack of blocks, each block (`movement_units`), because
`vae.encode` is not `forward`: hooks on the children fire whatever method the component is called through, and
the decoder's blocks, which training never calls, never move. The CPU parameters stay home: before a child's forward, device copies take
their place (and its tensor inputs move), after it the CPU parameters are put back. The weights are
frozen, so nothing is copied back. Outputs stay on the device.
With data.cache_latents / data.cache_text the components are not called while training at all.
"""

from __future__ import annotations

import torch


def offload_to_cpu(component: torch.nn.Module, device: torch.device) -> None:
    """Keep `component` (frozen) in CPU memory; its children run on `device`."""
    component.to("cpu")
    pin = torch.device(device).type == "cuda"
    for unit in movement_units(component):
        Visitor(unit, torch.device(device), pin).attach()


def movement_units(component: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that visit the device one at a time: the component's children, except that a child
    holding a stack of blocks (a ModuleList: a T5 / CLIP encoder, a VAE's down blocks) is entered and its
    blocks move one by one, so a T5-XXL (4.7 B parameters) never sits on the device whole. A child that owns
    parameters or buffers itself moves whole (its own forward reads them). A module shared by two parents
    (T5's `shared` embedding is also `encoder.embed_tokens`) is one unit."""
    units, seen = [], set()

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            enterable = isinstance(child, torch.nn.ModuleList) or (
                any(isinstance(c, torch.nn.ModuleList) for c in child.children())
                and not child._parameters and not child._buffers)
            if enterable:
                visit(child)
            else:
                units.append(child)

    visit(component)
    return units


class Visitor:
    """Moves one module's parameters and buffers (`entries`: (its dict of parameters or buffers, name); default: all
    of them) to the device for the length of its forward. The CPU tensor that stays home is whatever the entry holds
    when the forward starts (a copy of the module made with `load_state_dict(assign=True)` brings its own)."""

    def __init__(self, module: torch.nn.Module, device: torch.device, pin: bool, entries: list | None = None):
        self.module, self.device, self.pin = module, device, pin
        self.entries = every_entry(module) if entries is None else entries
        self.homes: list[torch.Tensor] = []
        self.depth = 0  # a child called re-entrantly (shared module) stays on the device until the outer call ends

    def attach(self) -> None:
        self.module.register_forward_pre_hook(self.arrive, with_kwargs=True)
        self.module.register_forward_hook(self.leave, always_call=True)

    def arrive(self, module, args, kwargs):
        if self.depth == 0:
            # Device copies under the same names; the CPU objects are put back afterwards, so whoever holds
            # them (peft, caches' keys) sees the same parameters between forwards.
            self.homes = [table[name] for table, name in self.entries]
            for (table, name), home, moved in zip(self.entries, self.homes, self.device_copies(self.homes)):
                table[name] = self.placed(home, moved)
        self.depth += 1
        return _to_device(args, self.device), _to_device(kwargs, self.device)

    def device_copies(self, homes: list[torch.Tensor]) -> list[torch.Tensor]:
        """A device copy of each home tensor, on the current stream."""
        return device_copies(homes, self.device, self.pin)

    def placed(self, home: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
        """What takes the home's place in the module for the forward: its device copy (a frozen parameter's as a
        parameter, for code that checks)."""
        return torch.nn.Parameter(moved, requires_grad=False) if isinstance(home, torch.nn.Parameter) else moved

    def leave(self, module, args, output):
        self.depth -= 1
        if self.depth == 0:
            for (table, name), home in zip(self.entries, self.homes):
                table[name] = home
            self.homes = []
        return output


def device_copies(homes: list[torch.Tensor], device: torch.device, pin: bool) -> list[torch.Tensor]:
    """A new device tensor for each home (also when the device is the CPU: autograd may keep it for backward, while the
    home is put back into its module). Pinned host memory makes the copy asynchronous; pinned here, not when attached,
    because a later change of the home's layout (channels_last) makes a new, pageable tensor."""
    copies = []
    for home in homes:
        if pin and not home.is_pinned():
            home.data = home.data.pin_memory()
        copies.append(home.detach().to(device, non_blocking=True, copy=True))
    return copies


def every_entry(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """(dict of parameters or buffers, name) of every parameter and buffer in `module` and below."""
    return [(table, name) for owner in module.modules() for table in (owner._parameters, owner._buffers)
            for name, tensor in table.items() if tensor is not None]


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value
