"""Every optimizer by its OneTrainer name: which class implements it, which options it takes and
their defaults (OneTrainer's, from OPTIMIZER_DEFAULT_PARAMETERS in its modules/util/optimizer_util.py;
the few kept different on purpose are listed in docs/onetrainer.md with the reason), and what the rest of the stack must know about it (adaptive step size, fused back
pass). Pure data: importing this module imports no optimizer library, so the config can be
validated before anything heavy loads.

An option is listed for an optimizer only when its implementation honours it; bitsandbytes accepts
several arguments it then ignores (LAMB's `bias_correction`, LARS's `nesterov`, 8-bit RMSprop's
`momentum`), and those are left out so that setting them is an error instead of a silent no-op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

INF = math.inf
QUANT_BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' block-wise kernels (CAME_8BIT's blocks)

# Options from OneTrainer's list that no optimizer here takes, with the reason (shown in the error).
NOT_AVAILABLE = {
    "optim_bits": "the _8BIT optimizer names choose 8-bit state (e.g. ADAMW_8BIT)",
    "percentile_clipping": "bitsandbytes 0.50 removed it",
    "block_wise": "bitsandbytes 0.50 removed it; 8-bit state is always block-wise",
    "use_triton": "LION is bitsandbytes' Lion here, not lion-pytorch's Triton kernel",
    "adam_w_mode": "bitsandbytes' LAMB accepts but ignores it",
    **{option: "adv_optm 2.5 (the *_ADV optimizers' package; OneTrainer pins 2.2) removed its AdEMAMix options"
       for option in ("use_AdEMAMix", "beta3_ema", "Simplified_AdEMAMix", "alpha_grad")},
}


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    target: str  # "module:Class" of the implementation; a subclass may replace it (e.g. sharding-aware Prodigy)
    defaults: dict[str, Any]  # every option it takes -> its default (None = the implementation decides)
    betas: tuple[str, ...] = ()  # options packed into the `betas` tuple, in order
    eps_pair: bool = False  # Adafactor: eps and eps2 packed into `eps`
    adaptive: bool = False  # estimates its own step size d (D-Adaptation, Prodigy): groups share one lr
    supports_fused_back_pass: bool = False  # the update of a parameter depends only on that parameter
    eight_bit: bool = False
    notes: str = ""
    must_be_positive: tuple[str, ...] = ()  # options the implementation refuses at 0
    trust_ratio: bool = False  # caps each update at max_unorm x the weight's norm: a zero weight never moves
    cuda_fused: bool = False  # torch has a fused CUDA kernel: chosen when `fused` is unset and it can run (factory.py)
    # DTensor (FSDP2's sharded parameters) has sharding rules for this fused op, on every device (torch 2.13: the fused
    # Adam / AdamW ops only; fused SGD on DTensors raises NotImplementedError)
    dtensor_fused: bool = False
    renames: tuple[tuple[str, str], ...] = ()  # (option, the implementation's keyword) where OneTrainer's name differs
    whole_tensor: str = ""  # what it computes over each whole tensor ("" = elementwise): wrong on shards
    # options that make an otherwise element-wise step need whole tensors (whole_tensor): ZeRO's flat partitions are
    # refused only when one of them is set away from its default
    per_tensor_options: tuple[str, ...] = ()
    schedule_free: bool = False  # trains at one point, averages another: samples and exports use the average
    group_split: str = ""  # "module:function" that turns the parameter groups into the implementation's groups
    dtensor_foreach: bool = True  # its multi-tensor path runs on FSDP2's DTensor shards (else: per-tensor loop there)
    # the class rounds bfloat16 weights stochastically itself (adv_optm): `stochastic_rounding` is passed to it and
    # ot_dist's step hooks (stochastic_rounding.py) are not installed, so its state stays in the weights' dtype
    own_stochastic_rounding: bool = False
    group_only: tuple[str, ...] = ()  # options only group_split reads (e.g. MUON_ADV's muon_adam_lr): not passed on

    @property
    def options(self) -> tuple[str, ...]:
        return tuple(self.defaults)


# Options every optimizer takes: they act around the step, not inside it.
COMMON = {"stochastic_rounding": False}
FUSED = {"fused_back_pass": False}
TORCH = {"foreach": True, "fused": None, "maximize": False, "differentiable": False}


def _spec(name, target, defaults, **kw) -> OptimizerSpec:
    common = {k: v for k, v in COMMON.items() if k not in defaults}
    return OptimizerSpec(name=name, target=target, defaults={**defaults, **common}, **kw)


_ADAM = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
_BNB_8BIT = {"min_8bit_size": 4096}

# adv_optm's optimizers (OneTrainer's *_ADV): the options OneTrainer passes every one of them, with its defaults.
# orthogonal_gradient is adv_optm 2.5's mode ("disabled", "flattened": OrthoGrad over the flattened tensor, what
# OneTrainer's true means in adv_optm 2.2, "iterative": row / column-wise); compile is its compiled_optimizer.
_ADV = {"weight_decay": 0.0, "cautious_wd": False, "nnmf_factor": False, "orthogonal_gradient": "disabled",
        "compile": False, "stochastic_rounding": True}
_KOURKOUTAS = {"kourkoutas_beta": False, "k_warmup_steps": 0.0}
_ADV_MUON = {"accelerated_ns": False, "ns_steps": 5, "low_rank_ortho": False, "ortho_rank": 128, "rms_rescaling": True,
             "normuon_variant": True, "approx_mars": False, "muon_adam_lr": 1e-6}
_ADV_PER_TENSOR = ("nnmf_factor", "orthogonal_gradient")  # (with ADAMW_ADV / ADOPT_ADV's kourkoutas_beta)
_ADV_WHOLE = ("each whole tensor for its per-tensor options (nnmf_factor's factored state, orthogonal_gradient's "
              "projection, kourkoutas_beta's gradient norms)")


def _adv(name, cls, defaults, compiles=True, **kw) -> OptimizerSpec:
    kw.setdefault("whole_tensor", _ADV_WHOLE)
    # each tensor's step depends on that tensor alone (step_parameter), but for PRODIGY_ADV's d, summed over the step
    kw.setdefault("supports_fused_back_pass", True)
    common = {**(_ADV if compiles else {k: v for k, v in _ADV.items() if k != "compile"}),
              **(FUSED if kw["supports_fused_back_pass"] else {})}
    renames = kw.pop("renames", ()) + ((("compile", "compiled_optimizer"),) if compiles else ())
    return _spec(name, f"adv_optm:{cls}", {**defaults, **common}, renames=renames, own_stochastic_rounding=True, **kw)

SPECS: dict[str, OptimizerSpec] = {
    s.name: s
    for s in [
        # -- the standard optimizers (torch, or bitsandbytes where torch has none) -------------
        _spec("ADAGRAD", "torch.optim:Adagrad",
              {"lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10, **TORCH, **FUSED},
              supports_fused_back_pass=True),
        _spec("ADAM", "torch.optim:Adam",
              {**_ADAM, "weight_decay": 0.0, "amsgrad": False, "capturable": False, **TORCH, **FUSED},
              betas=("beta1", "beta2"), supports_fused_back_pass=True, cuda_fused=True, dtensor_fused=True),
        _spec("ADAMW", "torch.optim:AdamW",
              {**_ADAM, "weight_decay": 1e-2, "amsgrad": False, "capturable": False, **TORCH, **FUSED},
              betas=("beta1", "beta2"), supports_fused_back_pass=True, cuda_fused=True, dtensor_fused=True),
        _spec("LAMB", "bitsandbytes.optim:LAMB",
              {**_ADAM, "weight_decay": 0.0, "max_unorm": 1.0}, betas=("beta1", "beta2"), trust_ratio=True),
        _spec("LARS", "bitsandbytes.optim:LARS",
              {"momentum": 0.9, "weight_decay": 0.0, "max_unorm": 0.02},
              must_be_positive=("momentum",), trust_ratio=True),
        _spec("LION", "bitsandbytes.optim:Lion",
              {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0}, betas=("beta1", "beta2")),
        _spec("RMSPROP", "torch.optim:RMSprop",
              {"alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0, "centered": False,
               "capturable": False, "foreach": True, "maximize": False, "differentiable": False, **FUSED},
              supports_fused_back_pass=True),
        _spec("SGD", "torch.optim:SGD",
              {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, **TORCH, **FUSED},
              supports_fused_back_pass=True, cuda_fused=True),
        # -- their 8-bit versions (bitsandbytes; tensors smaller than min_8bit_size keep 32-bit state)
        _spec("ADAGRAD_8BIT", "bitsandbytes.optim:Adagrad8bit",
              {"weight_decay": 0.0, "eps": 1e-10, **_BNB_8BIT}, eight_bit=True),
        _spec("ADAM_8BIT", "bitsandbytes.optim:Adam8bit",
              {**_ADAM, "weight_decay": 0.0, **_BNB_8BIT, "is_paged": False}, betas=("beta1", "beta2"), eight_bit=True),
        _spec("ADAMW_8BIT", "bitsandbytes.optim:AdamW8bit",
              {**_ADAM, "weight_decay": 1e-2, **_BNB_8BIT, "is_paged": False}, betas=("beta1", "beta2"),
              eight_bit=True),
        # bitsandbytes' 8-bit kernels have no trust ratio: LAMB_8BIT / LARS_8BIT apply it (max_unorm)
        # only to the tensors small enough to keep 32-bit state.
        _spec("LAMB_8BIT", "bitsandbytes.optim:LAMB8bit",
              {**_ADAM, "weight_decay": 0.0, **_BNB_8BIT}, betas=("beta1", "beta2"), eight_bit=True, trust_ratio=True),
        _spec("LARS_8BIT", "bitsandbytes.optim:LARS8bit",
              {"momentum": 0.9, "weight_decay": 0.0, "max_unorm": 0.02, **_BNB_8BIT}, eight_bit=True,
              must_be_positive=("momentum",), trust_ratio=True),
        _spec("LION_8BIT", "bitsandbytes.optim:Lion8bit",
              {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, **_BNB_8BIT, "is_paged": False},
              betas=("beta1", "beta2"), eight_bit=True),
        _spec("RMSPROP_8BIT", "bitsandbytes.optim:RMSprop8bit",
              {"alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, **_BNB_8BIT}, eight_bit=True,
              must_be_positive=("alpha",)),
        _spec("SGD_8BIT", "bitsandbytes.optim:SGD8bit",
              {"momentum": 0.9, "weight_decay": 0.0, **_BNB_8BIT}, eight_bit=True,
              must_be_positive=("momentum",)),
        # -- D-Adaptation (learning-rate free: lr is a multiplier on the estimated step size d) --
        _spec("DADAPT_ADA_GRAD", "dadaptation:DAdaptAdaGrad",
              {"momentum": 0.0, "log_every": 0, "weight_decay": 0.0, "eps": 1e-6, "d0": 1e-6, "growth_rate": INF},
              adaptive=True, must_be_positive=("eps",)),  # OneTrainer's eps 0.0 is refused by dadaptation
        _spec("DADAPT_ADAM", "dadaptation:DAdaptAdam",
              {**_ADAM, "weight_decay": 0.0, "log_every": 0, "decouple": False, "use_bias_correction": False,
               "d0": 1e-6, "growth_rate": INF, "fsdp_in_use": False},
              betas=("beta1", "beta2"), adaptive=True),
        _spec("DADAPT_ADAN", "dadaptation:DAdaptAdan",
              {"beta1": 0.98, "beta2": 0.92, "beta3": 0.99, "eps": 1e-8, "weight_decay": 0.02, "no_prox": False,
               "log_every": 0, "d0": 1e-6, "growth_rate": INF},
              betas=("beta1", "beta2", "beta3"), adaptive=True),
        _spec("DADAPT_LION", "dadaptation:DAdaptLion",
              {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "log_every": 0, "d0": 1e-6, "fsdp_in_use": False},
              betas=("beta1", "beta2"), adaptive=True),
        _spec("DADAPT_SGD", "dadaptation:DAdaptSGD",
              {"momentum": 0.0, "weight_decay": 0.0, "log_every": 0, "d0": 1e-6, "growth_rate": INF,
               "fsdp_in_use": False},
              adaptive=True),
        # -- Prodigy: prodigyopt's math, summed correctly over shards (ot_dist/optim/prodigy.py) --
        _spec("PRODIGY", "ot_dist.optim.prodigy:ShardedProdigy",
              {"beta1": 0.9, "beta2": 0.999, "beta3": None, "eps": 1e-8, "weight_decay": 0.0, "decouple": True,
               "use_bias_correction": False, "safeguard_warmup": False, "d0": 1e-6, "d_coef": 1.0,
               "growth_rate": INF, "fsdp_in_use": False, "slice_p": 11},
              betas=("beta1", "beta2"), adaptive=True),
        # -- Adafactor (transformers): adaptive (relative_step) or low-memory AdamW-like -------
        _spec("ADAFACTOR", "transformers.optimization:Adafactor",
              {"eps": 1e-30, "eps2": 1e-3, "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": None,
               "weight_decay": 0.0, "scale_parameter": False, "relative_step": False, "warmup_init": False,
               "stochastic_rounding": True, **FUSED},
              eps_pair=True, supports_fused_back_pass=True,
              notes="default (OneTrainer's): relative_step and scale_parameter false, the low-memory AdamW-like mode "
              "with your learning rate and schedule; relative_step: true computes its own step size (use scheduler "
              "ADAFACTOR)"),
        # -- OneTrainer's further optimizers, from maintained packages ------------------------------
        _spec("ADOPT", "pytorch_optimizer:ADOPT",
              {"beta1": 0.9, "beta2": 0.9999, "weight_decay": 0.0, "decoupled_decay": False, "fixed_decay": False,
               "cautious": False, "eps": 1e-6},
              betas=("beta1", "beta2"), renames=(("decoupled_decay", "weight_decouple"),),
              dtensor_foreach=False),  # torch has no DTensor rule for its _foreach_maximum_
        _spec("AdEMAMix", "bitsandbytes.optim:AdEMAMix",
              {**_ADAM, "beta3": 0.9999, "alpha": 5.0, "weight_decay": 1e-2, "is_paged": False},
              betas=("beta1", "beta2", "beta3")),
        _spec("AdEMAMix_8BIT", "bitsandbytes.optim:AdEMAMix8bit",
              {**_ADAM, "beta3": 0.9999, "alpha": 5.0, "weight_decay": 1e-2, **_BNB_8BIT, "is_paged": False},
              betas=("beta1", "beta2", "beta3"), eight_bit=True),
        _spec("CAME", "pytorch_optimizer:CAME",
              {"beta1": 0.9, "beta2": 0.999, "beta3": 0.9999, "eps": 1e-30, "eps2": 1e-16, "weight_decay": 1e-2},
              betas=("beta1", "beta2", "beta3"), renames=(("eps", "eps1"),),
              whole_tensor="its factored (row and column) second moments and confidence of each weight matrix"),
        # CAME with the first moment of each weight matrix above min_8bit_size in bitsandbytes' 8-bit blocks
        # (what OneTrainer's CAME_8BIT quantises; its defaults)
        _spec("CAME_8BIT", "ot_dist.optim.came8bit:CAME8bit",
              {"beta1": 0.9, "beta2": 0.999, "beta3": 0.9999, "eps": 1e-30, "eps2": 1e-16, "weight_decay": 1e-2,
               "min_8bit_size": 16384, "quant_block_size": 2048},
              betas=("beta1", "beta2", "beta3"), renames=(("eps", "eps1"),), eight_bit=True,
              whole_tensor="its factored (row and column) second moments and confidence of each weight matrix"),
        _spec("MUON", "pytorch_optimizer:Muon",
              {"momentum": 0.95, "weight_decay": 0.0, "muon_adam_lr": 3e-4},
              renames=(("muon_adam_lr", "adamw_lr"),), group_split="ot_dist.optim.muon:muon_groups",
              whole_tensor="the orthogonalisation (Newton-Schulz) of each whole weight matrix's momentum",
              notes="weight matrices (2-D and up) take Muon's step at your learning rate; biases and norms take "
              "AdamW's at muon_adam_lr"),
        _spec("SCHEDULE_FREE_ADAMW", "schedulefree:AdamWScheduleFree",
              {**_ADAM, "weight_decay": 1e-2, "r": 0.0, "weight_lr_power": 2.0, "foreach": False},
              betas=("beta1", "beta2"), schedule_free=True),
        _spec("SCHEDULE_FREE_SGD", "schedulefree:SGDScheduleFree",
              {"momentum": 0.9, "weight_decay": 1e-2, "r": 0.0, "weight_lr_power": 2.0, "foreach": False},
              must_be_positive=("momentum",), schedule_free=True),  # OneTrainer's momentum 0 is refused by schedulefree
        _spec("PRODIGY_PLUS_SCHEDULE_FREE", "prodigyplus:ProdigyPlusScheduleFree",
              {"beta1": 0.9, "beta2": 0.99, "beta3": None, "weight_decay": 0.0, "weight_decay_by_lr": True,
               "use_bias_correction": False, "d0": 1e-6, "d_coef": 1.0, "prodigy_steps": 0, "use_speed": False,
               "eps": 1e-8, "split_groups": True, "split_groups_mean": False, "factored": True, "factored_fp32": True,
               "use_stableadamw": True, "use_cautious": False, "use_grams": False, "use_adopt": False,
               "d_limiter": True, "stochastic_rounding": True, "use_schedulefree": True, "schedulefree_c": 0.0,
               "use_orthograd": False},
              betas=("beta1", "beta2"), adaptive=True, schedule_free=True,
              whole_tensor="its factored second moments of each weight matrix and its step-size estimate"),
        _spec("ADABELIEF", "pytorch_optimizer:AdaBelief",
              {"beta1": 0.9, "beta2": 0.999, "eps": 1e-16, "weight_decay": 0.0, "amsgrad": False,
               "decoupled_decay": True, "fixed_decay": False, "rectify": True, "degenerated_to_sgd": True},
              betas=("beta1", "beta2"), renames=(("decoupled_decay", "weight_decouple"), ("amsgrad", "ams_bound"))),
        _spec("TIGER", "pytorch_optimizer:Tiger",
              {"beta1": 0.965, "weight_decay": 0.01, "decoupled_decay": True, "fixed_decay": False},
              renames=(("beta1", "beta"), ("decoupled_decay", "weight_decouple"))),
        _spec("YOGI", "pytorch_optimizer:Yogi",
              {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "decoupled_decay": True, "fixed_decay": False,
               "initial_accumulator": 1e-6, "eps": 1e-3},
              betas=("beta1", "beta2"), renames=(("decoupled_decay", "weight_decouple"),)),
        _spec("AIDA", "pytorch_optimizer:Aida",
              {"beta1": 0.9, "beta2": 0.999, "k": 2, "xi": 1e-20, "weight_decay": 0.0, "decoupled_decay": False,
               "fixed_decay": False, "rectify": False, "n_sma_threshold": 5, "degenerated_to_sgd": True,
               "ams_bound": False, "eps": 1e-8},
              betas=("beta1", "beta2"), renames=(("decoupled_decay", "weight_decouple"),),
              whole_tensor="its projections of each whole tensor's gradient and momentum onto each other"),
        # -- adv_optm (OneTrainer's *_ADV): one package, per-tensor options (see _ADV) ---------------------
        _adv("ADAMW_ADV", "AdamW_adv",
             {"beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "use_atan2": False, **_KOURKOUTAS}, betas=("beta1", "beta2"),
             per_tensor_options=_ADV_PER_TENSOR + ("kourkoutas_beta",)),
        _adv("ADOPT_ADV", "Adopt_adv",
             {"beta1": 0.9, "beta2": 0.9999, "eps": 1e-6, "use_atan2": True, **_KOURKOUTAS}, betas=("beta1", "beta2"),
             per_tensor_options=_ADV_PER_TENSOR + ("kourkoutas_beta",)),
        _adv("PRODIGY_ADV", "Prodigy_adv",
             {"beta1": 0.9, "beta2": 0.99, "beta3": None, "eps": 1e-8, "d0": 1e-6, "d_coef": 1.0, "growth_rate": INF,
              "slice_p": 11, "prodigy_steps": 0, "d_limiter": False, "use_atan2": False, **_KOURKOUTAS},
             betas=("beta1", "beta2"), adaptive=True, supports_fused_back_pass=False),
        _adv("SIGNSGD_ADV", "SignSGD_adv", {"momentum": 0.95}, per_tensor_options=_ADV_PER_TENSOR,
             whole_tensor="each whole tensor for its per-tensor options (nnmf_factor's factored state, "
             "orthogonal_gradient's projection)"),
        # adv_optm 2.5's Lion_adv takes compiled_optimizer but never stores it (its step reads the group's): no compile
        _adv("LION_ADV", "Lion_adv", {"beta1": 0.9, "beta2": 0.99, "auto_kappa_p": True}, betas=("beta1", "beta2"),
             compiles=False,
             whole_tensor=_ADV_WHOLE + " and auto_kappa_p's update of each convolution kernel, scaled to the whole "
             "kernel's norm"),
        _adv("MUON_ADV", "Muon_adv",
             {"beta1": 0.9, "nesterov": True, "beta2_normuon": 0.95, **_ADV_MUON},
             group_split="ot_dist.optim.muon:muon_groups", group_only=("muon_adam_lr",),
             whole_tensor="the orthogonalisation (Newton-Schulz) of each whole weight matrix's momentum",
             notes="weight matrices (2-D and up) take Muon's step at your learning rate; biases and norms take "
             "adv_optm's AdamW step at muon_adam_lr"),
        _adv("ADAMUON_ADV", "AdaMuon_adv",
             {"beta1": 0.95, "beta2": 0.95, "eps": 1e-8, "nesterov": False, "use_atan2": False, **_ADV_MUON},
             betas=("beta1", "beta2"), group_split="ot_dist.optim.muon:muon_groups", group_only=("muon_adam_lr",),
             whole_tensor="the orthogonalisation (Newton-Schulz) of each whole weight matrix's update",
             notes="weight matrices (2-D and up) take AdaMuon's step at your learning rate; biases and norms take "
             "adv_optm's AdamW step at muon_adam_lr"),
    ]
}
OPTIMIZER_NAMES = tuple(SPECS)
ADAPTIVE = tuple(name for name, s in SPECS.items() if s.adaptive)
FUSED_BACK_PASS = tuple(name for name, s in SPECS.items() if s.supports_fused_back_pass)
SCHEDULE_FREE = tuple(name for name, s in SPECS.items() if s.schedule_free)
ALL_OPTIONS = tuple(sorted({o for s in SPECS.values() for o in s.options}))


def spec(name: str) -> OptimizerSpec:
    return SPECS[name]


def takers(option: str) -> list[str]:
    """The optimizers that take an option."""
    return [name for name, s in SPECS.items() if option in s.defaults]
