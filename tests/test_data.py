"""The data code takes local Parquet/CSV/JSON files or a Hub name, and bad data is a clear error."""

import itertools

import httpx
import huggingface_hub
import huggingface_hub.constants
import numpy as np
import pandas as pd
import pytest
import torch

from src.cli import resolve
from src.config import TrainConfig
from src.data import column_tensor, load_tables
from src.errors import UsageError
from src.loaders import build_dataloaders as make_loaders
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


def datasets_for(files: dict, task: str = "digits", task_args: dict | None = None):
    """The (train, eval) TensorDatasets the task builds from these files."""
    return build_task(resolve(config_for(files, task_args, task=task))).build_datasets()


def test_local_formats_load_the_same_tensors(tmp_path):
    frames = {split: digits_frame(split).head(40) for split in ("train", "eval")}
    loaded = {}
    for fmt in ("parquet", "json", "jsonl"):
        files = {split: tmp_path / f"{split}.{fmt}" for split in frames}
        for split, frame in frames.items():
            if fmt == "parquet":
                frame.to_parquet(files[split])
            else:
                frame.to_json(files[split], orient="records", lines=True)
        loaded[fmt] = [dataset.tensors for dataset in datasets_for(files)]
    for split_index, frame in enumerate(frames.values()):
        images = torch.tensor(np.stack(frame["pixels"]), dtype=torch.float32).div(16.0).view(-1, 1, 8, 8)
        labels = torch.tensor(frame["label"].to_numpy(), dtype=torch.long)
        for fmt, splits in loaded.items():
            got_images, got_labels = splits[split_index]
            assert torch.equal(got_images, images) and torch.equal(got_labels, labels), fmt


def test_data_loaders_batch_the_files(tmp_path):
    files = {}
    for split in ("train", "eval"):
        files[split] = tmp_path / f"{split}.parquet"
        digits_frame(split).head(40).to_parquet(files[split])
    train_loader, eval_loader = build_dataloaders(config_for(files, per_device_train_batch_size=8))
    images, labels = next(iter(eval_loader))
    assert images.shape == (40, 1, 8, 8) and labels.shape == (40,)
    assert images.min() >= 0 and images.max() <= 1
    assert len(train_loader) == 5


def test_parquet_columns_are_the_tensors_datasets_gives(tmp_path):
    """Tensor tasks read Parquet with pyarrow (no `datasets` import): every column type they take comes out as
    datasets' torch format has it, dtype included, over several row groups; missing floats as NaN."""
    import datasets
    import pyarrow as pa

    frame = pd.DataFrame({
        "ints": np.array([3, -1, 7], dtype=np.int32), "floats": [0.5, np.nan, 1e-8], "flags": [True, False, True],
        "lists": [[1, 2], [3, 4], [5, 6]], "float_lists": [[0.1, 0.2], [0.3, 0.4], [0.5, np.nan]],
        "grids": [[[1, 2], [3, 4]], [[5, 6], [7, 8]], [[9, 0], [1, 2]]], "bytes": np.array([1, 2, 255], dtype=np.uint8),
    })  # fmt: skip
    frame.to_parquet(tmp_path / "t.parquet", row_group_size=1)
    table = load_tables(config_for({"train": tmp_path / "t.parquet"}), ["train"])["train"]
    chunked = pa.concat_tables([table.slice(0, 1), table.slice(1)])  # as datasets' tables come: chunks, slices
    assert chunked.column("ints").num_chunks == 2
    reference = datasets.Dataset.from_parquet(str(tmp_path / "t.parquet")).with_format("torch")[:]
    for name, read in itertools.product(frame.columns, (table, chunked)):
        ours, theirs = column_tensor(read, name, "train", missing_as_nan=True), reference[name]
        assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype), name
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True, msg=name)


def test_only_the_columns_asked_for_are_read(tmp_path):
    pd.DataFrame({"id": ["a", "b"], "pixels": [[1, 2], [3, 4]]}).to_parquet(tmp_path / "t.parquet")
    config = config_for({"train": tmp_path / "t.parquet"})
    assert load_tables(config, ["train"], columns=["id", "none"])["train"].column_names == ["id"]
    assert load_tables(config, ["train"], columns=["none"])["train"].num_columns == 0
    assert load_tables(config, ["train"])["train"].column_names == ["id", "pixels"]


@pytest.mark.parametrize(
    "values, message, missing_as_nan",
    [
        (["a", "b"], "column 'x' of the train split holds string, not numbers; choose a numeric column, or", True),
        ([1, None], "column 'x' has a missing value in the train split; fill them or drop the rows", True),
        ([1.0, None], "column 'x' has a missing value in the train split", False),  # the default: no silent NaN
        ([[1], [1, 2]], "column 'x' of the train split holds lists of different lengths", True),
        ([[[1], [2]], [[1, 2]]], "column 'x' of the train split holds lists of different lengths", True),
    ],
)
def test_a_column_that_is_no_tensor_is_a_usage_error(values, message, missing_as_nan):
    import pyarrow as pa

    with pytest.raises(UsageError, match=message):
        column_tensor(pa.table({"x": values}), "x", "train", missing_as_nan=missing_as_nan)


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
        (digits_frame("eval"), {"eval_split": "validation", "do_eval": False}, "--eval_split train will do"),
    ],
)
def test_bad_data_is_a_usage_error(tmp_path, frame, overrides, message):
    with pytest.raises(UsageError, match=message):
        build_dataloaders(config_for(write_split_files(tmp_path, frame), **overrides))


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_splits_with_different_columns_are_named_with_theirs(tmp_path, fmt):
    """A train file without the label column beside an eval file with it: each split's columns, not datasets' words."""
    files = {split: tmp_path / f"{split}.{fmt}" for split in ("train", "eval")}
    frame = digits_frame("eval").head(8).assign(pixels=lambda f: f["pixels"].map(len))  # CSV: no lists
    for split, data in {"train": frame.drop(columns=["label"]), "eval": frame}.items():
        data.to_csv(files[split], index=False) if fmt == "csv" else data.to_json(
            files[split], orient="records", lines=True
        )
    builder = "csv" if fmt == "csv" else "json"
    with pytest.raises(UsageError) as refused:
        build_dataloaders(config_for(files))
    columns = "(train: pixels; eval: pixels, label)"
    assert (
        str(refused.value) == f"the {builder} files of the splits have different columns {columns}; give them the same"
    )


def test_missing_file_names_the_split(tmp_path):
    with pytest.raises(UsageError, match="data file for split 'train' not found"):
        build_dataloaders(config_for({"train": tmp_path / "nope.parquet", "eval": tmp_path / "nope.parquet"}))
    with pytest.raises(UsageError, match=r"data file for split 'train' is a pattern \(.*/\*\.parquet\): name one file"):
        build_dataloaders(config_for({"train": tmp_path / "*.parquet", "eval": tmp_path / "nope.parquet"}))


def test_hub_dataset_offline_names_the_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(UsageError) as info:
        build_dataloaders(TrainConfig(dataset_name="someone/never-cached-dataset", data_files=None))
    assert str(info.value) == (
        "dataset 'someone/never-cached-dataset' is not in the local cache and HF_HUB_OFFLINE is set; use --data_files"
    )


@pytest.mark.parametrize("setting", ["0", "false"])  # not offline, as huggingface_hub reads it
def test_hub_dataset_unreachable_asks_once_with_a_timeout(monkeypatch, tmp_path, setting):
    """Without network the Hub path fails after one request with a timeout: `datasets` alone retries for ~23 s."""
    monkeypatch.setenv("HF_HUB_OFFLINE", setting)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    calls = []

    def unreachable(self, repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        raise httpx.ConnectError("[Errno 101] Network is unreachable")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    with pytest.raises(UsageError) as info:
        build_dataloaders(TrainConfig(dataset_name="someone/never-cached-dataset", data_files=None))
    assert len(calls) == 1  # no retry
    repo_id, kwargs = calls[0]
    assert repo_id == "someone/never-cached-dataset"
    assert kwargs.get("timeout") is not None and 0 < kwargs["timeout"] <= 10
    assert str(info.value).startswith(
        "cannot reach the Hugging Face Hub for dataset 'someone/never-cached-dataset' (ConnectError); "
    )


class Epochs:
    """A stand-in for LoaderBatches: epoch e holds the batches (e, 0), (e, 1), ... (`size` of them)."""

    def __init__(self, size: int):
        self.size = size

    def epoch(self, epoch: int, skip: int = 0):
        return iter([(epoch, i) for i in range(skip, self.size)])


def test_train_windows_are_whole_accumulation_windows_epoch_after_epoch():
    from itertools import islice

    from src.batches import DataPosition, train_windows

    position = DataPosition()
    windows = list(islice(train_windows(Epochs(5), 2, position), 5))  # 5 batches: 2 windows an epoch, 1 left over
    assert windows == [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(1, 0), (1, 1)], [(1, 2), (1, 3)], [(2, 0), (2, 1)]]
    assert (position.epoch, position.steps) == (2, 1)  # counted before the step trains on it: a checkpoint follows
    resumed = DataPosition(1, 1)  # as a checkpoint after step 3 holds it, or as step 3 gives for 2 steps an epoch
    assert list(islice(train_windows(Epochs(5), 2, resumed), 2)) == windows[3:5]


def test_train_data_smaller_than_one_window_is_a_usage_error():
    from src.batches import DataPosition, train_windows

    with pytest.raises(UsageError, match="fewer samples than one global batch"):
        next(train_windows(Epochs(1), 2, DataPosition()))


def test_a_train_split_that_leaves_much_out_of_each_epoch_is_warned_about(caplog):
    from torch.utils.data import DataLoader, TensorDataset

    from src.loaders import check_split_sizes

    def loader(rows: int):
        return DataLoader(TensorDataset(torch.zeros(rows, 1)))

    check_split_sizes(loader(138), loader(1), global_batch=64)  # 10 of 138 left out: no word
    assert "left out" not in caplog.text
    check_split_sizes(loader(120), None, global_batch=64)
    assert "the train split's 120 samples fill 1 global batches of 64 an epoch: 56 (47%) are left out" in caplog.text
