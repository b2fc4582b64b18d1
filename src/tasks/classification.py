"""Loss and eval outputs shared by the classification tasks (batches of `(inputs, labels)`, models giving logits)."""

import torch
import torch.nn.functional as F
from torch import nn


def training_loss(model: nn.Module, batch) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def eval_outputs(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    inputs, labels = batch
    logits = model(inputs)
    return {
        "loss": F.cross_entropy(logits, labels, reduction="none"),
        "weight": torch.ones_like(labels, dtype=torch.float32),
        "predictions": logits.argmax(dim=-1),
        "references": labels,
    }
