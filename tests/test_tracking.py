"""Tracking never blocks a job: wandb without credentials goes offline; tensorboard, mlflow and metrics.jsonl agree;
every tracker Accelerate knows is accepted by name, and one whose package is missing is one clear error."""

import re
import shlex
import shutil
from types import SimpleNamespace

import pytest

from src.cli import parse_config
from src.config import TrainConfig
from src.errors import EXIT_TASK_FAILED, UsageError
from tests.conftest import (
    QUICK,
    REPO,
    assert_ok,
    assert_processes,
    last_row,
    launch_command,
    read_metrics,
    run_command,
    run_main,
    run_on,
    run_python,
    series,
)


def no_wandb_credentials(home) -> dict:
    """A user who never ran `wandb login`: no key, no mode, no netrc."""
    return {"HOME": str(home), "WANDB_MODE": None, "WANDB_API_KEY": None, "NETRC": None, "WANDB_DIR": None}


def offline_runs(out) -> list:
    return sorted((out / "wandb").glob("offline-run-*"))


@pytest.fixture(scope="module")
def wandb_and_mlflow(tmp_path_factory):
    """(output_dir, console) of one 2-process run (forked ranks, stdin closed) that reports to wandb, without
    credentials, and to MLflow, without MLFLOW_TRACKING_URI; and whether mlruns/ or mlflow.db were in the repository
    before it. Read, not changed, by the tests (the resume test continues a copy)."""
    home = tmp_path_factory.mktemp("home")
    out = home / "run"
    args = [*QUICK, "--output_dir", str(out), "--report_to", "wandb,mlflow", "--run_name", "r1",
            "--run_group", "sweep1", "--save_steps", "3"]  # fmt: skip
    in_repo = {name: (REPO / name).exists() for name in ("mlruns", "mlflow.db")}
    result = run_on(2, *args, env={**no_wandb_credentials(home), "MLFLOW_TRACKING_URI": None})
    assert_ok(result)
    assert_processes(out, 2)
    return out, result.stdout + result.stderr, in_repo


@pytest.mark.slow
def test_wandb_without_credentials_goes_offline_on_two_processes(wandb_and_mlflow):
    out, console, _ = wandb_and_mlflow
    assert len(offline_runs(out)) == 1  # one wandb run per run, made by the main process alone
    assert console.count("wandb: no API key found, logging offline") == 1


NEEDS_SCRIPT = pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script`: a pseudo-terminal")


@pytest.fixture(scope="module")
def resumed_in_a_terminal(wandb_and_mlflow, tmp_path_factory):
    """(output_dir, console) of the run above (6 steps, checkpoints at 3 and 6) resumed on 2 processes in a
    pseudo-terminal with a size, as a user's is (`script` alone makes a 0x0 one, where tqdm hides the bar): 4 more
    steps reported to wandb, still without credentials. `script` merges both streams into stdout."""
    first, _, _ = wandb_and_mlflow
    home = tmp_path_factory.mktemp("terminal")
    out = home / "run"
    shutil.copytree(first, out)
    command = [*launch_command(2), *QUICK, "--max_steps", "10", "--output_dir", str(out), "--report_to", "wandb",
               "--save_steps", "3", "--resume_from_checkpoint", "latest"]  # fmt: skip
    result = run_command(["script", "-qec", f"stty rows 24 cols 120 && {shlex.join(command)}", "/dev/null"],
                         env=no_wandb_credentials(home), timeout=120)  # fmt: skip
    assert_ok(result)
    assert_processes(out, 2)
    return out, result.stdout


@pytest.mark.slow
@NEEDS_SCRIPT
def test_wandb_without_credentials_in_a_terminal_does_not_prompt(resumed_in_a_terminal):
    """The 2-process launch in a terminal (stdin a terminal too) went offline instead of prompting: one more
    offline run, a line saying so."""
    out, console = resumed_in_a_terminal
    assert len(offline_runs(out)) == 2  # the first run's and this one's
    assert "no API key found, logging offline" in console


@pytest.mark.slow
@NEEDS_SCRIPT
def test_resumed_run_continues_the_same_wandb_run(resumed_in_a_terminal):
    """The first run resumed by a start of 10 steps that reports to wandb: it logs to the same wandb run (a second
    offline folder with the first one's id)."""
    out, console = resumed_in_a_terminal
    assert "resuming from" in console
    run_ids = {path.name.rsplit("-", 1)[1] for path in offline_runs(out)}
    assert len(offline_runs(out)) == 2 and len(run_ids) == 1


@pytest.mark.slow
def test_tensorboard_event_file_holds_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert_ok(run_main(*QUICK, "--output_dir", str(out), "--report_to", "tensorboard"))
    events = EventAccumulator(str(out / TrainConfig.project_name))  # output_dir/project_name, hparams in a subfolder
    events.Reload()
    logged = {event.step: event.value for event in events.Scalars("train/loss")}
    expected = series(read_metrics(out), "train/loss")
    assert logged == pytest.approx(expected, rel=1e-6) and len(logged) == 3
    assert "eval/accuracy" in events.Tags()["scalars"]


PIPED = """
import sys
from src.errors import command_line
from train import main
command_line(main)(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("wandb", "tensorboard", "tensorboardX"))
loaded += sorted(m for m in sys.modules if m.startswith("torch.utils.tensorboard"))
print("TRACKER MODULES:", loaded)
"""


@pytest.fixture(scope="module")
def piped(tmp_path_factory):
    """The console of a run in a process of its own (report_to none, the default), its output a pipe; it ends by
    printing which tracker modules it imported."""
    result = run_python("-c", PIPED, *QUICK, "--output_dir", str(tmp_path_factory.mktemp("piped") / "run"))
    assert_ok(result)
    return result.stdout + result.stderr


@pytest.mark.slow
def test_report_to_none_imports_no_tracker(piped):
    assert "TRACKER MODULES: []" in piped


@pytest.mark.slow
def test_every_log_interval_has_the_throughput_and_memory_keys(tmp_path):
    out = tmp_path / "run"
    assert_ok(run_main(*QUICK, "--output_dir", str(out)))
    rows = read_metrics(out)
    assert {"setup/world_size", "setup/mixed_precision", "setup/torch", "setup/accelerate"} <= set(rows[0])
    for row in (r for r in rows if "train/loss" in r):
        assert {"train/lr", "train/grad_norm", "train/samples_per_s", "train/step_time_s",
                "train/peak_memory_gb", "epoch"} <= set(row)  # fmt: skip
        assert row["train/samples_per_s"] > 0 and row["train/peak_memory_gb"] > 0


# tqdm's bar: "| 4/10 [00:01<00:00,  4.50step/s]" (or "s/step" when a step takes longer than a second), ending
# at "10/10" (6/6 for the 6 steps of a run from the start)
PROGRESS_BAR = re.compile(r"\| *(\d+)/\1 \[[^\]]*(step/s|s/step)")


@pytest.mark.slow
@NEEDS_SCRIPT
def test_progress_bar_in_a_terminal_and_plain_lines_otherwise(resumed_in_a_terminal, piped):
    _, in_terminal = resumed_in_a_terminal
    assert PROGRESS_BAR.search(in_terminal), in_terminal[-2000:]

    logs = piped  # a run with its output a pipe
    assert not PROGRESS_BAR.search(logs) and "step/s" not in logs and "\r" not in logs
    assert [int(step) for step in re.findall(r"step (\d+) \| train/loss", logs)] == [2, 4, 6]  # plain lines


def installed_trackers() -> list[str]:
    from accelerate.tracking import get_available_trackers

    return [str(tracker) for tracker in get_available_trackers()]


def accelerate_tracker_names() -> list[str]:
    from accelerate.utils import LoggerType

    return [name for name in LoggerType.list() if name != "all"]


@pytest.mark.parametrize("name", accelerate_tracker_names())
def test_every_accelerate_tracker_name_is_accepted_or_names_its_package(name):
    if name in installed_trackers():
        assert TrainConfig(report_to=name).report_to == [name]
    else:  # Accelerate would drop it without a word; the run would then log nowhere the user looks
        with pytest.raises(UsageError, match=rf"^--report_to {name} needs its package: pip install {name}$"):
            parse_config(["--report_to", name])


def test_all_means_the_installed_trackers_and_a_missing_one_is_an_error(monkeypatch):
    assert sorted(TrainConfig(report_to="all").report_to) == sorted(installed_trackers())
    monkeypatch.setattr("accelerate.tracking.get_available_trackers", lambda: ["wandb"])  # as without mlflow
    assert TrainConfig(report_to="all").report_to == ["wandb"]
    with pytest.raises(UsageError, match="--report_to mlflow needs its package: pip install mlflow"):
        TrainConfig(report_to="wandb,mlflow")


@pytest.mark.slow
def test_mlflow_offline_store_in_output_dir_holds_the_metrics_of_one_run(wandb_and_mlflow):
    """Two processes, no MLFLOW_TRACKING_URI: one MLflow run in output_dir/mlflow.db with metrics.jsonl's values."""
    from mlflow import MlflowClient

    out, _, in_repo = wandb_and_mlflow
    assert {name: (REPO / name).exists() for name in in_repo} == in_repo  # nothing in the working directory
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(TrainConfig.project_name).experiment_id])
    assert (run.info.run_name, run.info.status, run.data.tags["group"]) == ("r1", "FINISHED", "sweep1")
    assert float(run.data.params["learning_rate"]) == TrainConfig.learning_rate
    rows = read_metrics(out)
    for key in ("train/loss", "eval/accuracy"):
        logged = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, key)}
        assert logged == pytest.approx(series(rows, key), rel=1e-6) and logged


def test_a_tracker_that_refuses_its_settings_is_one_line(tmp_path, monkeypatch):
    """wandb's pydantic error for a tag over 64 characters, and the like, raised inside `init_trackers`: one line
    naming the flags, exit 2 (a rerun replaces the folder it had begun, as no step trained)."""
    from src.tracking import start_tracking

    def init_trackers(*args, **kwargs):
        raise ValueError("1 validation error for Settings\nrun_tags\n  Value error, Tag 'xxx' exceeds 64 characters")

    accelerator = SimpleNamespace(init_trackers=init_trackers, is_main_process=True, trackers=[])
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = TrainConfig(report_to="wandb", output_dir=str(tmp_path))
    with pytest.raises(
        UsageError,
        match=r"^--report_to wandb: a tracker could not start \(ValueError: 1 validation "
        r"error for Settings run_tags Value error, Tag 'xxx' exceeds 64 characters\)",
    ):
        start_tracking(accelerator, config)


def test_a_tensor_or_numpy_number_logs_as_a_number(tmp_path, fresh_accelerate_state):
    """A forker's `log_metrics(accelerator, {"x": grad_norm}, step)`: the tensor's value in metrics.jsonl (JSON had no
    way to write a tensor: a traceback at the first log)."""
    import numpy as np
    import torch
    from accelerate import Accelerator

    from src.tracking import JsonlTracker, log_metrics

    accelerator = Accelerator(cpu=True, log_with=[JsonlTracker(tmp_path / "metrics.jsonl")])
    accelerator.init_trackers("test")
    log_metrics(accelerator, {"mine/norm": torch.tensor(0.5), "mine/count": np.int64(3), "mine/name": "a"}, step=1)
    accelerator.end_training()
    assert read_metrics(tmp_path) == [{"step": 1, "mine/norm": 0.5, "mine/count": 3, "mine/name": "a"}]


def test_other_processes_silence_torchs_own_loggers_too():
    """torch's loggers have handlers of their own (torch._logging), not the root's: dynamo's warnings under
    --torch_compile came from every process ("[rank1]:W... Profiler record function ... will be ignored")."""
    import logging
    import warnings

    from src.tracking import setup_logging

    torch_logger, root = logging.getLogger("torch"), logging.getLogger()
    saved = torch_logger.level, root.level, list(root.handlers)
    try:
        with warnings.catch_warnings():
            setup_logging(SimpleNamespace(is_main_process=False))
        assert not logging.getLogger("torch._dynamo").isEnabledFor(logging.WARNING)
        assert logging.getLogger("torch._dynamo").isEnabledFor(logging.ERROR)  # errors still said
    finally:
        torch_logger.setLevel(saved[0])
        root.setLevel(saved[1])
        root.handlers[:] = saved[2]


@pytest.mark.slow
def test_a_run_that_raised_leaves_no_tracker_run_active(tmp_path, monkeypatch):
    """A notebook's next run after one that raised (or whose wandb refused to start), here into its folder
    (--overwrite_output_dir), or an out-of-memory retry (--auto_find_batch_size): the failed run's MLflow run was still
    active, and MLflow refused to start another ("Run with UUID ... is already active"); its store, replaced, was one
    this process could no longer write. The failed run's is marked FAILED."""
    import mlflow
    from mlflow import MlflowClient

    from src.tasks.digits import Digits

    loss, calls = Digits.loss, []

    def failing_at_the_third_batch(self, model, batch):
        calls.append(len(batch[0]))
        if len(calls) == 3:
            raise ValueError("a bug")
        return loss(self, model, batch)

    both = ["--report_to", "mlflow,wandb", "--output_dir", str(tmp_path / "refused")]  # MLflow's starts, wandb refuses
    refused = run_main(*QUICK, *both, env={"WANDB_MODE": "bogus"})
    assert refused.returncode == 2 and mlflow.active_run() is None
    monkeypatch.setattr(Digits, "loss", failing_at_the_third_batch)
    failed = run_main(*QUICK, "--report_to", "mlflow", "--output_dir", str(tmp_path / "failed"))
    assert failed.returncode == EXIT_TASK_FAILED and mlflow.active_run() is None
    monkeypatch.setattr(Digits, "loss", loss)
    again = ["--overwrite_output_dir", "true"]
    assert_ok(run_main(*QUICK, "--report_to", "mlflow", "--output_dir", str(tmp_path / "failed"), *again))
    assert mlflow.active_run() is None
    client = MlflowClient(f"sqlite:///{tmp_path / 'failed' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(TrainConfig.project_name).experiment_id
    runs = client.search_runs([experiment], order_by=["start_time"])
    assert [run.info.status for run in runs] == ["FAILED", "FINISHED"]  # the replaced one's beside this one's
    assert runs[1].data.metrics["train/loss"] == last_row(read_metrics(tmp_path / "failed"), "train/loss")["train/loss"]
