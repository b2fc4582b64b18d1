"""The default example: the 8x8 handwritten digits in data/digits (or any image-like table), read once into tensors."""

from dataclasses import dataclass
from typing import Literal

from torch import nn
from torch.utils.data import TensorDataset

from src.data import check_columns, column_tensor, load_tables
from src.errors import UsageError
from src.models.digits_cnn import DigitsCNN
from src.tasks.classification import ClassificationTask, check_labels


class Digits(ClassificationTask):
    @dataclass
    class Options:
        input_column: str = "pixels"  # 64 pixel values 0..16 per row
        label_column: str = "label"  # integer class labels
        num_labels: int = 10  # classes; labels must lie in 0..num_labels-1
        model: Literal["cnn", "linear"] = "cnn"  # linear: logistic regression on the pixels, a baseline
        norm: Literal["batch", "group", "none"] = "group"  # group: no cross-sample statistics, exact on N processes

    default_data_files = {"train": "data/digits/train.parquet", "eval": "data/digits/eval.parquet"}

    def build_datasets(self) -> tuple[TensorDataset, TensorDataset]:
        tables = load_tables(self.config)
        return self.to_tensors(tables, self.config.train_split), self.to_tensors(tables, self.config.eval_split)

    def build_eval_dataset(self, split: str, labelled: bool = True) -> TensorDataset:
        return self.to_tensors(load_tables(self.config, [split]), split, labelled)

    def to_tensors(self, tables, name: str, labelled: bool = True) -> TensorDataset:
        """One split -> (inputs, labels), or (inputs,) unlabelled: 64 pixel values 0..16 -> 1x8x8 floats in [0, 1]."""
        table, options = tables[name], self.options
        check_columns(table, [options.input_column, *([options.label_column] if labelled else [])],
                      "--input_column / --label_column", name)  # fmt: skip
        inputs = column_tensor(table, options.input_column, name)
        if inputs.shape[1:] != (64,):
            held = f"{inputs[0].numel()} values" if inputs.ndim > 1 else "one value"
            raise UsageError(f"column {options.input_column!r} of the {name} split holds {held} a row, not the 64 "
                             "pixels of an 8x8 digit; set --input_column")  # fmt: skip
        inputs = inputs.float().div(16.0).view(-1, 1, 8, 8)
        if not labelled:
            return TensorDataset(inputs)
        labels = column_tensor(table, options.label_column, name).long()
        check_labels(labels, options.num_labels, name)
        return TensorDataset(inputs, labels)

    def build_model(self) -> nn.Module:
        if self.options.model == "linear":  # a baseline, and the overhead-bound case of scripts/benchmark.py
            return nn.Sequential(nn.Flatten(), nn.Linear(64, self.options.num_labels))
        return DigitsCNN(num_labels=self.options.num_labels, norm=self.options.norm)
