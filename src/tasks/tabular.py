"""Classify rows of a table (CSV, JSON or Parquet) with an MLP: numeric feature columns -> a class label.

    python train.py --task tabular --data_files '{train: my/train.csv, eval: my/eval.csv}' --label_column label \
        --num_labels 3 --task_args '{features: [age, income, score], hidden_size: 64}'

Without `features`, every column except the label is a feature. Features are standardised with the train split's
mean and standard deviation (computed once, in memory).
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from src.config import TrainConfig, parse_task_args
from src.data import load_splits
from src.errors import UsageError
from src.tasks.classification import eval_outputs, training_loss  # noqa: F401 (this task's loss and eval)

METRICS = ["accuracy"]


@dataclass
class TabularArgs:
    features: list[str] | None = None
    hidden_size: int = 64
    num_layers: int = 2


def task_args(config: TrainConfig) -> TabularArgs:
    return parse_task_args(TabularArgs, config)


def feature_columns(config: TrainConfig, columns: list[str]) -> list[str]:
    features = task_args(config).features or [c for c in columns if c != config.label_column]
    missing = set([*features, config.label_column]) - set(columns)
    if missing:
        raise UsageError(
            f"the data has no column {', '.join(sorted(missing))}; set --task_args features / --label_column"
        )
    return features


def build_datasets(config: TrainConfig) -> tuple[TensorDataset, TensorDataset]:
    splits = load_splits(config)
    train, evals = splits[config.train_split], splits[config.eval_split]
    features = feature_columns(config, train.column_names)
    train_x, train_y = to_tensors(train, features, config.label_column)
    eval_x, eval_y = to_tensors(evals, features, config.label_column)
    mean, std = train_x.mean(dim=0), train_x.std(dim=0).clamp_min(1e-6)
    for labels in (train_y, eval_y):
        if labels.min() < 0 or labels.max() >= config.num_labels:
            raise UsageError(f"labels must lie in 0..{config.num_labels - 1}; set --num_labels")
    return TensorDataset((train_x - mean) / std, train_y), TensorDataset((eval_x - mean) / std, eval_y)


def to_tensors(split, features: list[str], label: str) -> tuple[torch.Tensor, torch.Tensor]:
    columns = split.with_format("torch", columns=[*features, label])[:]
    return torch.stack([columns[f].float() for f in features], dim=1), columns[label].long()


def build_model(config: TrainConfig) -> nn.Module:
    args = task_args(config)
    num_features = len(feature_columns(config, load_splits(config)[config.train_split].column_names))
    layers: list[nn.Module] = [nn.Linear(num_features, args.hidden_size), nn.ReLU()]
    for _ in range(args.num_layers - 1):
        layers += [nn.Linear(args.hidden_size, args.hidden_size), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(args.hidden_size, config.num_labels))
