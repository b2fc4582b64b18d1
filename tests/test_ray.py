"""Ray Train: scripts/ray_train.py runs the unchanged train.main on 2 CPU workers of a local Ray cluster that the
run starts, as one gloo DDP group that trains like one process; a worker killed mid-run is restarted by Ray and the
run resumes from the template's latest checkpoint."""

import json
import shlex
import subprocess
import sys

import pytest

from scripts.readme_commands import section_commands
from tests.conftest import (
    REPO,
    assert_ok,
    assert_processes,
    free_port,
    logged_losses,
    read_metrics,
    run_command,
    run_main,
)
from tests.helpers import assert_bash_blocks_run, assert_error_line, needs_package

pytestmark = needs_package("ray", "pip install -r requirements/ray.txt")

# 20 steps at the learning rate where 1 and 2 processes agree to float rounding (docs/how_it_works.md)
SAME_RUN = ["--learning_rate", "1e-3", "--max_steps", "20", "--logging_steps", "1", "--eval_steps", "1000"]
SAVE = ["--save_steps", "5"]
KILL_STEP = 13  # the restart resumes from checkpoints/step_10

# The docs command with a failure injected: Ray Train worker rank 1 SIGKILLs itself at KILL_STEP, first attempt only
# (the marker file survives the restart; each worker calls kill_rank_1_once before train.main builds anything), after
# recording the ACCELERATE_* / FSDP_* variables it was given.
KILLING_DRIVER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from scripts import ray_train

def kill_rank_1_once():
    import json
    import train

    launched = {{k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_"))}}
    with open({marker!r} + ".env" + os.environ["RANK"], "w") as f:
        json.dump(launched, f)  # what this worker got from the accelerate config

    import src.tracking

    log_metrics = src.tracking.log_metrics

    def log_and_maybe_die(accelerator, metrics, step):
        log_metrics(accelerator, metrics, step)
        if step == {step} and os.environ["RANK"] == "1" and not os.path.exists({marker!r}):
            open({marker!r}, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    src.tracking.log_metrics = log_and_maybe_die  # train.py calls tracking.log_metrics

ray_train.main(worker_setup=kill_rank_1_once)
"""


def docs_command() -> list[str]:
    (command,) = section_commands("Ray", page="docs/ray.md")
    words = shlex.split(command)
    assert words[:2] == ["python", "scripts/ray_train.py"], command
    return [sys.executable, *words[1:]]


def assert_close(losses: dict, expected: dict) -> None:
    assert list(losses) == list(expected) == list(range(1, 21))
    assert max(abs(losses[step] - expected[step]) for step in expected) <= 1e-5


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    assert_ok(run_main(*SAME_RUN, "--output_dir", str(out)))
    return logged_losses(out)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """The same command through KILLING_DRIVER, with checkpoints every 5 steps and one restart allowed."""
    folder = tmp_path_factory.mktemp("killed")
    out, marker = folder / "run", folder / "killed"
    driver = folder / "killing_driver.py"
    driver.write_text(KILLING_DRIVER.format(repo=str(REPO), step=KILL_STEP, marker=str(marker)))
    command = [sys.executable, str(driver), *docs_command()[2:], "--max_failures", "1"]
    result = run_command([*command, *SAME_RUN, *SAVE, "--output_dir", str(out)], timeout=600)
    assert_ok(result)
    return out, result, marker


@pytest.mark.slow
def test_killed_worker_is_restarted_and_the_run_resumes(killed_run, one_process):
    """docs/launching.md's command with rank 1 killed at step 13: Ray restarted the group, which resumed from
    checkpoints/step_10 and finished with each step logged once, one metrics.jsonl (rank 0's) and, per step, the
    losses of an uninterrupted 1-process run (1e-5)."""
    out, result, marker = killed_run
    assert marker.is_file()  # the kill happened
    assert "resuming from" in result.stdout + result.stderr and "step_10" in result.stdout + result.stderr
    assert_processes(out, 2)  # both starts: 2 workers each, one DDP group (not two trainings, not one process)
    assert len([row for row in read_metrics(out) if "setup/world_size" in row]) == 2  # one restart
    assert read_metrics(out)[0]["setup/strategy"] == "DDP"
    assert_close(logged_losses(out), one_process)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("metrics.jsonl")) == ["metrics.jsonl"]
    assert (out / "ray").is_dir()  # Ray's own files: under the run's folder


@pytest.mark.slow
def test_workers_get_the_accelerate_configs_variables(killed_run):
    """Each worker trained with what `accelerate launch --config_file accelerate_configs/ddp.yaml` would set."""
    from scripts.ray_train import launch_environment

    _, _, marker = killed_run
    expected = launch_environment("accelerate_configs/ddp.yaml", 2)
    assert expected["ACCELERATE_MIXED_PRECISION"] == "no"
    for rank in (0, 1):
        given = json.loads(marker.with_name(f"killed.env{rank}").read_text())
        given.pop("ACCELERATE_TORCH_DEVICE", None)  # Ray Train's own (ray/train/torch/config.py): the worker's device
        assert given == expected


def test_accelerate_config_becomes_what_accelerate_launch_would_set():
    """The config's strategy and mixed precision reach the workers as accelerate launch's variables; the topology
    (master address, ranks) is left to Ray."""
    from scripts.ray_train import launch_environment

    fsdp = launch_environment("accelerate_configs/fsdp.yaml", 2)
    assert fsdp["ACCELERATE_USE_FSDP"] == "true" and fsdp["FSDP_VERSION"] == "2"
    assert fsdp["ACCELERATE_MIXED_PRECISION"] == "bf16"
    zero3 = launch_environment("accelerate_configs/deepspeed_zero3.yaml", 2)
    assert zero3["ACCELERATE_USE_DEEPSPEED"] == "true" and zero3["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    ddp = launch_environment("accelerate_configs/ddp.yaml", 2)
    assert ddp["ACCELERATE_MIXED_PRECISION"] == "no" and "ACCELERATE_USE_FSDP" not in ddp
    for env in (fsdp, zero3, ddp):
        assert not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "ACCELERATE_USE_CPU"} & env.keys()


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--address", "127.0.0.1:{port}"], r"Ray cluster at --address 127\.0\.0\.1:\d+ does not answer"),
        (["--config_file", "accelerate_configs/nope.yaml"], r"accelerate config .*nope\.yaml does not exist"),
        (["--max_steps", "many"], r"max_steps"),
    ],
    ids=["dead-address", "missing-accelerate-config", "bad-train-flag"],
)
def test_bad_input_is_one_line_before_ray_starts(tmp_path, capsys, flags, pattern):
    """scripts/ray_train.py's main in this process (its command line's exit status and stderr): the error comes
    before ray.init, so no cluster starts and nothing is written."""
    from scripts import ray_train

    out = tmp_path / "run"
    flags = [flag.format(port=free_port()) for flag in flags]
    with pytest.raises(SystemExit) as stop:
        ray_train.main([*flags, "--output_dir", str(out)])
    captured = capsys.readouterr()
    assert_error_line(subprocess.CompletedProcess([], stop.value.code, captured.out, captured.err), pattern)
    assert not out.exists()


def test_the_docs_page_commands_are_run_here():
    assert_bash_blocks_run("docs/ray.md")
