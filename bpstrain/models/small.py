"""Tiny demo models for sklearn's 8x8 digits: train in seconds on a laptop CPU.

Both take ``(N, 1, 8, 8)`` float images, as :func:`bpstrain.models.digits_dataset`
returns them, and output ``(N, num_classes)`` logits.
"""

from __future__ import annotations

import torch
from torch import nn


class DigitsMLP(nn.Module):
    """Two-layer perceptron over the 64 flattened pixels.

    Args:
        hidden: width of the hidden layer.
        num_classes: number of output logits.
        dropout: dropout probability after the hidden layer.
        in_features: pixels per image (64 for 8x8 digits).
    """

    def __init__(self, hidden: int = 128, num_classes: int = 10, dropout: float = 0.0,
                 in_features: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsCNN(nn.Module):
    """Two 3x3 conv layers, a 2x2 pool and a linear head, for 8x8 single-channel images.

    Args:
        channels: channels of the first conv (the second has twice as many).
        num_classes: number of output logits.
    """

    def __init__(self, channels: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Linear(2 * channels * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def digits_mlp(hidden: int = 128, num_classes: int = 10, dropout: float = 0.0) -> DigitsMLP:
    """The digits MLP (64 -> hidden -> num_classes)."""
    return DigitsMLP(hidden=hidden, num_classes=num_classes, dropout=dropout)


def digits_cnn(channels: int = 16, num_classes: int = 10) -> DigitsCNN:
    """The digits CNN (two 3x3 convs, pool, linear)."""
    return DigitsCNN(channels=channels, num_classes=num_classes)
