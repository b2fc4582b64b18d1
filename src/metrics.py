"""Evaluation metrics, computed by every process on the same gathered predictions: no "4 accuracies on 4 GPUs"."""

import contextlib
import uuid
from collections import Counter
from pathlib import Path
from typing import Protocol

import numpy as np

from src.errors import TaskFailed, UsageError, one_line
from src.imports import hidden

LOCAL_METRICS = Path(__file__).parent / "evaluate_metrics"


class Metric(Protocol):
    """What evaluation asks of a metric (an `evaluate` module is one); add_batch gets numpy arrays, compute() resets."""

    def add_batch(self, *, predictions, references) -> None: ...
    def compute(self) -> dict: ...


class Accuracy:
    """Built in: a run needing no other metric imports neither `evaluate` nor `datasets` (~0.7 s, docs/benchmark.md)."""

    keys = ("accuracy",)  # what compute() gives, known before any evaluation (e.g. to check a watched metric)
    correct = total = 0  # since the last compute()

    def add_batch(self, *, predictions, references) -> None:
        predictions, references = np.asarray(predictions), np.asarray(references)
        if predictions.shape != references.shape:  # broadcasting would count pairs that are none
            raise TaskFailed(
                f"accuracy compares each prediction with its reference, and the task's eval_outputs() gave "
                f"predictions of shape {predictions.shape}, references of shape {references.shape}: give both alike"
            )
        self.correct += int(np.count_nonzero(predictions == references))
        self.total += references.size  # each element: a token-level accuracy for (batch, length) outputs

    def compute(self) -> dict:
        result = {"accuracy": self.correct / self.total if self.total else 0.0}
        self.correct, self.total = 0, 0  # as evaluate's compute(): the next evaluation starts empty
        return result


BUILT_IN = {"accuracy": Accuracy}


class Metrics(list):
    """Several metrics as one: compute() merges their results."""

    def add_batch(self, *, predictions, references) -> None:
        for metric in self:
            metric.add_batch(predictions=predictions, references=references)

    def compute(self) -> dict:
        results = [metric.compute() for metric in self]
        if twice := sorted(name for name, count in Counter(name for r in results for name in r).items() if count > 1):
            raise TaskFailed(f"two metrics both give {', '.join(twice)}; keep one of them in --metrics")
        return {name: value for result in results for name, value in result.items()}


def load_metrics(names: list[str]) -> Metric | None:
    """One object computing all `names` (None if none): the built-in ones and `evaluate` modules (local, path, Hub)."""
    if not names:
        return None
    if len(set(names)) < len(names):
        raise UsageError(f"--metrics names a metric twice ({', '.join(names)}); name each once")
    metrics = [BUILT_IN[name]() for name in names if name in BUILT_IN]
    if others := [name for name in names if name not in BUILT_IN]:
        # `import evaluate` without transformers (~0.6 s, 30 MB, docs/benchmark.md): only its pipeline evaluators use it
        import datasets  # noqa: F401  (first: it asks whether transformers is installed without importing it)

        with hidden("transformers"):
            import evaluate
        # a fresh id per load: no process waits on another's cache lock (keep_in_memory=True fails on Python 3.12.3)
        experiment = uuid.uuid4().hex
        paths = [str(LOCAL_METRICS / name) if (LOCAL_METRICS / name).is_dir() else name for name in others]
        metrics.append(Named(", ".join(others), evaluate.combine([load(evaluate, p, experiment) for p in paths])))
    return metrics[0] if len(metrics) == 1 else Metrics(metrics)


def load(evaluate, path: str, experiment: str):
    try:
        return evaluate.load(path, experiment_id=experiment)
    except FileNotFoundError as err:  # neither built in, nor a folder with a metric script, nor (online) on the Hub
        raise UsageError(
            f"no metric {path!r} (--metrics, or the task's `metrics`): {one_line(err)}; use accuracy, a folder "
            "holding <name>.py (docs/customize.md), or an `evaluate` metric on the Hub"
        ) from err


class Named:
    """An `evaluate` metric whose errors (its own code's, or the predictions' types) name it: one line, exit 70."""

    def __init__(self, name: str, metric):
        self.name, self.metric = name, metric

    def add_batch(self, *, predictions, references) -> None:
        with self.failing("add_batch"):
            self.metric.add_batch(predictions=predictions, references=references)

    def compute(self) -> dict:
        with self.failing("compute"):
            return self.metric.compute()

    @contextlib.contextmanager
    def failing(self, method: str):
        try:
            yield
        except Exception as err:
            what = f"{type(err).__name__}: {one_line(err)[:400]}"
            raise TaskFailed(f"the metric {self.name} failed in {method}(): {what}") from err
