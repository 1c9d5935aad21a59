"""MUON's parameter groups: Muon orthogonalises the momentum of weight matrices (2-D and up, flattened to
2-D); biases and norm scales have no matrix to orthogonalise and take an AdamW step at `muon_adam_lr`
(as OneTrainer's MuonWithAuxAdam does). Each group of the method becomes up to two: `<name>` (Muon, the
group's learning rate) and `<name>_adam` (AdamW); the schedule scales both from their own initial rate."""

from __future__ import annotations


def muon_groups(param_groups: list[dict], options: dict) -> list[dict]:
    split = []
    for group in param_groups:
        matrices = [p for p in group["params"] if p.ndim >= 2]
        rest = [p for p in group["params"] if p.ndim < 2]
        if matrices:
            split.append({**group, "params": matrices, "use_muon": True})
        if rest:
            lr = options["muon_adam_lr"]
            split.append({**group, "params": rest, "use_muon": False, "lr": lr, "initial_lr": lr,
                          "name": f"{group['name']}_adam"})
    return split
