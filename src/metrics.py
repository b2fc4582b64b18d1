"""Evaluation metrics: `accuracy` built in, any other name an `evaluate` module (src/evaluate_metrics/<name> first,
then a path or the Hub). Every process computes the metric on the same gathered predictions (`evaluate` in train.py),
so all processes agree: no "4 accuracies on 4 GPUs"."""

import uuid
from collections import Counter
from pathlib import Path
from typing import Protocol

import numpy as np

from src.errors import TaskFailed, UsageError
from src.imports import hidden

LOCAL_METRICS = Path(__file__).parent / "evaluate_metrics"


class Metric(Protocol):
    """What evaluation asks of a metric (an `evaluate` module is one): every gathered batch's numpy arrays, then the
    results of everything added since the last compute(), which starts the next evaluation empty."""

    def add_batch(self, *, predictions, references) -> None: ...
    def compute(self) -> dict: ...


class Accuracy:
    """The fraction of predictions equal to their reference since the last compute(). Built in: a run that needs no
    other metric never imports `evaluate` (nor `datasets`: ~0.7 s to the first step, ~50 MB, docs/benchmark.md)."""

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
        twice = sorted(name for name, count in Counter(name for r in results for name in r).items() if count > 1)
        if twice:
            raise TaskFailed(f"two metrics both give {', '.join(twice)}; keep one of them in --metrics")
        return {name: value for result in results for name, value in result.items()}


def load_metrics(names: list[str]) -> Metric | None:
    """One object computing all `names` (None if there are none): the built-in ones, and one `evaluate` combination
    of the others, each a local module name, a path to one or a name `evaluate.load` takes as is."""
    if not names:
        return None
    if len(set(names)) < len(names):
        raise UsageError(f"--metrics names a metric twice ({', '.join(names)}); name each once")
    metrics = [BUILT_IN[name]() for name in names if name in BUILT_IN]
    others = [name for name in names if name not in BUILT_IN]
    if others:
        # `import evaluate` without importing transformers (~0.6 s of CPU, 30 MB, docs/benchmark.md): evaluate imports
        # it, if it can, only for its pipeline `evaluator`s, which metrics do not use; a task that uses transformers
        # has loaded it already.
        import datasets  # noqa: F401  (first: it asks whether transformers is installed without importing it)

        with hidden("transformers"):
            import evaluate
        # A fresh experiment id per load: processes on one machine never wait on each other's cache-file locks.
        # (keep_in_memory=True would avoid the files, but fails on Python 3.12.3: its fingerprint pickles pyarrow types)
        experiment = uuid.uuid4().hex
        paths = [str(LOCAL_METRICS / name) if (LOCAL_METRICS / name).is_dir() else name for name in others]
        metrics.append(evaluate.combine([evaluate.load(path, experiment_id=experiment) for path in paths]))
    return metrics[0] if len(metrics) == 1 else Metrics(metrics)
