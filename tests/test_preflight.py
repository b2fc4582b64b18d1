"""src/features/preflight/: before the first step, the first train samples read and batched, one eval batch through
the task's eval_outputs (the random generators left as they were), the watched metrics checked."""

import dataclasses
import math
import re

import pytest
import torch

from src.config import TrainConfig
from src.errors import EXIT_TASK_FAILED, TaskFailed, UsageError
from src.features.preflight import check_first_batch, check_watched_metrics
from src.loaders import build_dataloaders
from src.tasks.base import Task
from tests.conftest import QUICK, assert_ok, run_main
from tests.helpers import run_with_unreadable_samples


class Ragged(Task):
    """Samples of different lengths and the default collate: what a text task without padding looks like."""

    def build_datasets(self):
        samples = [{"input_ids": torch.arange(n)} for n in (3, 5, 4, 6)]
        return samples, samples


def test_samples_that_cannot_be_batched_say_so():
    train, evals = Ragged(TrainConfig()).build_datasets()
    loader, _ = build_dataloaders(train, evals, dataclasses.replace(TrainConfig(), per_device_train_batch_size=2))
    with pytest.raises(TaskFailed, match=r"Ragged: batching samples failed .*a sample is \{input_ids: tensor int64 "
                                         r"\[3\]\}; .*collate_fn"):  # fmt: skip
        check_first_batch(loader, Ragged(TrainConfig()), batch_size=2)


@pytest.mark.parametrize(
    ("outputs", "said"),
    [(lambda loss: {"loss": loss}, "it must give a dict of loss, weight, predictions, references"),
     (lambda loss: {"loss": loss.mean(), "weight": torch.ones_like(loss), "predictions": loss, "references": loss},
      "each must be a tensor of one value per sample, the batch along dim 0"),
     (lambda loss: {"loss": loss, "weight": torch.ones(1), "predictions": loss, "references": loss},
      "each must be a tensor of one value per sample, the batch along dim 0")],
)  # fmt: skip
def test_eval_outputs_evaluation_cannot_use_are_said_before_training(tmp_path, monkeypatch, outputs, said):
    """A task's eval_outputs() that fails, or gives what evaluation can't use (a key missing, a batch mean, another
    length), is one line before the first step, not at the first evaluation (steps past the last checkpoint lost);
    nothing is written."""
    from src.tasks.digits import Digits

    def eval_outputs(self, model, batch):
        inputs, labels = batch
        return outputs(torch.nn.functional.cross_entropy(model(inputs), labels, reduction="none"))

    monkeypatch.setattr(Digits, "eval_outputs", eval_outputs)
    failed = run_main(*QUICK, "--output_dir", str(tmp_path / "run"))
    assert failed.returncode == EXIT_TASK_FAILED, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Digits.eval_outputs() gave ") and said in last, last
    assert not (tmp_path / "run").exists() and "step 1 " not in failed.stderr


def test_the_check_before_training_leaves_the_random_generators_as_they_were(tmp_path, monkeypatch):
    """The training after the eval check draws what it would draw without it, even from a task whose eval_outputs
    draws random numbers (and the loader's iterator draws its seed)."""
    from src.tasks.digits import Digits

    eval_outputs, loss, first_draws = Digits.eval_outputs, Digits.loss, []

    def loss_recording_its_first_draw(self, model, batch):
        if len(first_draws) < len(runs):
            first_draws.append(torch.rand(1).item())
        return loss(self, model, batch)

    def drawing(self, model, batch):
        torch.rand(100)
        return eval_outputs(self, model, batch)

    monkeypatch.setattr(Digits, "loss", loss_recording_its_first_draw)
    runs = []
    for draws in (False, True):
        runs.append(draws)
        monkeypatch.setattr(Digits, "eval_outputs", drawing if draws else eval_outputs)
        assert_ok(run_main(*QUICK, "--max_steps", "1", "--output_dir", str(tmp_path / str(draws))))
    assert len(first_draws) == 2 and first_draws[0] == first_draws[1]


class DerivingTask:
    """What check_watched_metrics asks of a task: its derived metrics."""

    def __init__(self, derived=lambda scores: {}):
        self.derived_metrics = derived


def test_a_misspelt_watched_metric_is_refused_before_training_where_the_keys_are_known():
    """The built-in metrics' keys and the task's derived ones are known before any evaluation: a watched metric that
    none of them is, is a usage error then. An `evaluate` metric's keys, or a task whose derived metrics fail on
    made-up scores, leave it to the first evaluation."""
    from src.metrics import Accuracy, Named

    def perplexity(scores):
        return {"eval/perplexity": math.exp(scores["eval/loss"])}

    check = check_watched_metrics
    check(TrainConfig(metric_for_best_model="accuracy"), DerivingTask(), Accuracy())
    check(TrainConfig(early_stopping_patience=2, early_stopping_metric="perplexity"), DerivingTask(perplexity), None)
    with pytest.raises(UsageError, match="--metric_for_best_model eval/acuracy is not logged; did you mean eval/accur"):
        check(TrainConfig(metric_for_best_model="acuracy"), DerivingTask(), Accuracy())
    with pytest.raises(UsageError, match="eval/perplexty is not logged; did you mean eval/perplexity"):
        check(TrainConfig(early_stopping_patience=2, early_stopping_metric="perplexty"), DerivingTask(perplexity), None)
    check(TrainConfig(metric_for_best_model="f1"), DerivingTask(), Named("f1", object()))  # evaluate's: known later
    check(TrainConfig(metric_for_best_model="r2"), DerivingTask(lambda scores: 1 / 0), Accuracy())  # the task's: later


def test_a_misspelt_metric_for_best_model_stops_the_run_before_it_writes_anything(tmp_path):
    out = tmp_path / "run"
    result = run_main("--metric_for_best_model", "acuracy", "--max_steps", "4", "--output_dir", str(out))
    assert result.returncode == 2, result.stderr[-2000:]
    said = result.stderr.strip().splitlines()[-1]
    assert said.startswith("error: --metric_for_best_model eval/acuracy is not logged; did you mean eval/accuracy? ")
    assert not out.exists()


def test_a_first_sample_that_does_not_read_is_one_line_before_training(tmp_path, monkeypatch):
    """A corrupt file among the first train samples: one line, exit 70, before the first step: nothing written."""
    failed = run_with_unreadable_samples(monkeypatch, tmp_path / "run", first_bad=0)
    assert failed.returncode == EXIT_TASK_FAILED, failed.stderr[-2000:]
    said = failed.stderr.strip().splitlines()[-1]
    assert said == "error: reading the first samples failed: OSError: sample 0: truncated file", said
    assert "Traceback" not in failed.stderr and not (tmp_path / "run").exists()


def test_an_eval_split_whose_first_sample_does_not_read_is_one_line_before_training(tmp_path, monkeypatch):
    """The eval check reads a batch as evaluation does: a sample that does not read is one line before the first step,
    nothing written."""
    failed = run_with_unreadable_samples(monkeypatch, tmp_path / "run", first_bad=0, split="eval")
    line = r"error: reading a batch failed: OSError: sample 0: truncated file \(--debug true shows the traceback\)"
    assert re.fullmatch(line, failed.stderr.strip().splitlines()[-1]), failed.stderr[-2000:]
    assert failed.returncode == EXIT_TASK_FAILED and not (tmp_path / "run").exists()
