"""Every command the README shows is run: the Quickstart by .ci/run, the launch commands here."""

import shlex
import sys

import pytest
import torch
import yaml

from scripts.readme_commands import section_commands
from tests.conftest import QUICK, REPO, assert_ok, assert_processes, free_port, read_metrics, run_command
from tests.helpers import STRATEGIES, readme_command


def test_quickstart_is_exactly_two_commands_and_ci_runs_them():
    setup_and_train, run_tests = section_commands("Quickstart")
    assert setup_and_train.startswith("bash scripts/setup.sh &&") and "train.py" in setup_and_train
    assert run_tests.startswith("bash scripts/setup.sh --dev &&") and "pytest" in run_tests
    assert "readme_commands.py quickstart" in (REPO / ".ci/run").read_text()


# Commands whose runs other tests train and read: the sharded strategies' (tests/test_sharded.py: killed, resumed,
# checked against one process), ddp.yaml's (tests/test_distributed.py: checked against one process), the one with
# its own --num_processes (tests/test_distributed.py: counts the eval samples on that many) and `python train.py`
# (conftest's default_run, trained once per test run).
RUN_ELSEWHERE = [
    *(readme_command(config) for config in STRATEGIES),
    readme_command("ddp"),
    *(command for command in section_commands("Launch on any hardware") if "--num_processes" in command),
    "python train.py",
]


@pytest.mark.slow
def test_python_train_py_is_the_default_run(default_run):
    """`python train.py` is conftest's default_run (the same command with an --output_dir): one process, alone."""
    assert "python train.py" in section_commands("Launch on any hardware")
    assert_processes(default_run, 1)
    assert read_metrics(default_run)[0]["setup/strategy"] == "single process"


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in section_commands("Launch on any hardware") if c not in RUN_ELSEWHERE])
def test_launch_command_runs(command, tmp_path):
    if "single_gpu" in command and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    words = shlex.split(command)
    if words[:2] == ["accelerate", "launch"]:
        words = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--main_process_port",
            str(free_port()),
            *words[2:],
        ]
    elif words[0] == "python":
        words[0] = sys.executable
    result = run_command([*words, *QUICK, "--output_dir", str(tmp_path / "run")], timeout=600)
    assert_ok(result)
    config = next((word for word in words if word.startswith("accelerate_configs/")), None)
    launched = yaml.safe_load((REPO / config).read_text()) if config else {"num_processes": 1}
    expected_processes = int(
        words[words.index("--num_processes") + 1] if "--num_processes" in words else launched["num_processes"]
    )
    assert_processes(tmp_path / "run", expected_processes)
    strategy = {
        "FSDP": "FSDP2",
        "DEEPSPEED": f"DeepSpeed ZeRO-{launched.get('deepspeed_config', {}).get('zero_stage')}",
    }
    expected = strategy.get(launched.get("distributed_type"), "DDP" if expected_processes > 1 else "single process")
    assert read_metrics(tmp_path / "run")[0]["setup/strategy"] == expected  # really sharded, not a DDP fallback
    if "cpu.yaml" in command:  # the CPU even where a GPU exists (on a machine without one: trivially)
        assert read_metrics(tmp_path / "run")[0]["setup/device"] == "cpu"


def test_cpu_config_forces_the_cpu():
    """What makes `accelerate_configs/cpu.yaml` train on the CPU on a GPU machine: accelerate's use_cpu."""
    config = yaml.safe_load((REPO / "accelerate_configs" / "cpu.yaml").read_text())
    assert config["use_cpu"] is True
    assert (config["distributed_type"], config["num_processes"]) == ("NO", 1)
