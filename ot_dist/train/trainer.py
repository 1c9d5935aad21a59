"""The training loop: build everything from a validated config, train, export.

Read top to bottom: setup (model, method, data, optimizer), then epochs of micro batches with
gradient accumulation, then export.
"""

from __future__ import annotations

import functools
import gc
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ot_dist.checkpoint.layout import checkpoints_dir
from ot_dist.checkpoint.run_folder import estimated_free_space_warning, prepare_run_folder, release_output_dir
from ot_dist.checkpoint.training_state import Checkpointer, Position
from ot_dist.config.schema import TrainConfig
from ot_dist.errors import InputFileError, TrainingHalted, exit_code_of
from ot_dist.data.caches import attach_latent_cache, attach_text_cache
from ot_dist.data.concepts import check_clip_batches, check_video_clips
from ot_dist.data.video import check_clip_settings
from ot_dist.data.training_data import main_process_report, open_training_data, training_captions
from ot_dist.memory.block_streaming import connect_trained_streaming, denoiser_streamed_blocks, streamed_bytes_of
from ot_dist.memory.heap import freeze_long_lived_objects
from ot_dist.memory.node_shared import NodeSharing, share_frozen_cpu_weights
from ot_dist.memory.placement import place_component, store_component
from ot_dist.methods.additional_embeddings import check_tokens_in_captions
from ot_dist.methods.base import ParamGroup, TrainingMethod, kept_state_dict
from ot_dist.methods.registry import build_method
from ot_dist.early_checks import check_input_paths, setup_warnings
from ot_dist.models.loading import LoadedModel, load_model
from ot_dist.models.families.registry import get_family
from ot_dist.optim.adaptive import startup_warnings
from ot_dist.optim.factory import build_optimizer
from ot_dist.optim.registry import SPECS
from ot_dist.optim.schedule_free import averaged_weights
from ot_dist.optim.schedulers import build_scheduler, cycle_lows
from ot_dist.parallel import build_strategy
from ot_dist.parallel.base import Convert, grouped, named_groups, trained_modules
from ot_dist.parallel.load_turns import load_turn, master_widths
from ot_dist.parallel.ownership import Ownership, to_host
from ot_dist.parallel.runtime import Runtime, announce_failure, start_runtime
from ot_dist.precision import check_storage_on_device, set_tf32
from ot_dist.train.cuda_allocator import configure_cuda_allocator
from ot_dist.train.checkpointing import enable_gradient_checkpointing
from ot_dist.train.ema import ShardedEMA
from ot_dist.train.embedding_norm import EmbeddingNorms, group_names, trained_vectors
from ot_dist.train.fast_path import (apply_performance, attention_kernel, begin_step, check_performance,
                                     selective_checkpointing)
from ot_dist.train.inpainting import check_inpainting_setup
from ot_dist.train.loss import diffusion_loss
from ot_dist.train.loss_options import timestep_bounds
from ot_dist.train.masking import check_masks
from ot_dist.train.references import check_caches, check_references
from ot_dist.train.sampling import Sampler
from ot_dist.tracking import start_sender, start_tracking
from ot_dist.tracking.base import Tracker
from ot_dist.tracking.facts import memory_metrics
from ot_dist.tracking.progress import Progress
from ot_dist.tracking.utilization import UtilizationMeter
from ot_dist.tracking.window import StepRecord, StepWindow, applied_learning_rates, window_mean_loss
from ot_dist.train.steps import plan_steps
from ot_dist.train.device_skip import choose_lagged, skipping_on_device
from ot_dist.train.stopping import LaggedStepGuard, StepGuard, StopSignals
from ot_dist.train.validation import ValidationLoss

EXPORT_WAIT_S = 6 * 3600  # how long the other ranks wait for the main process's export


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # one per optimizer step
    steps: int = 0
    exported: list[Path] = field(default_factory=list)
    d_lr: list[dict[str, float]] = field(default_factory=list)  # adaptive optimizers: d x lr per group, per step
    first_step: int = 0  # optimizer steps done before this run (resumed from a checkpoint)
    stopped_by: str | None = None  # the signal that stopped training early (a checkpoint was saved)
    # steps whose non-finite loss was not applied (checkpoint.on_nonfinite_loss: skip_step); the lagged step guard
    # counts them as steps (result.steps), the blocking one does not
    skipped_steps: int = 0
    checkpoint: Path | None = None  # the last checkpoint saved
    # float16: steps whose gradients overflowed, so the loss scaler (torch's GradScaler, DeepSpeed's fp16 engine) did
    # not apply them; counted as steps (the schedule and the EMA moved on), found when the window is pulled
    overflowed_steps: list[int] = field(default_factory=list)


class Trainer:
    def __init__(self, config: TrainConfig, runtime: Runtime | None = None, log=print,
                 tracking_run_id: str | None = None, tracking_step_offset: int = 0, resume: str | None = None,
                 overwrite: bool = False):
        """`resume`: None, "auto" (the latest committed checkpoint in output_dir, if any) or a checkpoint path.
        `overwrite`: an earlier run in output_dir is moved aside (without it, starting over one is refused).
        `tracking_run_id` continues that MLflow run, its steps numbered after `tracking_step_offset`."""
        self.config = config
        self.tracking_run_id, self.tracking_step_offset = tracking_run_id, tracking_step_offset
        self.tracker = Tracker()  # the real one starts with train()
        self.runtime = runtime or start_runtime(config.distributed.timeout_minutes, needs_group=config.strategy != "single")
        try:
            self._build(log, resume, overwrite)
        except BaseException as err:
            announce_failure(exit_code_of(err))  # the other ranks may wait for this one in a collective
            # Nobody holds a trainer whose construction failed (a missing file, a refused setting): the process group
            # it started for itself (fsdp / ZeRO in one process) would outlive it, and the next run in this process
            # could not start its own.
            if runtime is None:
                self.runtime.shutdown()
            raise

    def _build(self, log, resume: str | None, overwrite: bool) -> None:
        """Everything __init__ sets up once the runtime is there (its arguments as __init__'s)."""
        config = self.config
        self.device = self.runtime.device
        self.log = log if self.runtime.is_main else (lambda *_: None)
        # Before anything heavy: never start over another run, a writable folder, an undamaged latest checkpoint.
        self.run = prepare_run_folder(config.output_dir, resume, overwrite, self.runtime,
                                      config.checkpoint.resume_past_damaged, self.log)
        if (space := estimated_free_space_warning(config.output_dir, config.model.path, config.method)):
            self.log(f"warning: {space}")
        check_input_paths(config)  # a missing model is named before shards are built
        check_performance(config.performance, self.device)
        check_storage_on_device(config, self.device)
        configure_cuda_allocator(config.performance, self.device)  # before anything is placed on the device
        for warning in setup_warnings(config, self.runtime.world_size):
            self.log(f"warning: {warning}")
        self.tracking_sender = start_sender(config, self.runtime.is_main, self.log)  # MLflow loads meanwhile, elsewhere
        set_tf32(config.tf32)
        torch.manual_seed(config.seed)
        self.dataset, self.reader = open_training_data(config, self.runtime, self.log)
        self.bucket_report = main_process_report(self.dataset, self.reader, self.runtime)
        for line in self.bucket_report:
            self.log(line)
        check_masks(self.dataset, config.masked_training, self.log)
        check_references(self.dataset, get_family(config.model.family))  # before the model loads
        # Qwen-Image-Edit's vision tower reads the references' pixels even when their latents are cached
        self.dataset.reference_pixels_with_latents = get_family(config.model.family).text_reads_references
        check_caches(config.data, get_family(config.model.family))
        check_video_clips(self.dataset.manifest, get_family(config.model.family))
        check_clip_settings(config.data, get_family(config.model.family))
        check_clip_batches(self.dataset.manifest, config.batch_size)
        check_tokens_in_captions(config.additional_embeddings, training_captions(self.dataset, self.reader.table))
        sizes = self.reader.table.epoch_sizes().values()
        self.plan = plan_steps(config, sizes, self.runtime.world_size)  # as `ot-dist schedule` counts
        self.global_batch, self.steps_per_epoch = self.plan.global_batch, self.plan.steps_per_epoch
        self.loss_scale = config.loss.scale(config.batch_size, config.gradient_accumulation_steps,
                                            self.runtime.world_size)  # loss.scaler's factor (1: off)
        self.total_steps = self.plan.total_steps
        self.validation = ValidationLoss(config, self.reader.table, self.runtime, self.log)
        self.strategy = build_strategy(config, self.runtime)
        self.strategy.start()  # what every rank makes together (a device mesh), before the turns below
        # the ranks of a node load (in CPU memory) and place the model a few at a time: the node's peak
        with load_turn(config.distributed.load_ranks_per_node, config.model.path, self.runtime.local_rank, self.log,
                       grown=master_widths(config)) as turns:
            # in its files' dtype: _place_modules casts every component to its storage before anything computes
            self.model: LoadedModel = load_model(config.model, in_files_dtype=True)
            timestep_bounds(config.loss, self.model.objective.num_timesteps)  # fails before training
            check_inpainting_setup(config, self.model)
            self.method: TrainingMethod = build_method(config)
            self.groups: list[ParamGroup] = self.method.prepare(self.model)
            # preserve_embedding_norm's targets, from the whole token tables (before any strategy shards them)
            norm_vectors = trained_vectors(self.model) if config.preserve_embedding_norm else []
            strategy_places = self.strategy.places_trained_modules(turns)
            self._place_modules(strategy_places=strategy_places)
            self.sampler = Sampler(config, self.model)  # before wrapping: it copies the trained modules' structure
            self._apply_performance()  # after that copy (samples run the plain modules), before wrapping
            if self.strategy.shards_while_placing:
                # the trained modules move to the device a unit at a time as they are sharded, in this rank's turn:
                # its CPU copy of them is gone before the next ranks load
                self._wrap()
        if config.data.cache_latents:  # needs the VAE in place; every rank encodes its share once
            attach_latent_cache(self.dataset, self.model.vae, self.runtime, self.log,
                                workers=config.data.loader_workers, posterior=self.model.family.encode_posterior)
        if config.data.cache_text:
            attach_text_cache(self.dataset, self.model, self.runtime, self.log)
        self.node_sharing = NodeSharing()  # after the last change of the CPU weights' layout (channels_last)
        if config.share_frozen_cpu_weights and self.runtime.distributed:
            # not the trained modules the strategy places (ZeRO-3 moves them from CPU memory when it wraps them)
            placed_later = list(trained_modules(self.model).values()) if strategy_places else []
            self.node_sharing = share_frozen_cpu_weights([m for _, m in self.model.named_components()
                                                          if not any(m is later for later in placed_later)],
                                                         pin=self.device.type == "cuda", log=self.log)
        if not self.strategy.shards_while_placing:  # DDP and DeepSpeed wrap with collectives: every rank at once
            self._wrap()
        self.optimizer = build_optimizer(config.optimizer, self.groups, seed=config.seed)
        connect_trained_streaming(self.model.denoiser, self.optimizer)  # a streamed block's weights step in backward
        if norm_vectors:  # their parameter groups, read before ZeRO replaces the groups' params by its partitions
            group_names(norm_vectors, self.optimizer, self.strategy.trained_parameters())
        self.optimizer = self.strategy.wrap_optimizer(self.optimizer)
        self.ownership = self.strategy.ownership()  # what this rank's optimizer steps
        # stochastic rounding's noise, of the weights and of averaged gradients: keyed to each optimizer step
        self.rounding_noises = [noise for noise in (getattr(self.optimizer, "rounding_noise", None),
                                                    self.strategy.rounding_noise) if noise is not None]
        if norm_vectors:  # rescales the vectors inside each step, before the strategy copies them to the weights
            EmbeddingNorms(norm_vectors, self.ownership).install(self.optimizer)
        if hasattr(self.optimizer, "attach_ownership"):  # sums its statistics over the shards
            self.optimizer.attach_ownership(self.ownership)
        self.ema = build_ema(config, self.ownership)
        self.scheduler = build_scheduler(config, self.optimizer, self.plan)
        self.precision = self.strategy.precision
        self.params = [p for g in self.groups for p in g.params]
        self.adaptive = config.optimizer.adaptive
        self.utilization = None  # MFU per log window: where it is tracked and the device's peak FLOP/s is known
        if config.mlflow.enabled and self.runtime.is_main:
            self.utilization = UtilizationMeter(self.device, config.train_dtype, config.gradient_checkpointing, self.log,
                                                root=self.model.denoiser)
        self.checkpointer = Checkpointer(self)
        self.position = Position()
        folder = self.run.resume_from
        if folder is not None:
            self.position = self.checkpointer.load(folder)
            self.tracking_run_id = self.tracking_run_id or self.position.tracking_run_id
            if config.mlflow.enabled and self.position.tracking_run_id is None:
                self.log("checkpoint: the MLflow run did not exist yet when it was saved; this run is tracked as a new one")
        elif resume == "auto":
            self.log(f"checkpoint: none committed in {checkpoints_dir(config.output_dir)}, starting from step 0")
        # after loading: a checkpoint's optimizer group settings (fused or not) decide too
        self.lagged_guard, self.guard_line = choose_lagged(config, self.strategy, self.optimizer)
        self.guard: StepGuard | None = None  # made by train()
        self.replicas_checked_at: int | None = None  # the step whose replicas were last compared
        freeze_long_lived_objects()  # the libraries and the model are in memory: collections skip them from now on

    def _place_modules(self, strategy_places: bool = False) -> None:
        """Trainable parameters are stored in trained_weight_dtype (float32 master weights by default), each
        component's frozen ones in its storage (store_component); then the low-memory options place each component.
        `strategy_places`: the components that train stay in CPU memory for the strategy to place as it shards them."""
        denoiser, performance = self.model.denoiser, self.config.performance
        # Stable Cascade's decoder stages stay on the device: their pipeline creates its noise where they are.
        family = self.model.family
        resident = [denoiser, *([] if family.sampling_modules_offloadable else self.model.sampling_modules())]
        for name, module in self.model.named_components():
            trains = store_component(module, name, self.config, denoiser=module is denoiser)
            # The denoiser backpropagates whenever anything trains (text encoders learn through it).
            if self.config.gradient_checkpointing and (trains or module is denoiser):
                if not (module is denoiser and performance.selective_checkpointing):  # that one: _apply_performance
                    enable_gradient_checkpointing(module, self.config.activation_offloading and module is denoiser)
            # With cached text a frozen text encoder runs once, over the captions (and for samples): it stays in
            # CPU memory and is streamed to the device for those passes, so a T5-XXL never occupies it.
            cached_text = self.config.data.cache_text and any(module is e for e in self.model.text_encoders.values())
            place_component(module, self.config, self.device, offloadable=not any(module is m for m in resident),
                            prefer_cpu=cached_text, streamed=self._streamed_blocks() if module is denoiser else (),
                            strategy_places=strategy_places)

    def _streamed_blocks(self) -> list[torch.nn.Module]:
        """The denoiser's blocks whose frozen weights stay in CPU memory (`<denoiser>.offload_fraction`)."""
        blocks = denoiser_streamed_blocks(self.model, self.config)
        if blocks:
            name = self.model.family.denoiser
            trained = self.config.streams_trained_weights()
            streamed_bytes = sum(streamed_bytes_of(b, trained) for b in blocks)
            self.log(f"{name}.offload_fraction {getattr(self.config, name).offload_fraction}: {len(blocks)} blocks' "
                     f"{'' if trained else 'frozen '}weights ({streamed_bytes / 2**30:.2f} GiB) stay in CPU memory, "
                     f"each copied in for its forward{' and stepped in backward' if trained else ''}")
        return blocks

    def _apply_performance(self) -> None:
        """Selective checkpointing, float8 matmuls, channels_last and regional compilation of the denoiser."""
        performance = self.config.performance
        if self.config.gradient_checkpointing and performance.selective_checkpointing:
            chosen = selective_checkpointing(self.model, performance, self.config.activation_offloading)
            self.log(f"gradient checkpointing: {len(chosen)} denoiser modules recompute in backward")
        # float8 matmuls under fsdp wrap each trained Linear weight in a new Parameter (torchao's float8 all-gather
        # tensor): the groups follow the weights by name, as after a strategy's wrap
        parts = trained_modules(self.model)
        named = named_groups(parts, self.groups)
        apply_performance(self.model, performance, self.device, self.config.strategy, self.log,
                          shard_ranks=self.strategy.shard_ranks())
        self.groups = grouped(parts, named)

    def _wrap(self) -> None:
        """The strategy's wrap, given the groups by name: the trainer holds none of the parameters the wrap replaces
        meanwhile (under fsdp each one held would keep its whole unit's copy on the device until the wrap ends)."""
        named = named_groups(trained_modules(self.model), self.groups)
        self.groups = []
        self.groups = self.strategy.wrap(self.model, named)

    def _update_part_activity(self, epoch: int, step: int) -> None:
        """Honour `<part>.stop_training_after` (and an additional embedding's): a stopped group no longer gets
        gradients or updates."""
        for group in self.groups:
            part = self.config.stop_rule(group.name)
            if part is None:
                continue
            if part.stopped(epoch, step) and group.params[0].requires_grad:
                for p in group.params:
                    p.requires_grad_(False)
                    p.grad = None
                self.log(f"{group.name}: stopped training after {part.stop_training_after} {part.stop_training_after_unit}s")

    def train(self) -> TrainResult:
        try:
            result = self._train()
        except BaseException as err:
            # First: the other ranks may wait for this one in a collective (NCCL would wait distributed.timeout_minutes)
            announce_failure(exit_code_of(err))
            self.tracker.close_failed()  # now, not at the interpreter's exit (a notebook, a library caller)
            if isinstance(err, KeyboardInterrupt):
                # a second Ctrl-C interrupts at once; a checkpoint being written stays uncommitted, the last holds
                raise
            self._commit_written_checkpoint()
            release_output_dir(self.config.output_dir)
            raise
        self.checkpointer.wait()  # a checkpoint written in the background is committed before training returns
        release_output_dir(self.config.output_dir)  # the run is over: another may start in its folder
        return result

    def _commit_written_checkpoint(self) -> None:
        """Training failed: a checkpoint written in the background still commits (its ranks are past the step it
        holds), unless its own write failed too, which is only logged under the error that stopped training."""
        try:
            self.checkpointer.wait()
        except Exception as err:  # noqa: BLE001
            self.log(f"error: {err}")

    def _train(self) -> TrainResult:
        config = self.config
        accumulation = config.gradient_accumulation_steps
        self.log(
            f"training {config.method} on {config.model.family}: {self.plan.dataset_size} images/epoch, "
            f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps, strategy {self.strategy.name}, global batch "
            f"{self.global_batch} (batch_size {config.batch_size} x accumulation {accumulation} x "
            f"{self.runtime.world_size} processes)"
        )
        for warning in startup_warnings(config):
            self.log(f"warning: {warning}")
        self.log(self.guard_line)
        lows: set[int] = set()
        if config.scheduler.snapshot_at_cycle_lows or config.checkpoint.at_cycle_lows:
            lows = set(cycle_lows(config.scheduler, self.total_steps, accumulation)) - {self.total_steps}  # the end exports
        snapshots = lows if config.scheduler.snapshot_at_cycle_lows else set()
        checkpoint_lows = lows if config.checkpoint.at_cycle_lows else set()
        result = TrainResult(first_step=self.position.step)
        step = self.position.step
        self._check_replicas(step, starting=True)  # before any work: the ranks loaded the same weights
        self.tracker = start_tracking(config, self.runtime.is_main, self.runtime.world_size,
                                      self.tracking_run_id, self.tracking_step_offset, self.log, self.tracking_sender,
                                      resumed_at_step=self.position.step if self.position.resumed_from else None)
        self.tracker.log_text("\n".join(self.bucket_report) + "\n", "bucket_report.txt")
        if self.run.abandoned is not None:  # resumed into the same MLflow run, which keeps the abandoned steps' points
            self.tracker.set_tags({"ot_dist.rewound": f"to step {step}, the later history moved to {self.run.abandoned}; "
                                   "metric points after that step are logged again (MLflow keeps both)"})
        progress = Progress(self.total_steps, config.epochs, self.log, enabled=self.runtime.is_main, first_step=step)
        window = StepWindow()  # step values not yet copied to the host
        if step == 0:
            with window.paused():
                self.validation.maybe_run(self, step)
        every, epoch = config.checkpoint, self.position.epoch
        with StopSignals(every.on_signal) as signals:
            guard = (LaggedStepGuard if self.lagged_guard else StepGuard)(
                self.runtime, signals, every.every_n_minutes, lambda: self.checkpointer.last_save_time)
            self.guard = guard
            for epoch in range(self.position.epoch, config.epochs):
                if step >= self.total_steps or result.stopped_by:
                    break
                self._update_part_activity(epoch, step)
                done_in_epoch = self.reader.resume_position(epoch)  # global batches a resumed epoch skips
                batches = self.epoch_batches(epoch)
                micro_losses = []
                for micro, batch in enumerate(batches, start=done_in_epoch * accumulation):
                    if micro >= self.steps_per_epoch * accumulation:
                        break  # the incomplete accumulation at the end of an epoch is dropped
                    last_micro_step = len(micro_losses) + 1 == accumulation
                    for noise in self.rounding_noises:  # the fused back pass steps inside a micro step's backward
                        noise.at_step(step)
                    micro_losses.append(self.micro_step(batch, epoch, accumulation, last_micro_step))
                    if not last_micro_step:
                        continue
                    loss = torch.stack(micro_losses).mean()
                    micro_losses = []
                    # blocking guard: this step's verdict; lagged: the previous step's (stop / save act after this
                    # step, one step later; a non-finite previous step was already skipped on the device)
                    verdict = guard.check(loss)
                    if verdict.nonfinite and guard.lagged:
                        self._skipped_on_device(result, step, epoch)
                    elif verdict.nonfinite:
                        if every.on_nonfinite_loss == "skip_step":
                            self.strategy.drop_gradients(self.optimizer, self.params)
                            result.skipped_steps += 1
                            self.log(f"warning: non-finite loss at step {step + 1}: step skipped ({result.skipped_steps} so far)")
                            continue
                        self._halt_on_nonfinite(step, epoch)
                    with skipping_on_device(self.optimizer, guard.skip_flag()):
                        rates, grad_norm = self.optimizer_step(step)
                    step += 1
                    window.add(StepRecord(step, epoch, loss, grad_norm, rates))
                    progress.step(step)
                    if step % config.log_every_steps == 0 or step == self.total_steps:
                        self._take_window(result, self._log_window(window, progress))
                    with window.paused():  # not training: out of the window's samples_per_s and mfu
                        if step in snapshots:
                            self.export(Path(config.output_dir) / "snapshots" / f"step-{step}")
                        self.sampler.after_step(self, step)
                        self.validation.maybe_run(self, step)
                        if verdict.stop:
                            result.stopped_by = signals.received or "a signal on another rank"
                            result.checkpoint = self._save(step, epoch, f"stop requested by {result.stopped_by}")
                            break
                        reason = ("step interval" if every.every_n_steps and step % every.every_n_steps == 0
                                  else "cycle low" if step in checkpoint_lows else "time interval" if verdict.save_due
                                  else None)
                        if reason:
                            result.checkpoint = self._save(step, epoch, reason)
                    self._update_part_activity(epoch, step)
                    if step >= self.total_steps:
                        break
                if every.every_n_epochs and (epoch + 1) % every.every_n_epochs == 0 and not result.stopped_by:
                    with window.paused():
                        result.checkpoint = self._save(step, epoch, "epoch end")
            last = guard.settle()  # the lagged guard: the last step's verdict, before the end's saves and exports
            if last is not None and last.nonfinite:
                self._skipped_on_device(result, step, epoch)
        self._take_window(result, self._log_window(window, progress))
        progress.close()
        result.steps = step
        if result.stopped_by:
            self.log(f"stopped by {result.stopped_by} after step {step}; resume with --resume auto "
                     f"(or --resume {result.checkpoint})")
        else:
            self.sampler.at_end(self, step)
            if step == self.total_steps:
                self.validation.maybe_run(self, step)
            if every.at_end:
                result.checkpoint = self._save(step, epoch, "end of training")
            self._check_replicas(step)
            result.exported = self.export(Path(config.output_dir))
            self.tracker.set_tags({"exported": " ".join(str(p) for p in result.exported)})
            self.tracker.log_text("".join(f"{p}\n" for p in result.exported), "exported_paths.txt")
        # MLflow's statuses: a run a signal stopped (preemption, Ctrl-C) was killed, not finished; its resume
        # continues the same run
        for warning in self.tracker.close("KILLED" if result.stopped_by else "FINISHED"):
            self.log(f"warning: {warning}")
        return result

    def close(self) -> None:
        """Release the strategy's communication state while the interpreter is fully alive (see Strategy.close);
        the trainer is not used for training afterwards."""
        self.strategy.close()
        gc.collect()

    def _save(self, step: int, epoch: int, reason: str) -> Path:
        """A checkpoint of the state after `step` optimizer steps (once per step, whatever asked for it)."""
        if self.checkpointer.last_saved_step == step:
            return self.checkpointer.folder_of(step)
        self._check_replicas(step)
        return self.checkpointer.save(step, epoch, reason)

    def _check_replicas(self, step: int, starting: bool = False) -> None:
        """Say so where the ranks' copies of the trained weights differ (ddp: only rank 0's are saved and exported).
        Before the first step (`starting`: different weights loaded, an error before any work), at checkpoints and
        before the exports (a drift: a warning, training goes on), once per step."""
        if self.replicas_checked_at == step:
            return
        self.replicas_checked_at = step
        apart = self.strategy.diverged_replicas()
        if not apart:
            return
        examples = "; ".join(f"{name} (rank {', '.join(map(str, ranks))})" for name, ranks in list(apart.items())[:3])
        if starting:
            raise InputFileError(
                f"the ranks start from different trained weights ({len(apart)} tensors differ from rank 0's: "
                f"{examples}): every rank must load the same model (model.path) and checkpoint; on several nodes, "
                "check that each node reads the same files")
        message = (f"the ranks' copies of {len(apart)} trained tensors differ after step {step} ({examples}): the "
                   "replicas diverged, and checkpoints and exports hold rank 0's. Each rank applies the same update to "
                   "the same weights; please report this with the config")
        self.log(f"warning: {message}")
        self.tracker.set_tags({"ot_dist.replicas_diverged": message})

    def _skipped_on_device(self, result: TrainResult, step: int, epoch: int) -> None:
        """The lagged guard found step `step`'s loss non-finite: the optimizer skipped that update on the device (the
        step still counts: the schedule and the EMA moved on, the weights and moments did not). Count and warn, or
        with on_nonfinite_loss: stop, save the weights (those from before that step) and stop."""
        result.skipped_steps += 1
        if self.config.checkpoint.on_nonfinite_loss == "stop":
            self._halt_on_nonfinite(step, epoch, bad_step=step)
        self.log(f"warning: non-finite loss at step {step}: not applied, skipped on the device "
                 f"({result.skipped_steps} so far)")

    def _halt_on_nonfinite(self, step: int, epoch: int, bad_step: int | None = None) -> None:
        """The weights are still those after `step` steps (blocking guard: the bad step is step + 1, not taken; lagged
        guard: it is `bad_step`, counted but skipped on the device): keep them in a checkpoint and stop. The data
        position is past the bad batch, so a resume (with a lower learning rate, say) goes on after it."""
        self.optimizer.zero_grad(set_to_none=True)
        path = self._save(step, epoch, "non-finite loss")
        for warning in self.tracker.close("FAILED"):  # training stops with an error (exit code 4)
            self.log(f"warning: {warning}")
        if bad_step is None:
            applied = f"that step was not applied and the weights after step {step} are saved in {path}"
        else:
            applied = (f"that step was skipped on the device (it counts as done) and the weights from before it are "
                       f"saved in {path} (step {step})")
        raise TrainingHalted(
            f"the loss of step {bad_step or step + 1} is NaN or infinite on at least one rank; {applied}. Lower the "
            "learning rate (or set checkpoint.on_nonfinite_loss: skip_step) and resume with --resume auto"
        )

    def averaged_weights(self):
        """A block in which the parameters hold the weights training produces, for samples, exports and
        checkpoints: a schedule-free optimizer's average instead of the point it takes gradients at."""
        return averaged_weights(self.optimizer, SPECS[self.config.optimizer.name].schedule_free)

    def export(self, output_dir: Path) -> list[Path]:
        with self.averaged_weights():
            return self._export(output_dir)

    def _export(self, output_dir: Path) -> list[Path]:
        write = self.runtime.is_main
        created = self.run.started_at  # the files' ModelSpec date: the run's, also in its checkpoints
        # The others wait while the main process writes (a full finetune's files, its frozen parts read again): on
        # slow storage longer than the process group's timeout, so in a group that waits as long as a write may.
        waiting = self.runtime.waiting_group(EXPORT_WAIT_S)
        error = None
        try:
            # Every rank takes part in each gathering; only the writing one keeps what it gathers, in CPU memory.
            exported = self.method.export(self.model, output_dir, self.trained_state_dict_of(here=write), write=write,
                                          created=created)
            if self.ema:
                exported += self.method.export(self.model, output_dir, self.ema_state_dict_of(here=write),
                                               write=write, suffix="_ema", created=created)
        except Exception as err:  # noqa: BLE001 - every rank hears of it below, then it is raised
            error = err
        # nobody leaves before the export is on disk
        self.runtime.fail_together(error, waiting, f"the export to {output_dir}")
        for path in exported:
            self.log(f"exported {path}")
        return exported

    def trained_state_dict_of(self, here: bool = True, host: bool = True, convert: Convert | None = None):
        """A `state_dict_of` for the exports of the trained weights. When the modules compute in half precision
        over float32 masters (DeepSpeed bf16 / fp16), the masters are exported, not their rounded copies. `here`,
        `host` and `convert`: what the strategy's `state_dict_of` takes (whether this rank keeps the gathered tensors;
        in CPU memory or on the device; what it makes of each gathered tensor as it arrives)."""
        if all(p.dtype == torch.float32 for p in self.params) or not all(
                o.local().dtype == torch.float32 for o in self.ownership.owned):
            return functools.partial(self.strategy.state_dict_of, here=here, host=host, convert=convert)
        return self.overlaid_state_dict_of(self.ownership, [o.local() for o in self.ownership.owned], here, host,
                                           convert)

    def ema_state_dict_of(self, here: bool = True, host: bool = True, convert: Convert | None = None):
        return self.overlaid_state_dict_of(self.ema.ownership, self.ema.values, here, host, convert)

    def overlaid_state_dict_of(self, ownership: Ownership, values: list[torch.Tensor], here: bool = True,
                               host: bool = True, convert: Convert | None = None):
        """A `state_dict_of` for the exports: the full weights, the trained parameters taken from `values` (per-rank
        tensors shaped like `ownership.owned`: the EMA's averages or the float32 masters) instead of the modules.
        Each of those is made whole when its module is asked for, one at a time (a collective when sharded: every
        rank asks for the same modules in the same order), converted (`convert`: each is a fresh tensor, also in one
        process) and moved to CPU memory (`host`) by the rank that keeps the result (`here`) before the next; the
        strategy gathers the rest the same way. So no rank holds the whole EMA or the whole set of masters on the
        device, and only the keeping rank holds them at all."""
        gather = ownership.gatherer(values)
        part_of = {id(module): part for part, module in self.strategy.trained_modules.items()}

        def state_dict_of(module, keep=None):
            part = part_of.get(id(module))
            if part is None:
                return self.strategy.state_dict_of(module, keep, here=here, host=host, convert=convert)
            # the order of the state dict: no gathering, no stored weight that `keep` drops dequantized
            keys = list(kept_state_dict(module, keep))
            overlaid = {k for k in keys if f"{part}.{k}" in ownership.shapes}
            rest = set(keys) - overlaid
            state = self.strategy.state_dict_of(module, rest.__contains__, here=here, host=host, convert=convert)
            full = {}
            for key in keys:
                if key not in overlaid:
                    if here:
                        full[key] = state.pop(key)
                    continue
                # Kept in their own (float32) dtype: the module may hold half-precision copies; the export casts to
                # output_dtype itself.
                whole = gather(f"{part}.{key}")
                if here:
                    whole = whole if convert is None else convert(key, whole)
                    full[key] = to_host(whole) if host else whole
                del whole  # gone before the next one is gathered
            return full

        return state_dict_of

    def tokenize(self, batch: dict) -> dict:
        """Add `token_ids` to a batch: part of preparing data, not of the training step."""
        if any(k.startswith("text_") for k in batch):  # cached text-encoder outputs (data.cache_text)
            return batch
        captions = [self.method.caption(c) for c in batch["caption"]]
        batch["token_ids"] = self.model.family.tokenize_batch(self.model, captions, batch)
        return batch

    def epoch_batches(self, epoch: int):
        for batch in self.reader.epoch_batches(epoch):
            yield self.tokenize(batch)

    def micro_step(self, batch: dict, epoch: int, accumulation: int, last_micro_step: bool = True) -> torch.Tensor:
        self.strategy.prepare_micro_step(last_micro_step)
        begin_step(self.config.performance)

        def forward_backward() -> torch.Tensor:
            with attention_kernel(self.config.performance, self.device, self.model.family.attention_kernels_avoided):
                # backward too: it may recompute attention
                with self.strategy.autocast():
                    loss = self.loss(batch, epoch)
                self.strategy.backward(loss * self.loss_scale if self.loss_scale != 1 else loss, accumulation,
                                       last_micro_step)
            return loss.detach()  # logged before loss.scaler

        return self.utilization.micro_step(batch, forward_backward) if self.utilization else forward_backward()

    def loss(self, batch: dict, epoch: int) -> torch.Tensor:
        return diffusion_loss(self.model, batch, self.config.seed, epoch, self.config.loss, self.config.masked_training)

    def optimizer_step(self, step: int) -> tuple[dict[str, float], torch.Tensor | None]:
        """Step `step` (0-based). Returns the learning rates this step applied (lr/<group>, and d_lr/<group>
        for adaptive optimizers: the d x lr the step used) and the gradient norm before clipping."""
        rates = applied_learning_rates(self.optimizer)  # the scheduler moves them right after the step
        for group in self.groups:  # a stopped part takes no step: it applies nothing, whatever its group's lr
            if not group.params[0].requires_grad:
                rates.update({key: 0.0 for key in (f"lr/{group.name}", f"d_lr/{group.name}") if key in rates})
        grad_norm = self.strategy.step(self.optimizer, self.params)  # sync, clip, step, zero grads
        self.scheduler.step()
        if self.ema:
            self.ema.update(step)
        return rates, grad_norm

    def _take_window(self, result: TrainResult, steps: list) -> None:
        """The pulled steps' losses (and d x lr per group for adaptive optimizers) into the result."""
        result.losses.extend(s.metrics["loss"] for s in steps)
        if self.config.train_dtype == "float16":
            self._report_overflows(result, steps)
        if self.adaptive:
            result.d_lr.extend({k[len("d_lr/"):]: v for k, v in s.metrics.items() if k.startswith("d_lr/")} for s in steps)

    def _report_overflows(self, result: TrainResult, steps: list) -> None:
        """float16: a step whose gradient norm is not finite while its loss is was not applied: the loss scaler found
        its gradients overflowing (GradScaler, and DeepSpeed's fp16 engine, which reports an inf norm for it). Said
        here, where the norms reach the host anyway; a non-finite loss is the step guard's to report."""
        for s in steps:
            norm = s.metrics.get("grad_norm")
            if norm is not None and not math.isfinite(norm) and math.isfinite(s.metrics["loss"]):
                result.overflowed_steps.append(s.step)
                self.log(f"warning: float16 gradients overflowed at step {s.step}: the loss scaler did not apply that "
                         f"update ({len(result.overflowed_steps)} so far)")

    def _log_window(self, window: StepWindow, progress: Progress) -> list:
        """Copy the window's step values to the host (one sync), track them, show progress; the pulled steps."""
        steps, seconds = window.pull(self.runtime.mean)
        if not steps:
            return []
        samples_per_s = len(steps) * self.global_batch / seconds
        for s in steps:
            self.tracker.log_metrics(s.metrics, s.step, s.wall_time)
        last = steps[-1]
        utilization = self.utilization.take(seconds) if self.utilization else {}
        self.tracker.log_metrics({"samples_per_s": samples_per_s, **utilization, **memory_metrics(self.device)},
                                 last.step, last.wall_time)
        progress.window(last.step, last.epoch, window_mean_loss(steps), last.metrics, samples_per_s)
        for notice in self.tracker.take_notices():
            progress.write(f"warning: {notice}")
        return steps


def build_ema(config: TrainConfig, ownership) -> ShardedEMA | None:
    if not config.ema.enabled:
        return None
    device = torch.device("cpu") if config.ema.device == "cpu" else None
    return ShardedEMA(ownership, config.ema.decay, config.ema.update_step_interval, device)


def train(config: TrainConfig, log=print, resume: str | None = None, overwrite: bool = False) -> TrainResult:
    # A refused construction ends the group the Trainer started itself (Trainer.__init__); a finished or failed run
    # ends it here.
    trainer = Trainer(config, log=log, resume=resume, overwrite=overwrite)
    try:
        return trainer.train()
    finally:
        trainer.close()
        trainer.runtime.shutdown()
