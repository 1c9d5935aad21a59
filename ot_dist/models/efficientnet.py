"""The EfficientNetV2-S image encoder of Würstchen v2 / Stable Cascade: an image -> stage C's 16-channel latents.

Stability's `effnet_encoder.safetensors` (and Würstchen v2's effnet) is torchvision's `efficientnet_v2_s().features`
under `backbone.`, then `mapper` = a 1x1 conv 1280 -> 16 without bias and a BatchNorm2d (affine=False for Stable
Cascade), which normalises each latent channel to mean 0 / std 1. torchvision is not a dependency of ot_dist, so
this module rebuilds that architecture with the same parameter names (features.N.M.block.K... ->
backbone.N.M.block.K...), and a user's official file loads into it key for key.

Stage C's input: the image in [0, 1] scaled by 3/4 (bilinear, antialiased) and normalised with the ImageNet mean / std
(OneTrainer's WuerstchenBaseDataLoader: ScaleImage 0.75, NormalizeImageChannels), so a 1024 px side gives 24 latents
(the prior pipeline's resolution_multiple 42.67 = 1024 / 24).

`encode(pixels)` answers like a diffusers VAE (`.latent_dist.mean` / `.std`, std zero: the encoder is deterministic),
so the latent cache and the training step use it as they use a VAE.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

FILE_NAME = "effnet_encoder.safetensors"  # its name in stabilityai/stable-cascade (and OneTrainer's default)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SCALE = 0.75
BN_EPS = 1e-3  # torchvision's EfficientNetV2 norm layer

# torchvision's efficientnet_v2_s stages: (fused, expand ratio, kernel, stride, in, out, layers)
V2_S_STAGES = (
    (True, 1, 3, 1, 24, 24, 2),
    (True, 4, 3, 2, 24, 48, 4),
    (True, 4, 3, 2, 48, 64, 4),
    (False, 4, 3, 2, 64, 128, 6),
    (False, 6, 3, 1, 128, 160, 9),
    (False, 6, 3, 2, 160, 256, 15),
)
V2_S_LAST = 1280


def conv_norm(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    """torchvision's Conv2dNormActivation: conv (no bias) -> BatchNorm (eps 1e-3) -> SiLU; keys .0 / .1."""
    layers = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
              nn.BatchNorm2d(cout, eps=BN_EPS)]
    if act:
        layers.append(nn.SiLU())
    return nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)

    def forward(self, x):
        scale = self.fc2(F.silu(self.fc1(F.adaptive_avg_pool2d(x, 1))))
        return x * torch.sigmoid(scale)


class MBConv(nn.Module):
    """torchvision's (Fused)MBConv block; stochastic depth is the identity outside training, and this encoder
    never trains."""

    def __init__(self, fused: bool, expand: int, kernel: int, stride: int, cin: int, cout: int):
        super().__init__()
        hidden = make_divisible(cin * expand)
        if fused:
            layers = ([conv_norm(cin, hidden, kernel, stride), conv_norm(hidden, cout, 1, act=False)]
                      if hidden != cin else [conv_norm(cin, cout, kernel, stride)])
        else:
            layers = [conv_norm(cin, hidden, 1)] if hidden != cin else []
            layers += [conv_norm(hidden, hidden, kernel, stride, groups=hidden),
                       SqueezeExcitation(hidden, max(1, cin // 4)), conv_norm(hidden, cout, 1, act=False)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        out = self.block(x)
        return out + x if self.residual else out


def make_divisible(value: float, divisor: int = 8) -> int:
    new = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * value else new


@dataclass(frozen=True)
class EffnetConfig:
    stages: tuple = V2_S_STAGES
    last_channels: int = V2_S_LAST
    c_latent: int = 16
    affine: bool = False  # Stable Cascade's mapper norm has no weight / bias

    def to_dict(self) -> dict:  # the latent cache's key reads a module's config
        return {"stages": [list(s) for s in self.stages], "last_channels": self.last_channels,
                "c_latent": self.c_latent, "affine": self.affine}


class EfficientNetEncoder(nn.Module):
    """backbone (EfficientNetV2-S features) + mapper (1x1 conv, BatchNorm): the official state-dict layout."""

    def __init__(self, config: EffnetConfig = EffnetConfig()):
        super().__init__()
        self.config = config
        first = config.stages[0][4]
        features = [conv_norm(3, first, 3, 2)]
        for fused, expand, kernel, stride, cin, cout, layers in config.stages:
            features.append(nn.Sequential(*[MBConv(fused, expand, kernel, stride if i == 0 else 1,
                                                   cin if i == 0 else cout, cout) for i in range(layers)]))
        features.append(conv_norm(config.stages[-1][5], config.last_channels, 1))
        self.backbone = nn.Sequential(*features)
        self.mapper = nn.Sequential(nn.Conv2d(config.last_channels, config.c_latent, 1, bias=False),
                                    nn.BatchNorm2d(config.c_latent, affine=config.affine))
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True):
        return super().train(False)  # frozen: BatchNorm keeps its running statistics whatever the caller sets

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """ImageNet-normalised images (B, 3, H, W) -> latents (B, c_latent, H/32, W/32)."""
        return self.mapper(self.backbone(images))

    def preprocess(self, pixels: torch.Tensor) -> torch.Tensor:
        """Training pixels in [-1, 1] -> the encoder's input: [0, 1], scaled by 3/4, ImageNet-normalised.
        Resized and normalised in float32 and handed back in the pixels' dtype: the CPU's antialiased bilinear
        kernel has no bfloat16 / float16 version, and the resize is cheap next to the encoder."""
        images = (pixels.float() + 1) / 2
        h, w = pixels.shape[-2:]
        images = F.interpolate(images, size=(round(h * IMAGE_SCALE), round(w * IMAGE_SCALE)), mode="bilinear",
                               antialias=True, align_corners=False)
        mean = torch.tensor(IMAGENET_MEAN, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
        return ((images - mean) / std).to(pixels.dtype)

    def encode(self, pixels: torch.Tensor):
        """The VAE interface: `.latent_dist.mean` (the latents) and `.std` (zeros)."""
        latents = self(self.preprocess(pixels))
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=latents, std=torch.zeros_like(latents)))

    @staticmethod
    def latent_size(pixels: int) -> int:
        """Latents along a side of `pixels` (five stride-2 convs over the 3/4-scaled image)."""
        side = round(pixels * IMAGE_SCALE)
        for _ in range(5):
            side = (side + 1) // 2
        return side


CONFIG_NAME = "effnet_encoder.json"  # beside the file, only for a non-standard (tiny) encoder


def save_effnet(encoder: EfficientNetEncoder, folder) -> None:
    """Write the encoder into a model folder as effnet_encoder.safetensors (+ its config when not V2-S), in float32
    as Stability ships it and load_effnet reads it, from wherever the encoder lives (a device, half precision)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    state = {k: (v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()).contiguous()
             for k, v in encoder.state_dict().items()}
    save_file(state, str(folder / FILE_NAME))
    if encoder.config != EffnetConfig():
        (folder / CONFIG_NAME).write_text(json.dumps(encoder.config.to_dict()))


def load_effnet(path, config: EffnetConfig | None = None) -> EfficientNetEncoder:
    """The encoder with a safetensors file's weights (Stability's effnet_encoder.safetensors layout; the
    architecture from an effnet_encoder.json beside it, else EfficientNetV2-S); a file of another layout fails
    naming the missing / unexpected keys."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from ot_dist.errors import InputFileError

    described = Path(path).with_name(CONFIG_NAME)
    if config is None and described.is_file():
        raw = json.loads(described.read_text())
        config = EffnetConfig(stages=tuple(tuple(s) for s in raw["stages"]), last_channels=raw["last_channels"],
                              c_latent=raw["c_latent"], affine=raw["affine"])
    config = config or EffnetConfig()

    encoder = EfficientNetEncoder(config)
    state = load_file(str(path))
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]  # a counter, unused in eval
    if missing or unexpected:
        raise InputFileError(f"{path}: not an EfficientNetV2-S stage C encoder (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    return encoder.float()


def tiny_effnet_config() -> EffnetConfig:
    """The real block kinds and strides (so the same 32x downsampling), narrow and one block per stage."""
    stages = ((True, 1, 3, 1, 8, 8, 1), (True, 4, 3, 2, 8, 8, 1), (True, 4, 3, 2, 8, 16, 1),
              (False, 4, 3, 2, 16, 16, 1), (False, 6, 3, 1, 16, 16, 1), (False, 6, 3, 2, 16, 24, 1))
    return EffnetConfig(stages=stages, last_channels=32, c_latent=16, affine=False)
