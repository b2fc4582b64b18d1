"""What the loop measures (src/meters.py): the step timer, the loss window."""

from types import SimpleNamespace

import pytest
import torch

from src import meters
from src.errors import TrainingDiverged


def test_step_timer_counts_only_the_steps_it_timed(monkeypatch):
    """After a resume at step 100 the loss window also holds steps trained before it; the clock saw 10 steps."""
    clock = iter([50.0, 52.0, 53.0, 60.0, 61.0, 62.0])
    monkeypatch.setattr(meters.time, "perf_counter", lambda: next(clock))
    timer = meters.StepTimer(step=100)  # started at 50 s
    assert timer.seconds_per_step(110) == pytest.approx(0.2)  # 52 s: 2 s over 10 steps
    timer.restart(110)  # at 53 s
    with timer.paused():  # 60 -> 61 s: an evaluation, not counted
        pass
    assert timer.seconds_per_step(120) == pytest.approx((62.0 - 53.0 - 1.0) / 10)


def test_a_nan_loss_names_the_optimiser_step_it_first_appeared_in():
    """A window resumed at step 5 with 3 steps' losses, then steps of 2 micro-batches, step 8's first one NaN."""
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, gradient_accumulation_steps=2)
    for skip_nonfinite in (False, True):
        window = meters.LossWindow(accelerator, skip_nonfinite, values=[1.0, 2.0, 3.0], first_step=5)
        for losses in ([float("nan"), 4.0], [5.0, 6.0]):
            window.add([torch.tensor(loss) for loss in losses])
        if skip_nonfinite:  # left out of the mean
            assert window.mean(next_step=10) == pytest.approx((1.0 + 2.0 + 3.0 + 5.5) / 4)
        else:
            with pytest.raises(TrainingDiverged, match="NaN/inf at step 8;"):
                window.mean(next_step=10)


def test_each_step_weighs_alike_whatever_its_micro_batch_count():
    """A window saved with accumulation 2 and resumed with 1 (e.g. 1 process, then 2): each step one value."""
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, gradient_accumulation_steps=1)
    saved = meters.LossWindow(accelerator, False, values=[], first_step=1)
    saved.add([torch.tensor(1.0), torch.tensor(3.0)])  # step 1: mean 2
    resumed = meters.LossWindow(accelerator, False, values=saved.reduced().tolist(), first_step=2)
    resumed.add([torch.tensor(4.0)])  # step 2
    assert resumed.mean(next_step=3) == pytest.approx(3.0)  # (2 + 4) / 2, not (1 + 3 + 4) / 3
