"""torchrun launches the same train.py: a real 2-process group on the CPU that trains like one process."""

import sys

import pytest

from tests.conftest import assert_ok, assert_processes, last_row, read_metrics, run_command, run_main, series

# 20 steps at the learning rate where 1 and 2 processes agree to float rounding (docs/how_it_works.md)
SAME_RUN = ["--learning_rate", "1e-3", "--max_steps", "20", "--logging_steps", "1", "--eval_steps", "1000"]


@pytest.mark.slow
def test_torchrun_two_processes_train_like_one(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py"]
    result = run_command(
        [*torchrun, *SAME_RUN, "--output_dir", str(tmp_path / "torchrun")], env={"OMP_NUM_THREADS": "1"}
    )  # run_command unsets any launcher variables of the calling environment
    assert_ok(result)
    assert_processes(tmp_path / "torchrun", 2)
    assert_ok(run_main(*SAME_RUN, "--output_dir", str(tmp_path / "one")))
    two, one = (read_metrics(tmp_path / run) for run in ("torchrun", "one"))
    losses_two, losses_one = series(two, "train/loss"), series(one, "train/loss")
    assert list(losses_two) == list(losses_one) == list(range(1, 21))
    assert max(abs(losses_two[step] - losses_one[step]) for step in losses_one) <= 1e-5
    assert last_row(two)["eval/accuracy"] == last_row(one)["eval/accuracy"]
    assert last_row(two)["eval/num_samples"] == last_row(one)["eval/num_samples"] == 359
