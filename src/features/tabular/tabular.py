"""Classify rows of a table (CSV, JSON or Parquet) with an MLP: numeric feature columns -> a class label.

    python train.py --task tabular --data_files '{train: my/train.csv, eval: my/eval.csv}' --label_column species \
        --features '[sepal_length, sepal_width]' --hidden_size 64

Without `features`, every column except the label and the id (`--id_column`) is a feature. The model (an MLP)
standardises them with the train split's mean and standard deviation, held as buffers: a saved model takes raw
features.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from src.data import check_columns, column_tensor, load_tables
from src.errors import UsageError
from src.tasks.classification import ClassificationTask, check_labels


class Tabular(ClassificationTask):
    @dataclass
    class Options:
        label_column: str = "label"  # integer class labels
        features: list[str] | None = None  # feature columns; None: every column but the label and --id_column
        num_labels: int | None = None  # classes; None: the train split's largest label + 1
        hidden_size: int = 64
        num_layers: int = 2  # hidden layers

        def __post_init__(self):
            for name in ("hidden_size", "num_layers", "num_labels"):
                if getattr(self, name) is not None and getattr(self, name) <= 0:  # num_labels may be None
                    raise UsageError(f"--{name} must be > 0 (got {getattr(self, name)})")

    features: list[str] | None = None  # the feature columns, the classes and the train split's statistics: set by
    num_labels: int | None = None  # build_datasets in training, else by build_eval_dataset from the split and options
    mean: torch.Tensor | None = None
    std: torch.Tensor | None = None

    def build_datasets(self) -> tuple[TensorDataset, TensorDataset]:
        tables, label = load_tables(self.config), self.options.label_column
        train, evals = self.config.train_split, self.config.eval_split
        self.features = self.options.features or self.other_columns(tables[train], label)
        (train_x, train_y), (eval_x, eval_y) = (self.to_tensors(tables, name, label) for name in (train, evals))
        self.num_labels = self.options.num_labels or int(train_y.max()) + 1
        check_labels(train_y, self.num_labels, self.config.train_split)
        check_labels(eval_y, self.num_labels, self.config.eval_split)
        self.mean, self.std = train_x.mean(dim=0), train_x.std(dim=0).clamp_min(1e-6)  # the model standardises
        return TensorDataset(train_x, train_y), TensorDataset(eval_x, eval_y)

    def build_eval_dataset(self, split: str, labelled: bool = True) -> TensorDataset:
        """A test or predicted split after build_datasets (its features, classes and statistics stay), or without
        training: the features and labels as named; the standardisation comes with the saved model."""
        tables, label = load_tables(self.config, [split]), self.options.label_column
        self.features = self.features or self.options.features or self.other_columns(tables[split], label)
        inputs, labels = self.to_tensors(tables, split, label if labelled else None)
        self.num_labels = self.num_labels or self.options.num_labels or (int(labels.max()) + 1 if labelled else None)
        if self.num_labels is None:
            raise UsageError("set --num_labels: without training or labels, the model's size is not known")
        if labelled:
            check_labels(labels, self.num_labels, split)
        if self.mean is None:  # without training: placeholders, which loading the saved model replaces
            self.mean, self.std = torch.zeros(len(self.features)), torch.ones(len(self.features))
        return TensorDataset(inputs, labels) if labelled else TensorDataset(inputs)

    def other_columns(self, table, label: str) -> list[str]:
        return [name for name in table.column_names if name not in (label, self.config.id_column)]

    def to_tensors(self, tables, split: str, label: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(features, labels) of one split; `label` None: features only."""
        table = tables[split]
        check_columns(table, [*self.features, *filter(None, [label])], "--features / --label_column", split)
        features = torch.stack([column_tensor(table, f, split).float() for f in self.features], dim=1)
        return features, column_tensor(table, label, split).long() if label else None

    def build_model(self) -> nn.Module:  # after the datasets: sized by the features and labels found there
        network = mlp(len(self.features), self.num_labels, self.options.hidden_size, self.options.num_layers)
        return nn.Sequential(Standardize(self.mean, self.std), network)


class Standardize(nn.Module):
    """(x - mean) / std with the train split's statistics, kept as buffers: saved with the model, so a reloaded model
    takes raw features."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) / self.std).to(x.dtype)  # float32 buffers: bf16 inputs (FSDP2's bf16) stay bf16


def mlp(num_inputs: int, num_outputs: int, hidden_size: int = 64, num_layers: int = 2) -> nn.Sequential:
    """`num_layers` hidden layers of `hidden_size` units with ReLU, then a linear output layer."""
    layers: list[nn.Module] = []
    width = num_inputs
    for _ in range(num_layers):
        layers += [nn.Linear(width, hidden_size), nn.ReLU()]
        width = hidden_size
    return nn.Sequential(*layers, nn.Linear(width, num_outputs))
