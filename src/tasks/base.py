"""The task contract (guide: docs/customize.md): one class in one file, built once per run (so it can keep state on
`self`); train.py calls only these methods. Base classes: ClassificationTask, HuggingFaceTask (src/features/hf/)."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from traceback import walk_tb
from typing import TYPE_CHECKING, ClassVar

from src.data import load_tables
from src.errors import RunStopped, TaskFailed, UsageError, describe, one_line
from src.final_model import load_weights

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from src.config import TrainConfig


@dataclass
class NoOptions:
    """A task without options of its own."""


class Task:
    """`self.config`: the run's TrainConfig; `self.options`: its parsed `Options`. Bad input: raise UsageError."""

    Options: ClassVar[type] = NoOptions  # a dataclass; its fields become --flags (names must differ from TrainConfig's)
    metrics: ClassVar[list[str]] = []  # src/metrics.py names, computed from eval_outputs' predictions and references
    # "sum": loss() sums its count_items(batch) terms; the loop divides by the global batch's: same on 1 and N processes
    loss_reduction: ClassVar[str] = "mean"
    export_checkpoints: ClassVar[bool] = False  # True: save_model() also into every checkpoint (step_<N>/model/)
    default_data_files: ClassVar[dict[str, str] | None] = None  # used when neither data_files nor dataset_name is set

    def __init__(self, config: TrainConfig, options=None):
        self.config, self.options = config, self.Options() if options is None else options

    # --- must ---
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, eval) map-style datasets. Tensors in memory are the fast path: no per-sample work per step."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_datasets()")

    def build_model(self) -> nn.Module:
        """In training, called after build_datasets: a model can be sized from the data (features, labels)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        """The training loss of one micro-batch: a scalar, its mean (or, with loss_reduction "sum", its sum)."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss()")

    def eval_outputs(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Per-sample tensors (dim 0: the batch): "loss" (summed over its terms), "weight" (its terms: 1 for a label,
        the token count for text; eval/loss = sum(loss) / sum(weight)); with `metrics`, "predictions", "references"."""
        raise NotImplementedError(f"{type(self).__name__} must implement eval_outputs()")

    # --- may: defaults, or needed only where used (eval-only runs, test splits, predict) ---
    def count_items(self, batch) -> torch.Tensor:
        """With loss_reduction "sum": how many terms loss() summed over (e.g. the tokens with a label)."""
        raise NotImplementedError(f"{type(self).__name__} has loss_reduction 'sum' and must implement count_items()")

    def build_eval_dataset(self, split: str, labelled: bool = True) -> Dataset:
        """One split (test, or eval when not training) without reading train; `labelled` False: it may lack labels."""
        raise UsageError(
            f"--task {type(self).__name__} has no build_eval_dataset(split, labelled), which evaluating without "
            "training, a test split and --do_predict need: implement it (docs/customize.md)"
        )

    def load_model(self, path: str) -> nn.Module:
        """`--model_name_or_path`: build_model() with the weights of a run's model/ or checkpoints/step_<N>/."""
        return load_weights(self.build_model(), path)

    def predict(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Per-sample tensors for predictions.jsonl (ClassificationTask: "prediction" and "probabilities")."""
        raise NotImplementedError(f"{type(self).__name__} must implement predict() for --do_predict")

    def prediction_ids(self, split: str) -> list | None:
        """build_eval_dataset(split, labelled=False)'s row ids in order, or None; default: the split's `--id_column`."""
        if not (self.config.data_files or self.config.dataset_name):  # the task's own data, made in memory
            return None
        table = load_tables(self.config, [split], columns=[self.config.id_column])[split]
        return table.column(self.config.id_column).to_pylist() if table.num_columns else None

    def prediction_rows(self, outputs: dict[str, torch.Tensor]) -> list[dict]:
        """The gathered predict() outputs -> one JSON-ready row per sample (e.g. a class id -> its label name)."""
        columns = {name: values.tolist() for name, values in outputs.items()}
        return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]

    def collate_fn(self):
        """How samples become a batch (None: torch's default_collate), e.g. DataCollatorWithPadding(tokenizer)."""
        return None

    def derived_metrics(self, scores: dict[str, float]) -> dict[str, float]:
        """Metrics computed from the gathered ones, e.g. perplexity = exp(eval/loss)."""
        return {}

    def save_model(self, accelerator, model: nn.Module, directory: Path) -> None:
        """The final model (and with export_checkpoints checkpoints'), on every process: FSDP, DeepSpeed gather it."""
        accelerator.save_model(model, directory, safe_serialization=True)


@contextmanager
def task_errors(task_class: type[Task]):
    """An exception in a method of `task_class` -> one line naming it and the batch's structure (exit 70), wherever
    the run called it; OOM passes through."""
    try:
        yield
    except Exception as err:
        import torch.distributed as dist
        from accelerate.utils.memory import should_reduce_batch_size

        methods = (inspect.unwrap(getattr(task_class, name, None)) for name in dir(task_class))  # @torch.no_grad()
        method_code = {getattr(method, "__code__", None) for method in methods}
        frame = next((f for f, _ in walk_tb(err.__traceback__) if f.f_code in method_code), None)
        lost_peer = getattr(dist, "DistError", ())  # none: torch without torch.distributed
        if isinstance(err, (RunStopped, lost_peer)) or should_reduce_batch_size(err):
            raise  # said already; a lost peer; out of memory (--auto_find_batch_size's)
        if frame is None and reading_data(err):  # a corrupt file, samples that don't batch: not a traceback either
            raise TaskFailed(
                f"reading a batch failed: {as_raised(err)[:400]} (--debug true shows the traceback)"
            ) from err
        if frame is None or isinstance(err, OSError):
            raise  # not in the task's code; a full disk
        batch = frame.f_locals.get("batch")
        on = f" on a batch {describe(batch)}" if batch is not None else ""
        raise TaskFailed(
            f"{task_class.__name__}.{frame.f_code.co_name}() failed{on}: {type(err).__name__}: {one_line(err)[:400]} "
            "(--debug true shows the traceback)"
        ) from err


def reading_data(err: Exception) -> bool:
    """Whether `err` came out of a DataLoader fetching a batch (a dataset's __getitem__, a collate_fn, a worker)."""
    return any(
        "/torch/utils/data/" in frame.f_code.co_filename.replace("\\", "/") for frame, _ in walk_tb(err.__traceback__)
    )


def as_raised(err: Exception) -> str:
    """`Type: message` as raised: a DataLoader worker's error arrives as "Caught X in DataLoader worker process 0.
    Original Traceback (...)", whose last line is that."""
    message = str(err).strip()
    return message.splitlines()[-1] if "Original Traceback" in message else f"{type(err).__name__}: {one_line(err)}"
