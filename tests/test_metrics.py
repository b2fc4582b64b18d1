"""Metrics: the built-in accuracy is exact over every batch added, and combines with `evaluate` modules."""

import numpy as np
import pytest

from src.errors import TaskFailed, UsageError
from src.metrics import Accuracy, Metrics, load_metrics

ERROR_RATE = """
import datasets
import evaluate


class ErrorRate(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="", citation="", inputs_description="",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        return {"error_rate": sum(p != r for p, r in zip(predictions, references)) / len(references)}
"""


def batches(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 10, size), rng.integers(0, 10, size)) for size in (64, 64, 7)]


def test_accuracy_is_exact_over_all_batches_and_starts_again_after_compute():
    metric = load_metrics(["accuracy"])
    assert isinstance(metric, Accuracy)
    for seed in (0, 1):  # two evaluations: the second starts empty, as evaluate's metrics do
        data = batches(seed)
        for predictions, references in data:
            metric.add_batch(predictions=predictions, references=references)
        expected = np.mean(np.concatenate([p for p, _ in data]) == np.concatenate([r for _, r in data]))
        assert metric.compute() == {"accuracy": expected}


def test_accuracy_beside_an_evaluate_module(tmp_path):
    (tmp_path / "error_rate").mkdir()
    (tmp_path / "error_rate" / "error_rate.py").write_text(ERROR_RATE)
    metric = load_metrics(["accuracy", str(tmp_path / "error_rate")])
    for predictions, references in batches(1):
        metric.add_batch(predictions=predictions, references=references)
    scores = metric.compute()
    assert set(scores) == {"accuracy", "error_rate"}
    assert abs(scores["accuracy"] + scores["error_rate"] - 1) < 1e-12 and 0 < scores["accuracy"] < 1


def test_accuracy_counts_each_element_and_refuses_shapes_that_differ():
    metric = Accuracy()
    metric.add_batch(predictions=np.array([[1, 2], [3, 4]]), references=np.array([[1, 0], [3, 4]]))  # per token
    assert metric.compute() == {"accuracy": 0.75}
    for references in (np.array([[1], [2]]), np.array([1])):  # numpy would broadcast both against (2,)
        with pytest.raises(TaskFailed, match=r"predictions of shape \(2,\), references of shape"):
            metric.add_batch(predictions=np.array([1, 2]), references=references)


def test_a_metric_that_is_not_found_or_fails_is_one_line(tmp_path):
    """A misspelt name (offline: not on the Hub either) is bad input; an `evaluate` module's own code failing names
    the metric, as a task method's error names the method."""
    with pytest.raises(
        UsageError, match=r"^no metric 'acuracy' \(--metrics, or the task's `metrics`\): .*; use accuracy"
    ):
        load_metrics(["acuracy"])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "broken.py").write_text(ERROR_RATE.replace("/ len(references)", "/ 0"))
    metric = load_metrics([str(tmp_path / "broken")])
    metric.add_batch(predictions=np.array([1, 2]), references=np.array([1, 0]))
    with pytest.raises(TaskFailed, match=r"^the metric .*broken failed in compute\(\): ZeroDivisionError: division by"):
        metric.compute()
    with pytest.raises(TaskFailed, match=r"^the metric .*broken failed in add_batch\(\): "):
        metric.add_batch(predictions=np.array(["a"]), references=np.array([1]))


def test_two_metrics_of_one_name_are_refused():
    with pytest.raises(UsageError, match=r"--metrics names a metric twice \(accuracy, accuracy\); name each once"):
        load_metrics(["accuracy", "accuracy"])
    metric = Metrics([Accuracy(), Accuracy()])  # as two evaluate modules may both give one name
    metric.add_batch(predictions=np.array([1]), references=np.array([1]))
    with pytest.raises(TaskFailed, match="two metrics both give accuracy; keep one of them in --metrics"):
        metric.compute()
