"""A task's data: `datasets.load_dataset` (local files, image folders, the Hub) or, for tensors, pyarrow Tables."""

import contextlib
from pathlib import Path

from src.config import TrainConfig
from src.errors import UsageError, one_line
from src.hub import check_hub_repo

FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}
FOLDER_BUILDER = "imagefolder"  # a folder as a split's data_files: its images, labelled by their class subfolders
LOCAL_BUILDERS = {*FILE_BUILDERS.values(), FOLDER_BUILDER}  # --dataset_name naming one reads --data_files, not the Hub


def load_splits(config: TrainConfig, names: list[str] | None = None):
    """A `datasets.DatasetDict` of the splits `names` (default: train and eval); other splits' files are not read."""
    import datasets

    datasets.disable_progress_bars()
    names = names or [config.train_split, config.eval_split]
    files, builder = local_files(config, names)
    if builder == FOLDER_BUILDER:  # datasets reads a folder's files through a pattern
        files = {split: str(Path(folder) / "**") for split, folder in files.items()}
    if builder is None:
        splits = load_hub_dataset(config)
        if missing := [name for name in names if name not in splits]:
            raise missing_split(config, missing[0], list(splits))
    else:
        try:
            splits = load_files(builder, files)
        except datasets.exceptions.DatasetGenerationError as err:
            raise unreadable_splits(builder, files, err) from err
    for split in names:
        check_rows(len(splits[split]), split)
    return splits


def load_files(builder: str, files: dict[str, str]):
    """`datasets.load_dataset` of local files, its log lines left out (the error says it); no rows is one line."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        return datasets.load_dataset(builder, data_files=files)
    except (ValueError, StopIteration) as err:  # 'Instruction "train" corresponds to no data!'; an empty JSON file
        if isinstance(err, ValueError) and "corresponds to no data" not in str(err):
            raise
        what = "images in class subfolders" if builder == FOLDER_BUILDER else "rows"
        listed = ", ".join(f"{split}: {str(path).removesuffix('/**')}" for split, path in files.items())
        raise UsageError(f"the {builder} data files hold no {what} ({listed}); check --data_files") from err
    finally:
        datasets.logging.set_verbosity(verbosity)


def load_tables(config: TrainConfig, names: list[str] | None = None, columns: list[str] | None = None) -> dict:
    """The splits `names` (default: train and eval) as pyarrow Tables of those of `columns` they have (None: all); local
    Parquet is read by pyarrow, as datasets' builder does, without importing `datasets`."""
    names = names or [config.train_split, config.eval_split]
    files, builder = local_files(config, names)
    if builder != "parquet":
        splits = load_splits(config, names)
        return {name: splits[name].data.table.select(present(columns, splits[name].column_names)) for name in names}
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = {}
    for split, path in files.items():
        try:  # one file; read_table would import pyarrow.dataset and pandas
            with pq.ParquetFile(path) as parquet:
                check_rows(parquet.metadata.num_rows, split)
                tables[split] = parquet.read(columns=present(columns, parquet.schema_arrow.names))
        except pa.ArrowException as err:
            raise unreadable("parquet", err) from err
    return tables


def present(columns: list[str] | None, names: list[str]) -> list[str]:
    return names if columns is None else [name for name in columns if name in names]


def local_files(config: TrainConfig, names: list[str]) -> tuple[dict[str, str], str | None]:
    """The files of splits `names` (split -> file or folder) and their `datasets` builder; ({}, None) for the Hub."""
    if not reads_local_files(config):
        return {}, None
    if missing := [name for name in names if name not in config.data_files]:
        raise missing_split(config, missing[0], list(config.data_files))
    files = {split: config.data_files[split] for split in names}
    builder = file_builder(files)
    if config.dataset_name not in (None, builder):
        raise UsageError(f"--dataset_name {config.dataset_name} does not read {builder} data_files; drop it")
    return files, builder


def unreadable(builder: str, cause: BaseException) -> UsageError:
    return UsageError(f"could not read the {builder} data files ({one_line(cause)}); check --data_files")


def unreadable_splits(builder: str, files: dict[str, str], err: Exception) -> UsageError:
    """datasets reads the splits as one table: if each file reads alone, their columns differ; say each split's."""
    import datasets

    columns = {}
    if len(files) > 1:
        with contextlib.suppress(datasets.exceptions.DatasetGenerationError):
            columns = {split: load_files(builder, {split: file})[split].column_names for split, file in files.items()}
    if len({frozenset(names) for names in columns.values()}) > 1:
        listed = "; ".join(f"{split}: {', '.join(names)}" for split, names in columns.items())
        return UsageError(f"the {builder} files of the splits have different columns ({listed}); give them the same")
    return unreadable(builder, err.__cause__ or err)


def check_rows(rows: int, split: str) -> None:
    if rows == 0:
        raise UsageError(f"the {split!r} split is empty; point --data_files or --dataset_name at data with rows")


def column_tensor(table, name: str, split: str, missing_as_nan: bool = False):
    """A Table's column as datasets' torch format gives it: int64, float32 or bool, equal-length lists a dimension each;
    a missing value is refused, or NaN if a float and `missing_as_nan`. DLPack: to_numpy() would import pandas."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import torch

    column, shape = table.column(name).combine_chunks(), [len(table)]
    if len(column) and column.null_count == len(column):
        raise absent_column(name, split)
    while isinstance(column.type, (pa.ListType, pa.LargeListType, pa.FixedSizeListType)):
        lengths = pc.unique(pc.list_value_length(column))
        if column.null_count or len(lengths) > 1:
            raise UsageError(f"column {name!r} of the {split} split holds lists of different lengths or none")
        column, shape = column.flatten(), [*shape, lengths[0].as_py() if len(lengths) else 0]
    if column.null_count and pa.types.is_floating(column.type) and missing_as_nan:  # as datasets gives them
        column = pc.fill_null(column, float("nan"))
    if column.null_count:
        raise missing_values(name, column.null_count, split)
    if is_bool := pa.types.is_boolean(column.type):  # bit-packed in Arrow: DLPack takes bytes
        column = pc.cast(column, pa.uint8())
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise UsageError(
            f"column {name!r} of the {split} split holds {column.type}, not numbers; choose a numeric column, or turn "
            "its values into numbers in the task (class names into ids: src/tasks/classification.py's label_maps)"
        )
    dtype = torch.bool if is_bool else torch.int64 if pa.types.is_integer(column.type) else torch.float32
    return torch.from_dlpack(column).view(shape).to(dtype, copy=True)  # a copy: Arrow's memory is read-only


def reads_local_files(config: TrainConfig) -> bool:
    """Whether --data_files are read, never the Hub: no --dataset_name, or a local builder's (`imagefolder`, ...)."""
    if config.dataset_name not in (None, *LOCAL_BUILDERS):
        return False
    if not config.data_files:
        if config.dataset_name is None:
            raise no_data(config)
        raise UsageError(
            f"--dataset_name {config.dataset_name} reads local files: set --data_files, e.g. "
            "'{train: data/my_images/train, eval: data/my_images/eval}'"
        )
    return True


def no_data(config: TrainConfig) -> UsageError:
    return UsageError(f"no data for --task {config.task}: set --data_files (local files) or --dataset_name")


def has_split(config: TrainConfig, name: str) -> bool:
    """Whether the data holds split `name` (the optional test split); False for the task's own data."""
    if not (config.data_files or config.dataset_name):
        return False
    return name in (config.data_files if reads_local_files(config) else load_hub_dataset(config))


def missing_split(config: TrainConfig, name: str, available: list[str]) -> UsageError:
    """The error for a split the data lacks (read in full or streamed), naming the flag that fixes it."""
    if name == config.train_split:
        flag = "--train_split"
    elif name == config.eval_split and config.do_train and not config.do_eval:  # a task's build_datasets reads it
        flag = "--eval_split (the task reads one to train, evaluated or not: --eval_split train will do)"
    elif name == config.eval_split:
        flag = "--eval_split" if config.do_train else "--eval_split (or --do_eval false)"
    else:
        flag = "--test_split"
    where = "set" if config.dataset_name else "add it to --data_files or set"
    return UsageError(f"the data has no split {name!r} (it has {', '.join(available)}); {where} {flag}")


def file_builder(data_files: dict[str, str]) -> str:
    """The `datasets` builder for local files, from their extension (a folder: imagefolder); one for all splits."""
    suffixes = set()
    for split, path in data_files.items():
        if not str(path).strip():  # Path("") is the working directory: read as a folder of images
            raise UsageError(f"data file for split {split!r} is empty text; name a file, or a folder of images")
        if any(character in str(path) for character in "*?[") and not Path(path).exists():
            raise UsageError(
                f"data file for split {split!r} is a pattern ({path}): name one file, or a folder of images"
            )
        if not (Path(path).is_dir() or Path(path).is_file()):
            raise UsageError(
                f"data file for split {split!r} not found: {path} (set --data_files or run from the repo root)"
            )
        suffixes.add("a folder" if Path(path).is_dir() else Path(path).suffix.lower())
    if len(suffixes) != 1 or not suffixes <= {*FILE_BUILDERS, "a folder"}:
        raise UsageError(
            f"data_files must all be one of {', '.join(FILE_BUILDERS)} or all folders of images (got "
            f"{', '.join(sorted(suffixes))})"
        )
    return FILE_BUILDERS.get(suffixes.pop(), FOLDER_BUILDER)  # or "a folder"


def load_hub_dataset(config: TrainConfig):
    """Fail in a second, not after ~23 s of retries, when the Hub can't be reached and nothing is cached."""
    import datasets

    check_hub_repo(config.dataset_name, "dataset", flag="--dataset_name", instead="use --data_files")
    return datasets.load_dataset(config.dataset_name, config.dataset_config_name)


class MissingColumns(UsageError):
    """A split lacks columns the task reads, or an image folder its class subfolders (a test split without its labels
    is only predicted: src/loaders.py); `what`: which, without the fix."""

    def __init__(self, what: str, fix: str):
        super().__init__(f"{what}; {fix}")
        self.what = what


def check_columns(split, wanted: list[str], flags: str, name: str | None = None) -> None:
    """`split` (a Table or `datasets.Dataset`; `name`: which split) has the columns `wanted`, else one line: `flags`."""
    if missing := set(wanted) - set(split.column_names):
        where = f"the {name} split" if name else "the data"
        what = f"{where} has no column {', '.join(sorted(missing))} (it has {', '.join(split.column_names)})"
        raise MissingColumns(what, f"set {flags}")


def check_complete(split, columns: list[str], name: str) -> None:
    """No missing value in `columns` of a `datasets.Dataset`, split `name`: a tokenizer or image decoder would crash."""
    for column in columns:
        if count := split.data.column(column).null_count:
            raise absent_column(column, name) if count == len(split) else missing_values(column, count, name)


def absent_column(column: str, split: str) -> MissingColumns:
    """A column without a single value: how `datasets` reads a CSV or JSON file lacking it beside files with it."""
    return MissingColumns(f"the {split} split has no column {column!r} (no row has a value)", "add it to its file")


def missing_values(column: str, count: int, split: str) -> UsageError:
    values = "a missing value" if count == 1 else f"{count} missing values"
    return UsageError(f"column {column!r} has {values} in the {split} split; fill them or drop the rows")
