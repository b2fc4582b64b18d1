"""A small CNN for 8x8 digit images (the digits task's model). Replace it with any `nn.Module` returning logits."""

import torch
from torch import nn


def make_norm(kind: str, channels: int) -> nn.Module:
    """batch: BatchNorm (synchronised across processes by the sync_batchnorm feature); group: per-sample; none."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(num_groups=8, num_channels=channels)
    return nn.Identity()


def conv_block(in_channels: int, out_channels: int, norm: str) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=norm == "none"),
        make_norm(norm, out_channels),
        nn.ReLU(inplace=True),
    )


class DigitsCNN(nn.Module):
    """(N, 1, 8, 8) images (any size and `in_channels` work) -> (N, num_labels) logits. No dropout: its masks depend
    on how a batch is split across processes, which breaks the tested "same training on 1 or N processes" guarantee."""

    def __init__(self, num_labels: int = 10, norm: str = "group", width: int = 32, in_channels: int = 1):
        super().__init__()
        self.features = nn.Sequential(
            conv_block(in_channels, width, norm),
            conv_block(width, 2 * width, norm),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            conv_block(2 * width, 2 * width, norm),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(2 * width, num_labels))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))
