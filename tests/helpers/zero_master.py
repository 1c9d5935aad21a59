"""Inside a launch: ZeRO-1/2 over float32 weights step no second copy of them.

DeepSpeed's ZeRO-1/2 optimizer clones this rank's partition of the flat weights into a float32 master copy; when the
weights are float32 (train_dtype float32, or bfloat16 under torch autocast) ot_dist makes that master a view of the
partition instead (parallel/deepspeed.py `share_fp32_master_with_flat_weights`). Lost, the runs still train alike
(DeepSpeed copies the master into the weights after each step): only the bytes tell, 4/N per parameter per rank.
Checked after training, so that what the steps, a checkpoint load or an optimizer did to the master is covered."""

from __future__ import annotations

import torch.distributed as dist


def master_should_share(trainer) -> bool:
    """Whether the run holds float32 weights under ZeRO-1/2 with the master on their device (no optimizer offload)."""
    config, strategy = trainer.config, trainer.strategy
    float32_weights = config.train_dtype == "float32" or getattr(strategy, "under_autocast", False)
    return strategy.name in ("zero1", "zero2") and float32_weights and not config.deepspeed.offload_optimizer


def master_copies(trainer) -> list[str]:
    """Where a ZeRO-1/2 run over float32 weights holds a second copy of them (empty: nowhere, or not such a run).
    Each group's master partition must be this rank's slice of the flat weights, and DeepSpeed's per-parameter views
    of the master (`_hp_mapping.hp_fragment`) must point into the flat weights too (a view of the constructor's clone
    would keep the clone alive)."""
    if not master_should_share(trainer):
        return []
    zero, copies = trainer.strategy.engine_optimizer, []
    for group, master in enumerate(zero.single_partition_of_fp32_groups):
        flat = zero.bit16_groups_flat[group].untyped_storage().data_ptr()
        rank = dist.get_rank(group=zero.real_dp_process_group[group])
        partition = zero.parallel_partitioned_bit16_groups[group][rank]
        if master.untyped_storage().data_ptr() != flat or master.data_ptr() != partition.data_ptr():
            copies.append(f"group {group}: the fp32 master is a copy of the flat weights, not a view")
        fragments = [p._hp_mapping.hp_fragment for p in zero.bit16_groups[group] if getattr(p, "_hp_mapping", None)]
        if not fragments or any(f.untyped_storage().data_ptr() != flat for f in fragments):
            copies.append(f"group {group}: the parameters' views of the master are not views of the flat weights")
    return copies


def offloaded_master_on_the_weights(trainer) -> bool:
    """Whether a ZeRO-1/2 run with optimizer offload steps its master in the weights' storage: it must not, the
    offloaded step keeps the master apart (CPU buffers, pinned on a GPU host) and copies it into the weights itself.
    On the CPU both sit on one device, so only this tells."""
    strategy = trainer.strategy
    if strategy.name not in ("zero1", "zero2") or not trainer.config.deepspeed.offload_optimizer:
        return False
    zero = strategy.engine_optimizer
    return any(master.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for master, flat in zip(zero.single_partition_of_fp32_groups, zero.bit16_groups_flat))


def assert_master_shares_the_weights(trainer) -> None:
    copies = master_copies(trainer)
    assert not copies, f"{trainer.config.output_dir}: {'; '.join(copies)}"
    assert not offloaded_master_on_the_weights(trainer), f"{trainer.config.output_dir}: offloaded master in the weights"
