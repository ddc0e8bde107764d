"""VGG-16 in plain torch, layer for layer as torchvision builds it.

``features`` / ``avgpool`` / ``classifier`` are ``nn.Sequential`` with torchvision's
indices, so ``state_dict`` keys (``features.0.weight`` ... ``classifier.6.bias``)
match. VGG-16 with 1000 classes has 138,357,544 parameters, 124M of them in the
classifier: the classic communication-bound model for parameter servers.
"""

from __future__ import annotations

from typing import List, Union

import torch
from torch import nn

# Configuration "D" of Simonyan & Zisserman: channels per conv, "M" = 2x2 max-pool.
_VGG16: List[Union[int, str]] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                                 512, 512, 512, "M", 512, 512, 512, "M"]


def _make_features(cfg: List[Union[int, str]], batch_norm: bool) -> nn.Sequential:
    layers: List[nn.Module] = []
    in_channels = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        layers.append(nn.Conv2d(in_channels, int(v), kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(int(v)))
        layers.append(nn.ReLU(inplace=True))
        in_channels = int(v)
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """VGG for ``(N, 3, H, W)`` images; adaptive pooling makes any H, W >= 32 work.

    Args:
        features: the convolutional trunk (see :func:`vgg16`).
        num_classes: size of the final linear layer.
        dropout: dropout probability of the two hidden classifier layers.
    """

    def __init__(self, features: nn.Module, num_classes: int = 1000,
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def vgg16(num_classes: int = 1000, dropout: float = 0.5) -> VGG:
    """VGG-16 (138,357,544 parameters at 1000 classes), torchvision layout."""
    return VGG(_make_features(_VGG16, batch_norm=False), num_classes, dropout)


def vgg16_bn(num_classes: int = 1000, dropout: float = 0.5) -> VGG:
    """VGG-16 with BatchNorm (138,365,992 parameters at 1000 classes)."""
    return VGG(_make_features(_VGG16, batch_norm=True), num_classes, dropout)
