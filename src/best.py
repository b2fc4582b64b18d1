"""Keep the best model (checkpointed, never rotated away) and stop early. All processes see the same gathered metrics,
so decide alike without a collective; the counters live in the trainer state, so a resumed run continues them."""

import difflib
import logging
import math

from src.checkpoint import TrainerState
from src.config import TrainConfig
from src.errors import UsageError

logger = logging.getLogger(__name__)


class BestEvaluation:
    def __init__(self, config: TrainConfig, state: TrainerState):
        self.config, self.state = config, state
        # each direction said: read off the metric's name (a loss is lower when better), it is wrong for e.g. an error
        if config.metric_for_best_model:
            best, other = ("highest", "lowest") if config.greater_is_better else ("lowest", "highest")
            flip = str(not config.greater_is_better).lower()
            logger.info("the best model: the %s %s (--greater_is_better %s keeps the %s)",
                        best, config.metric_for_best_model, flip, other)  # fmt: skip
        if config.early_stopping_patience:
            better, flip = ("lower", "max") if config.early_stopping_mode == "min" else ("higher", "min")
            logger.info("early stopping after %d evaluations without a %s %s (--early_stopping_mode %s: %s)",
                        config.early_stopping_patience, better, config.early_stopping_metric, flip,
                        "higher" if flip == "max" else "lower")  # fmt: skip
        self.forget_what_other_metrics_chose()

    def forget_what_other_metrics_chose(self) -> None:
        """A resumed run watching another metric (or direction) than its checkpoint's starts that choice afresh: a best
        value of one metric is no bar for another."""
        config, state = self.config, self.state
        best_model_by = early_stopping_by = None
        if config.metric_for_best_model:
            best_model_by = f"{config.metric_for_best_model} {'max' if config.greater_is_better else 'min'}"
        if config.early_stopping_patience:
            early_stopping_by = f"{config.early_stopping_metric} {config.early_stopping_mode}"
        # a choice this run doesn't make (None) is dropped without a word: the old best is rotated away as any
        if state.best_model_by not in (None, best_model_by) and state.best_model_step is not None:
            if best_model_by is not None:
                logger.warning("the best model so far was chosen by %s, this run chooses by %s: chosen again from "
                               "the next evaluation on", state.best_model_by, best_model_by)  # fmt: skip
            state.best_model_step = state.best_model_metric = None
        if state.early_stopping_by not in (None, early_stopping_by) and state.best_metric is not None:
            if early_stopping_by is not None:
                logger.warning("early stopping counted evaluations by %s, this run by %s: counted again from the "
                               "next evaluation on", state.early_stopping_by, early_stopping_by)  # fmt: skip
            state.best_metric, state.evals_without_improvement = None, 0
        state.best_model_by, state.early_stopping_by = best_model_by, early_stopping_by

    def update(self, metrics: dict, step: int) -> tuple[bool, bool]:
        """(a new best model: checkpoint it, stop training here)."""
        config, state, new_best, stop = self.config, self.state, False, False
        if config.metric_for_best_model:
            value = watched(metrics, config.metric_for_best_model, "--metric_for_best_model")
            if improves(value, state.best_model_metric, config.greater_is_better):
                state.best_model_step, state.best_model_metric, new_best = step, value, True
        if config.early_stopping_patience:
            value = watched(metrics, config.early_stopping_metric, "--early_stopping_metric")
            if improves(value, state.best_metric, config.early_stopping_mode == "max"):
                state.best_metric, state.evals_without_improvement = value, 0
            else:
                state.evals_without_improvement += 1
                stop = state.evals_without_improvement >= config.early_stopping_patience
        if stop:
            best = "a NaN" if state.best_metric is None else f"{state.best_metric:.4g}"  # every evaluation NaN
            logger.info(
                "early stopping at step %d: %s has not improved on %s for %d evaluations",
                *(step, config.early_stopping_metric, best, config.early_stopping_patience),
            )
        return new_best, stop

    def stopped_early(self) -> bool:
        """Whether the run stopped early already (a resumed one: it trains no further)."""
        patience = self.config.early_stopping_patience
        return bool(patience) and self.state.evals_without_improvement >= patience

    def summary(self) -> dict:
        """What `--load_best_model_at_end` logs: the best model's step and metric."""
        step, value = self.state.best_model_step, self.state.best_model_metric
        return {"best_model/step": step, f"best_model/{self.config.metric_for_best_model}": value}


def improves(value: float, best: float | None, greater_is_better: bool) -> bool:
    """A NaN never improves, and any number improves on one (a NaN first evaluation stays no best)."""
    if math.isnan(value):
        return False
    return best is None or math.isnan(best) or (value > best if greater_is_better else value < best)


def closest_key(metric: str, keys) -> str | None:
    """The logged key closest to a misspelt `metric`, compared without `eval/` (alike in all: `f1` is not `loss`)."""
    names = {key.removeprefix("eval/"): key for key in keys}
    close = difflib.get_close_matches(metric.removeprefix("eval/"), names, n=1)
    return names[close[0]] if close else None


def watched(metrics: dict, metric: str, flag: str) -> float:
    if metric not in metrics:
        hint = f"did you mean {close}? " if (close := closest_key(metric, metrics)) else ""
        raise UsageError(f"{flag} {metric} is not logged; {hint}use one of {', '.join(metrics)}")
    return metrics[metric]
