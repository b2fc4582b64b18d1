"""src/best.py: early stopping counts evaluations without improvement, in either direction, across a resume."""

import pytest

from src.best import BestEvaluation
from src.checkpoint import TrainerState
from src.config import TrainConfig
from src.errors import UsageError


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
