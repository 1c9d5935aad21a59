"""The `optimizer` and `scheduler` sections of the config, and the checks that involve the rest of the
config (parameter groups, accumulation, clipping, dtype, strategy).

An optimizer option left unset (null) takes that optimizer's default (OneTrainer's, listed in
ot_dist/optim/registry.py and in configs/REFERENCE.md); after validation every option the chosen
optimizer takes is filled in and every other one is null, so a resolved config reads as what runs.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from ot_dist.config.section import Section
from ot_dist.optim.registry import ADAPTIVE, NOT_AVAILABLE, OPTIMIZER_NAMES, QUANT_BLOCK_SIZES, SPECS, takers

SCHEDULER_NAMES = (
    "CONSTANT", "LINEAR", "COSINE", "COSINE_WITH_RESTARTS", "COSINE_WITH_HARD_RESTARTS", "REX",
    "REX_WITH_RESTARTS", "ADAFACTOR", "CUSTOM",
)
CYCLIC = ("COSINE_WITH_RESTARTS", "COSINE_WITH_HARD_RESTARTS", "REX_WITH_RESTARTS")
DECAYING = ("LINEAR", "COSINE", "REX") + CYCLIC  # the ones min_factor applies to
PLACEHOLDERS = ("%LR%", "%EPOCHS%", "%STEPS_PER_EPOCH%", "%TOTAL_STEPS%", "%SCHEDULER_STEPS%")
# CUSTOM classes from these modules load without opting in; anything else is the user's code.
ALLOWED_SCHEDULER_MODULES = ("torch.optim.lr_scheduler", "ot_dist")
SHARDING = ("fsdp", "zero1", "zero2", "zero3")


def _by(option: str) -> str:
    return f" Taken by: {', '.join(takers(option))}."


class OptimizerConfig(Section):
    """The optimizer and its options. Only the options the chosen optimizer takes may be set; unset ones
    take its default (the table under "Optimizers" below lists both)."""

    name: Literal[OPTIMIZER_NAMES] = Field(default="ADAMW", description="Optimizer (OneTrainer's names).")
    alpha: float | None = Field(
        default=None, ge=0,
        description=(
            "Smoothing constant of the squared-gradient average (RMSprop); AdEMAMix: weight of the slow average."
            + _by("alpha")
        ),
    )
    amsgrad: bool | None = Field(default=None, description="Use the AMSGrad variant." + _by("amsgrad"))
    beta1: float | None = Field(
        default=None, ge=0, lt=1,
        description=(
            "First-moment decay (Lion: update interpolation). Adafactor: null = no first moment (saves memory)."
            + _by("beta1")
        ),
    )
    beta2: float | None = Field(
        default=None, ge=0, lt=1,
        description=(
            "Second-moment decay (Lion: momentum decay)."
            + _by("beta2")
        ),
    )
    beta3: float | None = Field(
        default=None, ge=0, lt=1,
        description=(
            "Prodigy: decay of its step-size estimate, null = sqrt(beta2). DADAPT_ADAN: third beta. AdEMAMix: decay "
            "of the slow average. CAME: decay of the confidence."
            + _by("beta3")
        ),
    )
    capturable: bool | None = Field(
        default=None,
        description=(
            "torch: keep the step count on the device (CUDA graphs)."
            + _by("capturable")
        ),
    )
    centered: bool | None = Field(
        default=None,
        description=(
            "Centered RMSprop (normalise by the gradient variance)."
            + _by("centered")
        ),
    )
    clip_threshold: float | None = Field(
        default=None, gt=0,
        description=(
            "Adafactor: clip the update's root mean square at this value."
            + _by("clip_threshold")
        ),
    )
    d0: float | None = Field(default=None, gt=0, description="Initial estimate of the step size d." + _by("d0"))
    d_coef: float | None = Field(
        default=None, gt=0,
        description=(
            "Prodigy: multiplier on the d estimate; the preferred knob (0.5 slower, 2 faster)."
            + _by("d_coef")
        ),
    )
    dampening: float | None = Field(default=None, ge=0, description="Momentum dampening." + _by("dampening"))
    decay_rate: float | None = Field(
        default=None,
        description=(
            "Adafactor: exponent of the second-moment decay schedule."
            + _by("decay_rate")
        ),
    )
    decouple: bool | None = Field(default=None, description="AdamW-style decoupled weight decay." + _by("decouple"))
    differentiable: bool | None = Field(
        default=None,
        description=(
            "torch: let autograd see through the step (meta-learning)."
            + _by("differentiable")
        ),
    )
    eps: float | None = Field(
        default=None, ge=0,
        description=(
            "Denominator epsilon (Adafactor, CAME: of the squared gradient)."
            + _by("eps")
        ),
    )
    eps2: float | None = Field(
        default=None, ge=0,
        description=(
            "Adafactor: epsilon of the parameter scale. CAME: epsilon of the confidence."
            + _by("eps2")
        ),
    )
    foreach: bool | None = Field(
        default=None,
        description=(
            "Multi-tensor step (few large kernels). Default true unless fused (schedule-free: false, OneTrainer's)."
            + _by("foreach")
        ),
    )
    fsdp_in_use: bool | None = Field(
        default=None,
        description=(
            "Parameters are sharded: sum the step-size statistics across ranks. Set from the strategy (true under "
            "fsdp and zero1/2/3); leave it unset."
            + _by("fsdp_in_use")
        ),
    )
    fused: bool | None = Field(
        default=None,
        description=(
            "torch: fused single-kernel step (CUDA, and CPU for some). Unset: chosen for ADAM, ADAMW and SGD when every "
            "trained parameter is a floating CUDA tensor (foreach otherwise); false keeps foreach."
            + _by("fused")
        ),
    )
    fused_back_pass: bool | None = Field(
        default=None,
        description=(
            "Step each parameter inside the backward pass as soon as its gradient is ready and free the gradient:"
            " gradients never all exist at once (with gradient accumulation they accumulate over the micro steps as "
            "usual and are stepped in the last one's backward: no memory saved). Clipping: clip_grad_norm_scope "
            "per_tensor (a global norm needs every gradient) or none. Needs a train_dtype other than float16 (loss "
            "scaling must see every gradient before any step) and strategy single or ddp (under ddp each gradient is "
            "averaged over the ranks inside backward too, ddp.fused_reduce_buffer_mb)."
            + _by("fused_back_pass")
        ),
    )
    growth_rate: float | None = Field(
        default=None, gt=0,
        description=(
            "Cap on the growth of d per step (inf = none; ~1.02 acts like a warmup)."
            + _by("growth_rate")
        ),
    )
    initial_accumulator_value: float | None = Field(
        default=None, ge=0,
        description=(
            "Adagrad: initial value of the accumulator."
            + _by("initial_accumulator_value")
        ),
    )
    is_paged: bool | None = Field(
        default=None,
        description=(
            "bitsandbytes: page optimizer state to CPU memory when the GPU runs out."
            + _by("is_paged")
        ),
    )
    log_every: int | None = Field(
        default=None, ge=0,
        description=(
            "D-Adaptation: log its estimates every N steps (0 = never)."
            + _by("log_every")
        ),
    )
    lr_decay: float | None = Field(default=None, ge=0, description="Adagrad: learning-rate decay." + _by("lr_decay"))
    max_unorm: float | None = Field(
        default=None, ge=0,
        description=(
            "Cap on the update norm relative to the weight norm (trust ratio)."
            + _by("max_unorm")
        ),
    )
    maximize: bool | None = Field(default=None, description="torch: maximise the objective instead." + _by("maximize"))
    min_8bit_size: int | None = Field(
        default=None, ge=1,
        description=(
            "bitsandbytes: tensors with fewer elements keep 32-bit state (CAME_8BIT: weight matrices with at most this "
            "many elements keep a 32-bit first moment, as in OneTrainer)."
            + _by("min_8bit_size")
        ),
    )
    momentum: float | None = Field(default=None, ge=0, lt=1, description="Momentum factor." + _by("momentum"))
    nesterov: bool | None = Field(default=None, description="Nesterov momentum." + _by("nesterov"))
    no_prox: bool | None = Field(
        default=None,
        description=(
            "DADAPT_ADAN: plain instead of proximal weight decay."
            + _by("no_prox")
        ),
    )
    quant_block_size: int | None = Field(
        default=None,
        description=(
            "CAME_8BIT: elements per 8-bit block, each with its own scale (bitsandbytes' block sizes: 64, 128, 256, "
            "512, 1024, 2048, 4096)."
            + _by("quant_block_size")
        ),
    )
    relative_step: bool | None = Field(
        default=None,
        description=(
            "Adafactor: compute a time-dependent step size and ignore learning rates (use scheduler ADAFACTOR). "
            "false (the default, OneTrainer's, with scale_parameter false) = AdamW-like mode with your learning "
            "rate and schedule."
            + _by("relative_step")
        ),
    )
    safeguard_warmup: bool | None = Field(
        default=None,
        description=(
            "Prodigy: leave lr out of the d estimate's denominator (safer with warmup)."
            + _by("safeguard_warmup")
        ),
    )
    scale_parameter: bool | None = Field(
        default=None,
        description=(
            "Adafactor: scale the step by the parameter's root mean square."
            + _by("scale_parameter")
        ),
    )
    slice_p: int | None = Field(
        default=None, ge=1,
        description=(
            "Prodigy: estimate d from every p-th element only (less memory; ~11 is reasonable)."
            + _by("slice_p")
        ),
    )
    stochastic_rounding: bool | None = Field(
        default=None,
        description=(
            "Round bfloat16 weights stochastically after each update, so updates smaller than bfloat16's "
            "resolution still count on average. Acts on trained weights stored in bfloat16 "
            "(trained_weight_dtype: bfloat16); float32 weights are left alone. All optimizers (the *_ADV: adv_optm's own "
            "rounding, which keeps their state in bfloat16 too)."
        ),
    )
    use_bias_correction: bool | None = Field(
        default=None,
        description=(
            "Adam-style bias correction of the moments (Prodigy: acts more like Adam)."
            + _by("use_bias_correction")
        ),
    )
    warmup_init: bool | None = Field(
        default=None,
        description=(
            "Adafactor: warm the relative step up from 1e-6 x step (needs relative_step)."
            + _by("warmup_init")
        ),
    )
    weight_decay: float | None = Field(default=None, ge=0, description="Weight decay." + _by("weight_decay"))

    # -- options of the optimizers OneTrainer added from other packages (their OneTrainer names) ---------
    cautious: bool | None = Field(
        default=None, description="ADOPT: cautious update (skip the components whose sign disagrees with the gradient)."
        + _by("cautious"),
    )
    decoupled_decay: bool | None = Field(
        default=None, description="AdamW-style decoupled weight decay (pytorch-optimizer's weight_decouple)."
        + _by("decoupled_decay"),
    )
    fixed_decay: bool | None = Field(
        default=None, description="Decoupled weight decay not scaled by the learning rate." + _by("fixed_decay"),
    )
    rectify: bool | None = Field(default=None, description="AdaBelief: RAdam's rectification." + _by("rectify"))
    degenerated_to_sgd: bool | None = Field(
        default=None, description="AdaBelief with rectify: SGD steps while the variance is not yet tractable."
        + _by("degenerated_to_sgd"),
    )
    initial_accumulator: float | None = Field(
        default=None, ge=0, description="Yogi: initial value of both moments." + _by("initial_accumulator"),
    )
    r: float | None = Field(
        default=None, ge=0, description="Schedule-free: the averaging weight grows like step^r." + _by("r"),
    )
    weight_lr_power: float | None = Field(
        default=None, ge=0,
        description="Schedule-free: the averaging weight grows like lr_max^weight_lr_power." + _by("weight_lr_power"),
    )
    muon_adam_lr: float | None = Field(
        default=None, gt=0,
        description="MUON: learning rate of the AdamW step of the parameters that are not matrices (biases, norms)."
        + _by("muon_adam_lr"),
    )
    weight_decay_by_lr: bool | None = Field(
        default=None, description="Prodigy+SF: scale weight decay by the learning rate." + _by("weight_decay_by_lr"),
    )
    prodigy_steps: int | None = Field(
        default=None, ge=0, description="Prodigy+SF, PRODIGY_ADV: stop adapting d after this many steps (0 = never)."
        + _by("prodigy_steps"),
    )
    use_speed: bool | None = Field(default=None, description="Prodigy+SF: the SPEED d estimate." + _by("use_speed"))
    split_groups: bool | None = Field(
        default=None, description="Prodigy+SF: one d per parameter group." + _by("split_groups"),
    )
    split_groups_mean: bool | None = Field(
        default=None, description="Prodigy+SF: with split_groups, use the mean of the groups' d." + _by("split_groups_mean"),
    )
    factored: bool | None = Field(
        default=None, description="Prodigy+SF: Adafactor-style factored second moment (less memory)." + _by("factored"),
    )
    factored_fp32: bool | None = Field(
        default=None, description="Prodigy+SF: keep the factored statistics in float32." + _by("factored_fp32"),
    )
    use_stableadamw: bool | None = Field(
        default=None, description="Prodigy+SF: StableAdamW update clipping." + _by("use_stableadamw"),
    )
    use_cautious: bool | None = Field(default=None, description="Prodigy+SF: cautious update." + _by("use_cautious"))
    use_grams: bool | None = Field(default=None, description="Prodigy+SF: Grams update direction." + _by("use_grams"))
    use_adopt: bool | None = Field(default=None, description="Prodigy+SF: ADOPT-style update." + _by("use_adopt"))
    d_limiter: bool | None = Field(
        default=None, description="Prodigy+SF, PRODIGY_ADV: limit how fast d grows." + _by("d_limiter"),
    )
    use_schedulefree: bool | None = Field(
        default=None, description="Prodigy+SF: schedule-free averaging (false: plain Prodigy-like momentum)."
        + _by("use_schedulefree"),
    )
    schedulefree_c: float | None = Field(
        default=None, ge=0, description="Prodigy+SF: schedule-free averaging constant (0 = the paper's)."
        + _by("schedulefree_c"),
    )
    use_orthograd: bool | None = Field(
        default=None, description="Prodigy+SF: OrthoGrad (drop the gradient's component along the weights)."
        + _by("use_orthograd"),
    )

    # -- AIDA (pytorch-optimizer) ----------------------------------------------------------------------------
    k: int | None = Field(
        default=None, ge=0, description="AIDA: alternating projections of gradient and momentum per step." + _by("k"),
    )
    xi: float | None = Field(
        default=None, ge=0, description="AIDA: added to the projections' denominators." + _by("xi"),
    )
    n_sma_threshold: int | None = Field(
        default=None, ge=0, description="AIDA with rectify: the rectification starts once the moving average is this "
        "long." + _by("n_sma_threshold"),
    )
    ams_bound: bool | None = Field(
        default=None, description="AIDA: bound the update with the running maximum of the second moment."
        + _by("ams_bound"),
    )

    # -- adv_optm's optimizers (OneTrainer's *_ADV) ------------------------------------------------------------
    cautious_wd: bool | None = Field(
        default=None, description="Cautious weight decay: decay only the elements whose update has the weight's sign."
        + _by("cautious_wd"),
    )
    nnmf_factor: bool | None = Field(
        default=None, description="Keep the optimizer state factored (low-rank, SMMF): less memory." + _by("nnmf_factor"),
    )
    orthogonal_gradient: Literal["disabled", "flattened", "iterative"] | None = Field(
        default=None, description="OrthoGrad: drop the gradient's component along the weights (flattened: over the "
        "whole tensor, OneTrainer's `true`; iterative: row- and column-wise)." + _by("orthogonal_gradient"),
    )
    compile: bool | None = Field(
        default=None, description="torch.compile the step of each tensor shape (adv_optm's compiled_optimizer)."
        + _by("compile"),
    )
    use_atan2: bool | None = Field(
        default=None, description="Adam-atan2 update (no epsilon, bounded)." + _by("use_atan2"),
    )
    kourkoutas_beta: bool | None = Field(
        default=None, description="Kourkoutas-beta: beta2 follows each tensor's gradient spikes." + _by("kourkoutas_beta"),
    )
    k_warmup_steps: float | None = Field(
        default=None, ge=0, description="Kourkoutas-beta: optimizer steps at the fixed beta2 before it adapts "
        "(OneTrainer passes its warmup divided by the gradient accumulation)." + _by("k_warmup_steps"),
    )
    auto_kappa_p: bool | None = Field(
        default=None, description="LION_ADV: spherical (L2) steps for convolution kernels, sign steps for the rest."
        + _by("auto_kappa_p"),
    )
    ns_steps: int | None = Field(
        default=None, ge=1, description="Muon: Newton-Schulz iterations of the orthogonalisation." + _by("ns_steps"),
    )
    accelerated_ns: bool | None = Field(
        default=None, description="Muon: accelerated Newton-Schulz coefficients." + _by("accelerated_ns"),
    )
    low_rank_ortho: bool | None = Field(
        default=None, description="Muon: orthogonalise a low-rank sketch (ortho_rank) of the update." + _by("low_rank_ortho"),
    )
    ortho_rank: int | None = Field(
        default=None, ge=1, description="Muon with low_rank_ortho: the sketch's rank." + _by("ortho_rank"),
    )
    rms_rescaling: bool | None = Field(
        default=None, description="Muon: scale the orthogonal update to AdamW's root mean square." + _by("rms_rescaling"),
    )
    normuon_variant: bool | None = Field(
        default=None, description="Muon: NorMuon (a per-row second moment after orthogonalising)." + _by("normuon_variant"),
    )
    beta2_normuon: float | None = Field(
        default=None, ge=0, lt=1, description="NorMuon: decay of its second moment." + _by("beta2_normuon"),
    )
    approx_mars: bool | None = Field(
        default=None, description="Muon: approximate MARS variance reduction of the gradient." + _by("approx_mars"),
    )

    @model_validator(mode="before")
    @classmethod
    def _options_of_this_optimizer(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = data.get("name", "ADAMW")
        spec = SPECS.get(name) if isinstance(name, str) else None
        if spec is None:
            return data  # the name's own error lists the optimizers
        for key, value in data.items():
            if value is None or key == "name":
                continue
            if key in NOT_AVAILABLE:
                raise ValueError(
                    f"optimizer.{key}: not available ({NOT_AVAILABLE[key]}). {name} takes: {', '.join(spec.options)}"
                )
            if key in cls.model_fields and key not in spec.defaults:
                raise ValueError(
                    f"optimizer.{key}: {name} does not take {key}; it takes: {', '.join(spec.options)}."
                    f" ({key} is taken by {', '.join(takers(key)) or 'no optimizer'})"
                )
        filled = dict(data)
        if "foreach" in spec.defaults and data.get("foreach") is None and data.get("fused"):
            filled["foreach"] = False  # torch refuses both
        for key, default in spec.defaults.items():
            if filled.get(key) is None:
                filled[key] = default
        return filled

    @model_validator(mode="after")
    def _option_values(self) -> "OptimizerConfig":
        spec = SPECS[self.name]
        for key in spec.must_be_positive:
            if not getattr(self, key):
                raise ValueError(
                    f"optimizer.{key}: {self.name} needs {key} > 0 (its implementation refuses 0)"
                )
        if self.quant_block_size is not None and self.quant_block_size not in QUANT_BLOCK_SIZES:
            raise ValueError(
                f"optimizer.quant_block_size: {self.quant_block_size} is not a block size bitsandbytes takes; use one "
                f"of {', '.join(map(str, QUANT_BLOCK_SIZES))}"
            )
        if self.foreach and self.fused:
            raise ValueError(
                "optimizer.fused: torch cannot use foreach and fused together; set optimizer.foreach: false"
            )
        if self.name == "ADAFACTOR" and self.warmup_init and not self.relative_step:
            raise ValueError("optimizer.warmup_init: needs optimizer.relative_step: true")
        return self

    @property
    def adaptive(self) -> bool:
        """Estimates its own step size (Prodigy, D-Adaptation): `lr` is a multiplier on it."""
        return self.name in ADAPTIVE

    def options(self) -> dict[str, Any]:
        """The options the chosen optimizer takes, resolved."""
        return {key: getattr(self, key) for key in SPECS[self.name].defaults}


class SchedulerConfig(Section):
    """The learning-rate schedule, counted in optimizer steps: a factor on each parameter group's learning
    rate, computed as OneTrainer computes it. Linear warmup first (factor step/warmup, the first step at 0),
    then the schedule over the remaining steps."""

    name: Literal[SCHEDULER_NAMES] = Field(
        default="CONSTANT",
        description="CONSTANT; LINEAR, COSINE, REX (decay to min_factor); COSINE_WITH_RESTARTS (smooth: `cycles` "
        "full cosine periods, lows total/cycles steps apart, ending near the top), COSINE_WITH_HARD_RESTARTS and REX_WITH_RESTARTS (`cycles` equal "
        "decays, each jumping back to the top); ADAFACTOR (Adafactor's own relative step, with optimizer "
        "ADAFACTOR relative_step true); CUSTOM (any torch.optim.lr_scheduler class, see class_name).",
    )
    warmup_steps: int | float = Field(
        default=0, ge=0,
        description="Linear warmup: when > 1 a count of micro steps (OneTrainer's unit: divided by "
        "gradient_accumulation_steps it gives optimizer steps), when <= 1 a fraction of the total optimizer steps "
        "(0.05 = 5%, 1 = the whole run).",
    )
    cycles: float | None = Field(
        default=None, gt=0,
        description="Number of cycles of COSINE_WITH_RESTARTS / COSINE_WITH_HARD_RESTARTS / REX_WITH_RESTARTS "
        "(default 1).",
    )
    min_factor: float | None = Field(
        default=None, ge=0, le=1,
        description="Lowest factor a decaying schedule reaches (LINEAR, COSINE, REX and the restarts; default 0): "
        "factor = min_factor + (1 - min_factor) x curve.",
    )
    class_name: str | None = Field(
        default=None,
        description="CUSTOM: `module.Class` of an LRScheduler, e.g. torch.optim.lr_scheduler.MultiStepLR. It starts "
        "after warmup and scales each parameter group's learning rate.",
    )
    params: dict[str, Any] | None = Field(
        default=None,
        description="CUSTOM: the class's constructor arguments. A value may be one of %LR% (base learning rate), "
        "%EPOCHS%, %STEPS_PER_EPOCH% (OneTrainer's: the batches each process draws per epoch, before gradient "
        "accumulation), %TOTAL_STEPS%, %SCHEDULER_STEPS% (total minus warmup; both in optimizer steps).",
    )
    allow_custom_code: bool | None = Field(
        default=None,
        description="CUSTOM: allow a class outside torch.optim.lr_scheduler and ot_dist. Loading it imports and runs "
        "that module's code.",
    )
    snapshot_at_cycle_lows: bool = Field(
        default=False,
        description="With a cyclic schedule: export a snapshot to output_dir/snapshots/step-N/ at the lowest "
        "learning rate of every cycle but one at the last step (the final export is that). 10000 steps with 20 hard "
        "restarts save every 500 steps.",
    )

    @model_validator(mode="before")
    @classmethod
    def _options_of_this_schedule(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = data.get("name", "CONSTANT")
        if name not in SCHEDULER_NAMES:
            return data
        takes = {
            "cycles": CYCLIC, "min_factor": DECAYING,
            "class_name": ("CUSTOM",), "params": ("CUSTOM",), "allow_custom_code": ("CUSTOM",),
        }
        defaults = {"cycles": 1.0, "min_factor": 0.0, "params": {}, "allow_custom_code": False}
        filled = dict(data)
        for key, names in takes.items():
            if name not in names:
                if data.get(key) is not None:
                    raise ValueError(f"scheduler.{key}: schedule {name} does not take it; {', '.join(names)} do")
            elif filled.get(key) is None and key in defaults:
                filled[key] = defaults[key]
        if data.get("snapshot_at_cycle_lows") and name not in CYCLIC:
            raise ValueError(
                f"scheduler.snapshot_at_cycle_lows: needs a cyclic schedule ({', '.join(CYCLIC)}), not {name}"
            )
        return filled

    @model_validator(mode="after")
    def _values(self) -> "SchedulerConfig":
        if self.warmup_steps > 1 and self.warmup_steps != int(self.warmup_steps):
            raise ValueError(
                f"scheduler.warmup_steps: {self.warmup_steps} is neither a whole step count nor a fraction <= 1"
            )
        if self.name == "ADAFACTOR" and self.warmup_steps:
            raise ValueError(
                "scheduler.warmup_steps: schedule ADAFACTOR has its own warmup (optimizer.warmup_init); set 0"
            )
        if self.name == "CUSTOM":
            check_custom_scheduler(self)
        return self

    def resolved_warmup(self, total_steps: int, accumulation: int = 1) -> int:
        """Warmup in optimizer steps, as OneTrainer counts it: a count > 1 is in micro steps (divided by the
        gradient accumulation), a value <= 1 a fraction of the total optimizer steps."""
        if 0 < self.warmup_steps <= 1:
            return int(self.warmup_steps * total_steps)
        return int(self.warmup_steps / accumulation)


def check_custom_scheduler(config: SchedulerConfig) -> None:
    """CUSTOM: the class must be `module.Class`, from an allowed module unless allow_custom_code, an
    LRScheduler, and take the given params."""
    path = config.class_name
    if not path or "." not in path:
        raise ValueError(
            "scheduler.class_name: schedule CUSTOM needs `module.Class`, e.g. "
            f"torch.optim.lr_scheduler.MultiStepLR (got {path!r})"
        )
    module_name, _, class_name = path.rpartition(".")
    allowed = any(module_name == m or module_name.startswith(m + ".") for m in ALLOWED_SCHEDULER_MODULES)
    if not allowed and not config.allow_custom_code:
        raise ValueError(
            f"scheduler.class_name: {path} is outside {' and '.join(ALLOWED_SCHEDULER_MODULES)}; loading it runs "
            f"the code of {module_name}. Set scheduler.allow_custom_code: true if you trust it"
        )
    for key, value in config.params.items():
        for text in _strings(value):
            for token in re.findall(r"%[A-Z_]+%", text):
                if token not in PLACEHOLDERS:
                    raise ValueError(
                        f"scheduler.params.{key}: unknown placeholder {token}; known: {', '.join(PLACEHOLDERS)}"
                    )
            if re.search(r"%[A-Z_]+%", text) and text not in PLACEHOLDERS:
                raise ValueError(f"scheduler.params.{key}: a placeholder must be the whole value, got {text!r}")
    import importlib
    import inspect

    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"scheduler.class_name: cannot load {path}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, LRScheduler)) or issubclass(cls, ReduceLROnPlateau):
        raise ValueError(f"scheduler.class_name: {path} is not a step-driven torch LRScheduler")
    for reserved in ("optimizer", "last_epoch"):
        if reserved in config.params:
            raise ValueError(f"scheduler.params.{reserved}: set by ot_dist, leave it out")
    signature = inspect.signature(cls)
    takes = [p for p in signature.parameters if p not in ("optimizer", "last_epoch", "verbose")]
    for key in config.params:
        if key not in signature.parameters:
            raise ValueError(f"scheduler.params.{key}: {class_name} does not take it; it takes: {', '.join(takes)}")
    try:
        signature.bind(optimizer=None, **config.params)
    except TypeError as err:
        raise ValueError(f"scheduler.params: {class_name} {err}; it takes: {', '.join(takes)}") from None


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


def planned_groups(config) -> list[tuple[str, float, str]]:
    """(group name, learning rate, the config key it comes from) of every parameter group the method will
    build, in order: what the methods' `prepare` returns, known before any model is loaded."""
    if config.method == "embedding":
        parts = ["embedding"]
    else:
        parts = [p for p in config.part_names() if config.part_trains(p)]
    groups = []
    for part in parts:
        own = getattr(config, part).learning_rate
        groups.append((part, own or config.learning_rate, f"{part}.learning_rate" if own else "learning_rate"))
    for i, entry in enumerate(config.additional_embeddings):
        if entry.train:
            key = (f"additional_embeddings[{i}].learning_rate" if entry.learning_rate else
                   "embedding.learning_rate" if config.embedding.learning_rate else "learning_rate")
            groups.append((entry.group_name(), config.additional_learning_rate(entry), key))
    return groups


def strategy_refusal(name: str, strategy: str, options: dict | None = None) -> str | None:
    """Why `name` cannot train under a sharding `strategy` (None if it can), with its `options` (default: its
    defaults). Measured: each optimizer was run under fsdp and zero2 with 2 ranks (tests/test_optimizers_distributed.py)."""
    spec = SPECS[name]
    options = {**spec.defaults, **(options or {})}
    if spec.adaptive and name != "PRODIGY" and strategy in SHARDING:
        package = spec.target.split(":")[0].split(".")[0]
        syncs = "" if package == "adv_optm" else ", syncing to the host for every tensor"
        return (
            f"strategy: {strategy} gives each rank a shard of the parameters, and {name} (the {package} package) "
            f"would estimate its step size from that shard alone, a different one on every rank{syncs}. Use PRODIGY, "
            f"whose ot_dist implementation sums the estimate over all shards, or strategy single or ddp with {name}"
        )
    if strategy == "fsdp" and spec.target.startswith("bitsandbytes"):
        return (
            f"strategy: fsdp holds parameters as DTensor shards, and {name}'s bitsandbytes kernels only take plain "
            "tensors. Use strategy ddp or zero1 / zero2 / zero3 with it, or a torch optimizer (ADAMW, ADAM, SGD, ...)"
        )
    if strategy == "fsdp" and name == "ADAFACTOR":
        return (
            "strategy: fsdp holds parameters as DTensor shards, which transformers' Adafactor mixes with plain tensors "
            "in its factored statistics. Use strategy ddp or zero1 / zero2 / zero3 with it"
        )
    if strategy.startswith("zero") and (spec.trust_ratio or name == "ADAFACTOR"):
        what = "its per-tensor trust ratio" if spec.trust_ratio else "its per-matrix factored second moments"
        return (
            f"strategy: {strategy} hands the optimizer one flat partition per parameter group, so {name} would compute "
            f"{what} over the wrong tensors. Use strategy single, ddp or fsdp with it"
        )
    if strategy == "fsdp" and spec.target.startswith("adv_optm:"):
        return (
            f"strategy: fsdp holds parameters as DTensor shards, which adv_optm ({name}) was not written for: its "
            "state is made of plain tensors (AdamW_adv, Adopt_adv and SignSGD_adv fail at their first step, mixing "
            f"torch.Tensor and DTensor), and {name} needs {spec.whole_tensor}. Use strategy single or ddp with {name}"
        )
    per_tensor = [o for o in spec.per_tensor_options if options[o] != spec.defaults[o]]
    if spec.per_tensor_options and strategy.startswith("zero") and not per_tensor:
        return None  # element-wise with these options: ZeRO's flat partitions step as the whole tensors would
    if per_tensor and strategy.startswith("zero"):
        return (
            f"strategy: {strategy} hands the optimizer flat partitions of the parameters, and {name} with "
            f"{', '.join(f'optimizer.{o}' for o in per_tensor)} needs {spec.whole_tensor}: on a partition it would be "
            f"computed over the wrong elements. Leave {' and '.join(per_tensor)} at "
            f"{'its default' if len(per_tensor) == 1 else 'their defaults'} under {strategy}, or use strategy single or ddp"
        )
    if spec.whole_tensor and strategy in SHARDING:
        return (
            f"strategy: {strategy} splits tensors across ranks (fsdp: rows of each tensor; zero: flat partitions), and "
            f"{name} needs {spec.whole_tensor}: on a shard it would be computed over the wrong elements. Use strategy "
            f"single or ddp with {name}"
        )
    if spec.schedule_free and strategy.startswith("zero"):
        return (
            f"strategy: {strategy} steps the optimizer on DeepSpeed's flat float32 partitions and copies them into the "
            f"model; {name} samples and exports its averaged weights by switching those partitions (optimizer.eval()), "
            "which DeepSpeed does not copy back, so samples and exports would show the training iterate. Use strategy "
            f"single, ddp or fsdp with {name}"
        )
    return None


def check_optimizer_setup(config) -> None:
    """Checks across sections; raises ValueError naming the keys."""
    opt, sched = config.optimizer, config.scheduler
    if opt.adaptive:
        groups = planned_groups(config)
        if len({lr for _, lr, _ in groups}) > 1:
            rates = ", ".join(f"{key} = {lr:g} ({name})" for name, lr, key in groups)
            raise ValueError(
                f"optimizer.name: {opt.name} estimates one step size for all parameter groups, so every group must "
                f"have the same learning rate (1.0 is usual; it multiplies the estimate): {rates}. Remove the "
                f"per-part learning rates or set them equal (per-group multipliers are not supported)"
            )
    refusal = strategy_refusal(opt.name, config.strategy, opt.options())
    if refusal:
        raise ValueError(refusal)
    if opt.fused_back_pass:
        problems = {
            "clip_grad_norm": (
                config.clip_grad_norm is not None and config.clip_grad_norm_scope == "global",
                "a global gradient norm needs every gradient at once: set clip_grad_norm_scope: per_tensor (each "
                "gradient clipped by its own norm, as OneTrainer and kohya do) or clip_grad_norm: null",
            ),
            "train_dtype": (
                config.train_dtype == "float16",
                "must not be float16 (loss scaling must see every gradient before any update)",
            ),
            "strategy": (
                config.strategy not in ("single", "ddp"),
                "must be single or ddp (fsdp and zero1-3 shard what a parameter's step needs)",
            ),
        }
        for key, (bad, why) in problems.items():
            if bad:
                raise ValueError(f"{key}: {why} with optimizer.fused_back_pass: true")
    elif config.clip_grad_norm_scope == "per_tensor":
        raise ValueError("clip_grad_norm_scope: per_tensor clips each gradient as the fused back pass steps it: it needs "
                         "optimizer.fused_back_pass: true (without it, global)")
    spec = SPECS[opt.name]
    if spec.trust_ratio and config.method == "lora" and (opt.max_unorm is None or opt.max_unorm > 0):
        key = "optimizer.max_unorm" if opt.max_unorm is not None else "optimizer.name"
        raise ValueError(
            f"{key}: {opt.name} caps each update at max_unorm x the weight's norm, and LoRA's up matrices start "
            "at zero, so nothing would ever train. "
            + ("Set optimizer.max_unorm: 0 with method lora" if opt.max_unorm is not None
               else "Use LAMB with optimizer.max_unorm: 0, or another optimizer, with method lora")
        )
    if opt.fsdp_in_use and config.strategy not in SHARDING:
        raise ValueError(
            f"optimizer.fsdp_in_use: strategy {config.strategy} does not shard parameters, so there is nothing to "
            "reduce across ranks; leave it false (it is set from the strategy)"
        )
    adafactor_adaptive = opt.name == "ADAFACTOR" and opt.relative_step
    if sched.name == "ADAFACTOR" and not adafactor_adaptive:
        raise ValueError(
            "scheduler.name: ADAFACTOR reports Adafactor's own step size; it needs optimizer.name ADAFACTOR "
            "with optimizer.relative_step: true (the default, OneTrainer's, is false: Adafactor then follows your "
            "learning rate and any other schedule)"
        )
    if adafactor_adaptive and sched.name != "ADAFACTOR":
        raise ValueError(
            f"scheduler.name: {sched.name} has no effect with optimizer ADAFACTOR and relative_step: true (Adafactor "
            "computes its own step size and ignores learning rates). Set scheduler.name: ADAFACTOR, or for the "
            "low-memory AdamW-like mode set optimizer.relative_step: false and optimizer.scale_parameter: false"
        )
