"""The data code takes local Parquet/CSV/JSON files or a Hub name, and bad data is a clear error."""

import time

import pandas as pd
import pytest

from src.config import TrainConfig, resolve
from src.data import build_dataloaders as make_loaders
from src.errors import UsageError
from src.tasks import build_task
from tests.conftest import REPO


def build_dataloaders(config: TrainConfig):
    task = build_task(resolve(config))
    return make_loaders(*task.build_datasets(), config, task.collate_fn())


def digits_frame(split: str) -> pd.DataFrame:
    return pd.read_parquet(REPO / f"data/digits/{split}.parquet")


def config_for(files: dict, task_args: dict | None = None, **overrides) -> TrainConfig:
    return TrainConfig(data_files={k: str(v) for k, v in files.items()}, task_args=task_args or {}, **overrides)


def test_shipped_split_sizes():
    assert len(digits_frame("train")) == 1438
    assert len(digits_frame("eval")) == 359  # prime: uneven shards on 2, 3, 4, 8 processes


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_local_formats_load_the_same_tensors(tmp_path, fmt):
    files = {}
    for split in ("train", "eval"):
        frame = digits_frame(split).head(40)
        files[split] = tmp_path / f"{split}.{fmt}"
        frame.to_json(files[split], orient="records", lines=True) if fmt == "json" else frame.to_parquet(files[split])
    train_loader, eval_loader = build_dataloaders(config_for(files, per_device_train_batch_size=8))
    images, labels = next(iter(eval_loader))
    assert images.shape == (40, 1, 8, 8) and labels.shape == (40,)
    assert images.min() >= 0 and images.max() <= 1
    assert len(train_loader) == 5


def test_csv_with_other_column_names(tmp_path):
    files = {}
    for split in ("train", "eval"):
        frame = pd.DataFrame({"x": [[0] * 64] * 4, "digit": [1, 2, 3, 4]})
        files[split] = tmp_path / f"{split}.json"
        frame.to_json(files[split], orient="records", lines=True)
    _, eval_loader = build_dataloaders(config_for(files, {"input_column": "x", "label_column": "digit"}))
    assert next(iter(eval_loader))[1].tolist() == [1, 2, 3, 4]


def write_split_files(tmp_path, frame: pd.DataFrame) -> dict:
    files = {split: tmp_path / f"{split}.parquet" for split in ("train", "eval")}
    for path in files.values():
        frame.to_parquet(path)
    return files


@pytest.mark.parametrize(
    "frame, overrides, message",
    [
        (digits_frame("eval").rename(columns={"label": "y"}), {}, "no column label"),
        (digits_frame("eval").assign(label=11), {}, "labels must lie in 0..9"),
        (digits_frame("eval").head(0), {}, "split is empty|could not read the parquet data files"),
        (digits_frame("eval"), {"eval_split": "validation"}, "no split 'validation'"),
    ],
)
def test_bad_data_is_a_usage_error(tmp_path, frame, overrides, message):
    with pytest.raises(UsageError, match=message):
        build_dataloaders(config_for(write_split_files(tmp_path, frame), **overrides))


def test_missing_file_names_the_split(tmp_path):
    with pytest.raises(UsageError, match="data file for split 'train' not found"):
        build_dataloaders(config_for({"train": tmp_path / "nope.parquet", "eval": tmp_path / "nope.parquet"}))


@pytest.mark.parametrize("offline", ["1", "0"])
def test_hub_dataset_unreachable_fails_fast(monkeypatch, offline):
    """Without network the Hub path must fail at once (datasets alone retries for ~23 s)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens here: unreachable on any machine
    started = time.monotonic()
    with pytest.raises(UsageError, match="HF_HUB_OFFLINE|cannot reach the Hugging Face Hub"):
        build_dataloaders(TrainConfig(dataset_name="someone/never-cached-dataset", data_files=None))
    assert time.monotonic() - started < 15
