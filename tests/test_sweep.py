"""scripts/sweep.py (Optuna): trials are real launches of train.py, pruned from their eval lines, in a resumable
SQLite study; a bad search space is one line. And the `--key=value` form a wandb agent passes."""

import os
import runpy
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

from scripts import sweep
from scripts.readme_commands import section_commands
from src.cli import parse_config
from src.errors import UsageError
from tests.conftest import REPO, assert_ok, assert_processes, last_row, read_metrics, run_command, run_python
from tests.helpers import assert_bash_blocks_run

optuna = pytest.importorskip("optuna")


def write_space(tmp_path, space: dict):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    return path


def load_study(output_dir, name="space"):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{output_dir / 'study.db'}")


def eval_lines(trial_dir) -> list[int]:
    return [row["step"] for row in read_metrics(trial_dir) if "eval/accuracy" in row]


GOOD = {"parameters": {"learning_rate": {"low": 1.0e-4, "high": 1.0e-2, "log": True}}}


@pytest.mark.parametrize(
    "space, message",
    [
        (
            {"parameters": {"learnig_rate": {"low": 0.1, "high": 1}}},
            "unknown config field 'learnig_rate'; did you mean 'learning_rate'",
        ),
        (
            {"parameters": {"n_layer": {"choices": [2, 4]}}},
            "unknown config field 'n_layer'",
        ),  # causal_lm's, not digits'
        ({"parameters": {"learning_rate": {"low": 0.1}}}, "learning_rate: a range needs low and high"),
        ({"parameters": {"learning_rate": {"min": 0.1, "max": 1}}}, r"learning_rate: give \{low, high\}"),
        ({"parameters": {"learning_rate": {"low": 0.0, "high": 0.1, "log": True}}}, "learning_rate: "),
        ({"parameters": {"learning_rate": {"low": -1.0, "high": 0.1}}}, r"learning_rate=-1.0: .*must be > 0"),
        ({"parameters": {"norm": {"choices": ["group", "layer"]}}}, "norm='layer'"),
        ({"parameters": {"norm": {"choices": []}}}, "norm: choices must be a non-empty list"),
        ({"parameters": {}}, "needs `parameters:`"),
        ({**GOOD, "metrics": "eval/loss"}, "unknown key 'metrics'; did you mean 'metric'"),
        ({**GOOD, "direction": "up"}, "direction must be maximize or minimize"),
        ({**GOOD, "fixed": {"max_step": 5}}, "unknown config field 'max_step'; did you mean 'max_steps'"),
        ({**GOOD, "fixed": {"output_dir": "x"}}, "output_dir is set by the sweep"),
        ({**GOOD, "pruner": "MedianPrunr"}, "unknown optuna.pruners class 'MedianPrunr'; did you mean 'MedianPruner'"),
        ({**GOOD, "pruner": {"MedianPruner": {"warmup": 3}}}, "MedianPruner: .*warmup"),
    ],
)
def test_bad_search_space_is_one_line_naming_the_field(tmp_path, space, message):
    out = tmp_path / "sweep"
    with pytest.raises(UsageError, match=message) as info:
        sweep.main([str(write_space(tmp_path, space)), "--output_dir", str(out)])
    assert "\n" not in str(info.value) and str(info.value).startswith("search space ")
    assert not out.exists()  # nothing written


def test_task_options_and_train_flags_after_the_separator_are_checked(tmp_path):
    space = write_space(
        tmp_path,
        {"parameters": {"norm": {"choices": ["group", "none"]}, "warmup_steps": {"low": 0, "high": 20, "step": 10}}},
    )
    loaded = sweep.load_space(space, ["--max_steps", "5"])
    assert [type(d).__name__ for d in loaded.distributions.values()] == ["CategoricalDistribution", "IntDistribution"]
    with pytest.raises(UsageError, match="fixed: .*max_steps"):
        sweep.load_space(space, ["--max_steps", "many"])
    with pytest.raises(UsageError, match="sets each trial's output_dir"):
        sweep.main([str(space), "--output_dir", str(tmp_path / "s"), "--", "--output_dir=x"])


def test_the_shipped_search_space_loads():
    space = sweep.load_space(REPO / "configs/sweep/digits.yaml", [])
    assert (space.metric, space.direction) == ("eval/accuracy", "maximize") and len(space.distributions) == 3


@pytest.mark.parametrize(
    "url, message",
    [("nonsense", "is not a database URL"), ("postgresql://me:secret@localhost:1/db", r"postgresql://me:\*\*\*@")],
)
def test_bad_storage_is_one_line_without_the_password(tmp_path, url, message):
    out = tmp_path / "sweep"
    with pytest.raises(UsageError, match=message) as info:
        sweep.main([str(write_space(tmp_path, GOOD)), "--output_dir", str(out), "--storage", url])
    assert "secret" not in str(info.value) and not out.exists()


def test_wandb_agent_arguments_are_accepted():
    """What `wandb agent` runs for configs/sweep/wandb_digits.yaml: its `command`, ${args} as wandb builds them."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    spec = yaml.safe_load((REPO / "configs/sweep/wandb_digits.yaml").read_text())
    assert spec["program"] == "train.py" and spec["command"][-1] == "${args}"
    assert all(parse_config(arg.split()) for arg in spec["command"] if arg.startswith("--"))  # the fixed ones
    sampled = {}
    for name, values in spec["parameters"].items():  # one value per parameter, as the agent would draw
        sampled[name] = values["values"][-1] if "values" in values else values.get("value", values.get("max"))
    args = create_sweep_command_args({"args": {name: {"value": v} for name, v in sampled.items()}})["args"]
    assert all(arg.startswith("--") and "=" in arg for arg in args)
    config = parse_config(args)
    for name, value in sampled.items():
        assert config.to_dict()[name] == pytest.approx(value), name


def test_bad_search_space_from_the_command_line(tmp_path, monkeypatch, capsys):
    """The script's own `__main__` (runpy, in this process: the refusal comes before any trial starts): exit 2 and
    one `error:` line."""
    out = tmp_path / "sweep"
    space = write_space(tmp_path, {"parameters": {"learnig_rate": {"low": 0.1, "high": 1}}})
    monkeypatch.setattr(sys, "argv", ["scripts/sweep.py", str(space), "--output_dir", str(out)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository first
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / "scripts" / "sweep.py"), run_name="__main__")
    stderr = capsys.readouterr().err
    assert stop.value.code == 2
    assert stderr.strip().splitlines()[-1].startswith("error: search space ") and "Traceback" not in stderr
    assert not out.exists()


@pytest.mark.slow
def test_killed_sweep_continues_the_same_study(tmp_path):
    """SIGKILL the sweep (and its trial) during trial 1; the same command again runs only the trial still missing."""
    space = write_space(tmp_path, {
        "fixed": {"max_steps": 60, "eval_steps": 20, "logging_steps": 20, "save_steps": 0},
        **GOOD, "pruner": "NopPruner", "sampler": {"RandomSampler": {"seed": 0}},
    })  # fmt: skip
    out = tmp_path / "sweep"
    command = ["scripts/sweep.py", str(space), "--n_trials", "2", "--output_dir", str(out),
               "--accelerate_config", "accelerate_configs/cpu.yaml"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    first = subprocess.Popen([sys.executable, *command], cwd=REPO, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (out / "trial_1" / "metrics.jsonl").exists() and first.poll() is None:
            assert time.monotonic() < deadline, "trial 1 never started"
            time.sleep(0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the sweep and its trial, as a killed job
        first.wait()
    before = {t.number: t for t in load_study(out).trials}
    assert {n: t.state.name for n, t in before.items()} == {0: "COMPLETE", 1: "RUNNING"}

    result = run_python(*command, timeout=600)
    assert_ok(result)
    assert "1 of 2 trials finished" in result.stdout
    after = {t.number: t for t in load_study(out).trials}
    finished = [n for n, t in after.items() if t.state.name == "COMPLETE"]
    assert len(after) > len(before) and len(finished) == 2 and 1 not in finished
    assert (after[0].params, after[0].value, after[0].datetime_complete) == (
        before[0].params, before[0].value, before[0].datetime_complete)  # fmt: skip
    assert len([row for row in read_metrics(out / "trial_0") if "setup/world_size" in row]) == 1  # not rerun
    assert after[1].state.name in ("RUNNING", "FAIL")  # failed by the heartbeat once its grace period is over


@pytest.mark.slow
def test_sigterm_to_the_sweep_stops_its_trial(tmp_path):
    """`kill <sweep>` (not its process group) leaves no trainer running: the trial is stopped and marked failed."""
    import psutil

    space = write_space(tmp_path, {"fixed": {"max_steps": 5000, "save_steps": 0}, **GOOD})
    out = tmp_path / "sweep"
    command = [sys.executable, "scripts/sweep.py", str(space), "--output_dir", str(out),
               "--accelerate_config", "accelerate_configs/ddp.yaml"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "trial_0" / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and process.poll() is None, "trial 0 never started"
        time.sleep(0.2)
    trainers = psutil.Process(process.pid).children(recursive=True)  # the launcher and its 2 workers
    process.terminate()
    assert process.wait(timeout=120) == 130 and len(trainers) == 3
    _, alive = psutil.wait_procs(trainers, timeout=30)
    assert not alive
    assert [t.state.name for t in load_study(out).trials] == ["FAIL"]


@pytest.mark.slow
@pytest.mark.parametrize("command", section_commands("Hyperparameter sweeps", page="docs/sweeps.md"))
def test_readme_sweep_command_runs_as_written(command, tmp_path):
    """The page's sweep: 3 trials on 2 processes each, those below the median at step 30 pruned and stopped."""
    words = shlex.split(command)
    assert words[:2] == ["python", "scripts/sweep.py"]
    out = tmp_path / "sweep"
    result = run_command([sys.executable, *words[1:], "--output_dir", str(out)], timeout=900)
    assert_ok(result)
    study = load_study(out, name="digits")
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == int(words[words.index("--n_trials") + 1]) == len(study.trials)
    pruned = [t for t in study.trials if t.state.name == "PRUNED"]
    assert pruned, "the median pruner stops the trials below the median at step 30 (docs/sweeps.md: the third of three)"
    full = max(len(eval_lines(out / f"trial_{t.number}")) for t in study.trials)
    for trial in study.trials:
        trial_dir = out / f"trial_{trial.number}"
        assert_processes(trial_dir, 2)
        if trial.state.name == "COMPLETE":
            assert (
                eval_lines(trial_dir)[-1] == 100 and trial.value == last_row(read_metrics(trial_dir))["eval/accuracy"]
            )
        else:  # pruned at its first report after the warmup, and stopped early
            assert trial.last_step == 30 and len(eval_lines(trial_dir)) < full
    assert result.stdout.count("| PRUNED |") == len(pruned) and "best: trial" in result.stdout
    assert (out / "trials.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_command_of_the_page_is_run():
    assert_bash_blocks_run("docs/sweeps.md")


def test_a_metric_no_trial_logs_names_the_eval_keys_that_are(tmp_path):
    """A misspelt `metric:` is found once the first trial ends: the error suggests the close key and lists the rest."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "setup/world_size": 1}\n{"step": 4, "eval/loss": 0.5, "eval/mae": 0.3}\n')
    values = sweep.MetricValues(metrics, "eval/mea")
    assert values.new() == [] and values.last is None
    error = sweep.never_logged(values, tmp_path / "sweep.yaml")
    assert str(error) == (
        f"eval/mea is never logged in {metrics}; did you mean eval/mae? set `metric:` in {tmp_path / 'sweep.yaml'} to "
        "an eval key it holds (eval/loss, eval/mae)"
    )
