"""The default example: classify the 8x8 handwritten digits shipped in data/digits (or any image-like table).

Edit `to_tensors` for your own preprocessing and src/model.py for your own model.
"""

from torch import nn
from torch.utils.data import TensorDataset

from src.config import TrainConfig
from src.data import load_splits
from src.errors import UsageError
from src.model import build_model as build_digits_model
from src.tasks.classification import eval_outputs, training_loss  # noqa: F401 (this task's loss and eval)

METRICS = ["accuracy"]


def build_datasets(config: TrainConfig) -> tuple[TensorDataset, TensorDataset]:
    """Small data sets live in memory as tensors: no per-sample decoding in the training loop."""
    splits = load_splits(config)
    return to_tensors(splits[config.train_split], config), to_tensors(splits[config.eval_split], config)


def to_tensors(split, config: TrainConfig) -> TensorDataset:
    """One split -> (inputs, labels). The digits: 64 pixel values 0..16 -> 1x8x8 floats in [0, 1]."""
    missing = {config.input_column, config.label_column} - set(split.column_names)
    if missing:
        raise UsageError(
            f"the data has no column {', '.join(sorted(missing))} (it has {', '.join(split.column_names)}); "
            "set --input_column / --label_column"
        )
    columns = split.with_format("torch", columns=[config.input_column, config.label_column])[:]
    inputs = columns[config.input_column].float().div(16.0).view(-1, 1, 8, 8)
    labels = columns[config.label_column].long()
    if labels.min() < 0 or labels.max() >= config.num_labels:
        raise UsageError(
            f"labels must lie in 0..{config.num_labels - 1} but range {labels.min()}..{labels.max()}; set --num_labels"
        )
    return TensorDataset(inputs, labels)


def build_model(config: TrainConfig) -> nn.Module:
    return build_digits_model(config)
