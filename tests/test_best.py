"""src/best.py: early stopping counts evaluations without improvement, in either direction, across a resume."""

import math

import pytest

from src.best import BestEvaluation
from src.checkpoint import TrainerState
from src.config import TrainConfig
from src.errors import UsageError
from tests.conftest import assert_ok, read_metrics, run_main, series


@pytest.mark.parametrize(
    ("mode", "values", "stops_at"),
    [
        ("min", [2.0, 1.0, 1.5, 1.2, 0.5], 3),  # 1.5 and 1.2 don't beat 1.0: patience 2 runs out at the 4th
        ("max", [0.5, 0.4, 0.6, 0.6, 0.6], 4),  # a tie is not an improvement
    ],
)
def test_early_stopping_after_patience_evaluations_without_improvement(mode, values, stops_at):
    config = TrainConfig(early_stopping_patience=2, early_stopping_metric="eval/accuracy", early_stopping_mode=mode)
    state = TrainerState()
    watch = BestEvaluation(config, state)
    stops = [watch.update({"eval/accuracy": value}, step)[1] for step, value in enumerate(values)]
    assert stops.index(True) == stops_at
    assert not any(watch.update({"eval/accuracy": value}, 0)[0] for value in values)  # no best-model metric set


def test_a_resumed_run_continues_the_count_from_the_trainer_state():
    config = TrainConfig(early_stopping_patience=2)
    state = TrainerState(best_metric=1.0, evals_without_improvement=1)
    assert BestEvaluation(config, state).update({"eval/loss": 1.1}, 10) == (False, True)


def test_an_unlogged_metric_names_the_flag_and_the_logged_ones():
    config = TrainConfig(early_stopping_patience=1, early_stopping_metric="eval/f1")
    with pytest.raises(UsageError, match="--early_stopping_metric eval/f1 is not logged; use one of eval/loss"):
        BestEvaluation(config, TrainerState()).update({"eval/loss": 1.0}, 1)
    config = TrainConfig(metric_for_best_model="mea")
    with pytest.raises(
        UsageError, match="eval/mea is not logged; did you mean eval/mae\\? use one of eval/loss, eval/mae"
    ):
        BestEvaluation(config, TrainerState()).update({"eval/loss": 1.0, "eval/mae": 0.5}, 1)


@pytest.mark.parametrize(
    ("metric", "mode", "keeps"),
    [
        ("loss", "min", "lowest"),
        ("eval/perplexity", "min", "lowest"),
        ("accuracy", "max", "highest"),
        ("mae", "min", "lowest"),
        ("eval/rmse", "min", "lowest"),
        ("f1_macro", "max", "highest"),
        ("eval/answer", "max", "highest"),  # a last word, not a name's last letters: no "wer" here
    ],
)
def test_both_flags_name_a_metric_alike_and_read_its_direction_alike(metric, mode, keeps, caplog):
    """`accuracy` is eval/accuracy for early stopping too; a metric's direction is read off its name for both (a loss,
    perplexity or error such as rmse: lower is better), and the log says which way each keeps, so a metric read
    wrongly shows."""
    config = TrainConfig(metric_for_best_model=metric, early_stopping_patience=2, early_stopping_metric=metric)
    assert config.early_stopping_metric == config.metric_for_best_model == f"eval/{metric.removeprefix('eval/')}"
    assert config.early_stopping_mode == mode and config.greater_is_better == (mode == "max")
    with caplog.at_level("INFO", logger="src.best"):
        BestEvaluation(config, TrainerState())
    assert f"the best model: the {keeps} {config.metric_for_best_model} (--greater_is_better" in caplog.text
    better = "lower" if mode == "min" else "higher"
    assert f"early stopping after 2 evaluations without a {better} {config.early_stopping_metric}" in caplog.text


def test_a_nan_evaluation_is_never_the_best_and_any_number_beats_it():
    config = TrainConfig(metric_for_best_model="loss", early_stopping_patience=3)
    best = BestEvaluation(config, TrainerState())
    assert [best.update({"eval/loss": value}, step)[0] for step, value in enumerate([math.nan, 2.0, 1.0, 1.5])] == [
        False, True, True, False]  # fmt: skip
    assert best.state.evals_without_improvement == 1 and not best.stopped_early()


@pytest.mark.slow
def test_a_run_that_stopped_early_logs_its_last_steps_and_a_resume_trains_no_further(tmp_path):
    """eval/num_samples never improves: patience 1 stops at the second evaluation (step 4), between two log steps;
    the steps since the last log are logged. Resumed (as a requeued job is), it stays stopped at step 4."""
    out = tmp_path / "run"
    args = ["--max_steps", "20", "--eval_steps", "2", "--logging_steps", "5", "--save_steps", "0",
            "--early_stopping_patience", "1", "--early_stopping_metric", "num_samples", "--max_eval_samples", "64",
            "--output_dir", str(out), "--resume_from_checkpoint", "latest"]  # fmt: skip
    assert_ok(run_main(*args))
    assert series(read_metrics(out), "train/loss").keys() == {4}
    assert_ok(run_main(*args))
    assert [path.name for path in (out / "checkpoints").iterdir()] == ["step_4"]
    assert max(row["step"] for row in read_metrics(out)) == 4


def test_a_resume_watching_another_metric_or_direction_chooses_afresh(caplog):
    """A checkpoint's best (and early-stopping count) by one metric is no bar for another: a resumed run watching
    another starts that choice again, and says so; the same metric keeps it."""
    chosen = dict(best_model_step=10, best_model_metric=0.9, best_model_by="eval/accuracy max")
    counted = dict(best_metric=0.9, evals_without_improvement=2, early_stopping_by="eval/accuracy max")
    same = TrainConfig(metric_for_best_model="accuracy", early_stopping_patience=3, early_stopping_metric="accuracy")
    state = TrainerState(**chosen, **counted)
    BestEvaluation(same, state)
    assert (state.best_model_step, state.best_metric, state.evals_without_improvement) == (10, 0.9, 2)

    other = TrainConfig(metric_for_best_model="eval/loss", early_stopping_patience=3, early_stopping_mode="max")
    state = TrainerState(**chosen, **counted)
    BestEvaluation(other, state)
    assert (state.best_model_step, state.best_model_metric, state.best_metric, state.evals_without_improvement) == (
        None, None, None, 0)  # fmt: skip
    assert (state.best_model_by, state.early_stopping_by) == ("eval/loss min", "eval/loss max")  # saved with the next
    assert "the best model so far was chosen by eval/accuracy max, this run chooses by eval/loss min" in caplog.text

    caplog.clear()  # a run that makes neither choice: nothing said, the choices dropped (the old best rotates away)
    state = TrainerState(**chosen, **counted)
    BestEvaluation(TrainConfig(), state)
    assert "chooses by" not in caplog.text and "counted evaluations" not in caplog.text
    assert (state.best_model_step, state.best_model_by, state.best_metric, state.early_stopping_by) == (None,) * 4


def test_early_stopping_after_nan_evaluations_only_says_so(caplog):
    config = TrainConfig(early_stopping_patience=1)
    watch = BestEvaluation(config, TrainerState())
    with caplog.at_level("INFO"):
        assert watch.update({"eval/loss": float("nan")}, 2) == (False, True)
    assert "early stopping at step 2: eval/loss has not improved on a NaN for 1 evaluations" in caplog.text
