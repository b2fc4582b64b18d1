"""Classify rows of a table (CSV, JSON or Parquet) with an MLP: numeric feature columns -> a class label.

    python train.py --task tabular --data_files '{train: my/train.csv, eval: my/eval.csv}' --label_column species \
        --features '[sepal_length, sepal_width]' --hidden_size 64

Without `features`, every column except the label is a feature. Features are standardised with the train split's
mean and standard deviation (computed once, in memory). The model is src/models/mlp.py.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from src.data import check_columns, load_splits
from src.errors import UsageError
from src.models.mlp import mlp
from src.tasks.classification import ClassificationTask, check_labels


class Tabular(ClassificationTask):
    @dataclass
    class Options:
        label_column: str = "label"  # integer class labels
        features: list[str] | None = None  # feature columns; None: every column except the label
        num_labels: int | None = None  # classes; None: the train split's largest label + 1
        hidden_size: int = 64
        num_layers: int = 2  # hidden layers

        def __post_init__(self):
            for name in ("hidden_size", "num_layers", "num_labels"):
                if (getattr(self, name) or 1) <= 0:
                    raise UsageError(f"--{name} must be > 0 (got {getattr(self, name)})")

    def build_datasets(self) -> tuple[TensorDataset, TensorDataset]:
        splits = load_splits(self.config)
        train, evals = splits[self.config.train_split], splits[self.config.eval_split]
        label = self.options.label_column
        self.features = self.options.features or [c for c in train.column_names if c != label]
        for split in (train, evals):
            check_columns(split, [*self.features, label], "--features / --label_column")
        (train_x, train_y), (eval_x, eval_y) = (self.to_tensors(split) for split in (train, evals))
        self.num_labels = self.options.num_labels or int(train_y.max()) + 1
        check_labels(train_y, self.num_labels, self.config.train_split)
        check_labels(eval_y, self.num_labels, self.config.eval_split)
        mean, std = train_x.mean(dim=0), train_x.std(dim=0).clamp_min(1e-6)
        return TensorDataset((train_x - mean) / std, train_y), TensorDataset((eval_x - mean) / std, eval_y)

    def to_tensors(self, split) -> tuple[torch.Tensor, torch.Tensor]:
        columns = split.with_format("torch", columns=[*self.features, self.options.label_column])[:]
        features = torch.stack([columns[f].float() for f in self.features], dim=1)
        return features, columns[self.options.label_column].long()

    def build_model(self) -> nn.Module:  # after build_datasets: sized by the features and labels found there
        return mlp(len(self.features), self.num_labels, self.options.hidden_size, self.options.num_layers)
