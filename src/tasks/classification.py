"""Classification: `(inputs, labels)` batches and a model mapping inputs to logits; class names beside weights."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from src.errors import UsageError
from src.tasks.base import Task


class ClassificationTask(Task):
    """Cross-entropy on `(inputs, labels)` batches, accuracy as the metric. Subclasses build the data and model."""

    metrics = ["accuracy"]

    def logits(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """The model's (N, classes) logits; a transformers model returns them inside its output."""
        return model(inputs)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(self.logits(model, inputs), labels)

    def eval_outputs(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        logits = self.logits(model, inputs)
        return {
            "loss": F.cross_entropy(logits, labels, reduction="none"),
            "weight": torch.ones_like(labels, dtype=torch.float32),
            "predictions": logits.argmax(dim=-1),
            "references": labels,
        }

    def predict(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        probabilities = self.logits(model, batch[0]).float().softmax(dim=-1)  # batch[0]: the inputs, labelled or not
        return {"prediction": probabilities.argmax(dim=-1), "probabilities": probabilities}


def check_labels(labels: torch.Tensor, num_labels: int, split: str) -> None:
    if num_labels < 1:
        raise UsageError(f"--num_labels must be > 0 (got {num_labels})")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_labels):
        raise UsageError(
            f"labels must lie in 0..{num_labels - 1} but range {labels.min()}..{labels.max()} in the {split} split; "
            "set --num_labels"
        )


LABELS_FILE = "labels.json"  # class names beside weights whose own config has none (a plain network, an adapter)


def label_maps(labels: list) -> dict:
    """The class names in id order -> `id2label` / `label2id`, as transformers' configs and loaders take them."""
    id2label = {i: str(label) for i, label in enumerate(labels)}
    return {"id2label": id2label, "label2id": {name: i for i, name in id2label.items()}}


def save_labels(directory: Path, labels: list) -> None:
    (Path(directory) / LABELS_FILE).write_text(json.dumps(label_maps(labels), indent=2) + "\n")


def saved_labels(directory: str | Path) -> list[str] | None:
    """The class names save_labels wrote into `directory`, in id order; None where it wrote none."""
    path = Path(directory) / LABELS_FILE
    return list(json.loads(path.read_text())["id2label"].values()) if path.is_file() else None
