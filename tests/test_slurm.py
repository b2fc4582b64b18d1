"""scripts/slurm/: the sbatch scripts run for real under bash, with fake `srun`, `scontrol`, `accelerate` and `python`
first on PATH, and requeue_if_preempted.sh on its own (the slurm feature, features.yaml)."""

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from scripts.readme_commands import section_commands
from tests.conftest import REPO, resolve_launch
from tests.helpers import assert_bash_blocks_run

SLURM = REPO / "scripts" / "slurm"
SBATCH_SCRIPTS = sorted(SLURM.glob("*.sbatch"))
REQUEUE = SLURM / "requeue_if_preempted.sh"
# the multi-node configs here (the deepspeed feature's may have been removed)
CONFIGS = [
    c
    for c in ("multi_node", "fsdp", "deepspeed_zero2", "deepspeed_zero3")
    if (REPO / "accelerate_configs" / f"{c}.yaml").is_file()
]


# --- the SLURM scripts ---

# Variables the scripts (or the fakes) read: the tests set them, none is inherited from the caller's environment.
SCRIPT_INPUTS = ("SLURM_", "SRUN_", "OMP_", "TORCH_ELASTIC", "FAKE_", "NPROC", "ACCELERATE_CONFIG", "MAIN_PROCESS_PORT")
FAKE_LAUNCHER = """#!/bin/bash
# Stands in for `accelerate` and `python`: records how srun ran it on node $SLURM_NODEID.
printf '%s\\0' "${0##*/}" "$@" > "$FAKE_LOG/launch.$SLURM_NODEID"
echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-} TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-}" \\
    > "$FAKE_LOG/env.$SLURM_NODEID"
if [[ -n "${FAKE_PREEMPT:-}" ]]; then  # what train.py does on SIGTERM; the launcher then reports 1, not 75
    mkdir -p "$OUTPUT_DIR/checkpoints/step_7"
    echo '{"step": 7, "preempted": true}' > "$OUTPUT_DIR/checkpoints/step_7/trainer_state.json"
    exit 1
fi
exit "${FAKE_STATUS:-0}"
"""
FAKE_SRUN = """#!/bin/bash
# Runs its command once per node, one task per node, as SLURM would (options are written --name=value).
echo "$*" >> "$FAKE_LOG/srun"
while [[ "$1" == -* ]]; do shift; done
for ((node = 0; node < ${SLURM_NNODES:-1}; node++)); do
    SLURM_NODEID=$node PATH="$FAKE_BIN:$PATH" "$@" || exit $?
done
"""
FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "$FAKE_LOG/scontrol"
if [[ "$1" == show && "$2" == hostnames ]]; then printf '%s\\n' gpu-node-1 gpu-node-2; fi
"""


@pytest.fixture
def slurm(tmp_path):
    """A fake SLURM: `run(script, *args, **env)` runs a script as sbatch would; `scontrol` is what it was asked."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    fakes = {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "accelerate": FAKE_LAUNCHER, "python": FAKE_LAUNCHER}
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    class Slurm:
        output_dir = tmp_path / "run"

        def run(self, script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
            full_env = {
                **{k: v for k, v in os.environ.items() if not k.startswith(SCRIPT_INPUTS)},
                "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "FAKE_BIN": str(bin_dir),
                "FAKE_LOG": str(log),
                "SLURM_SUBMIT_DIR": str(REPO),
                "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NAME": "train",
                "SLURM_NNODES": "1",
                "OUTPUT_DIR": str(self.output_dir),
                **env,
            }
            return subprocess.run(
                ["bash", str(script), *args], env=full_env, cwd=tmp_path, capture_output=True, text=True, timeout=60
            )

        def launched(self, node: int = 0) -> list[str]:
            return (log / f"launch.{node}").read_text().split("\0")[:-1]

        def launched_env(self, node: int = 0) -> dict:
            return dict(item.split("=", 1) for item in (log / f"env.{node}").read_text().split())

        def scontrol(self) -> list[str]:
            path = log / "scontrol"
            return path.read_text().splitlines() if path.exists() else []

    return Slurm()


def resume_args(slurm) -> list[str]:
    """What every sbatch script passes to train.py after the user's arguments."""
    return ["--resume_from_checkpoint", "latest", "--output_dir", str(slurm.output_dir)]


@pytest.mark.parametrize("script", sorted(SLURM.glob("*")), ids=lambda p: p.name)
def test_slurm_script_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", SBATCH_SCRIPTS, ids=lambda p: p.name)
def test_sbatch_script_has_the_requeue_settings(script):
    text = script.read_text()
    for line in ["#SBATCH --requeue", "#SBATCH --signal=TERM@120", "set -euo pipefail", 'cd "${SLURM_SUBMIT_DIR']:
        assert line in text
    assert "requeue_if_preempted.sh" in text
    assert f"sbatch scripts/slurm/{script.name} --config configs/default.yaml" in text  # the usage line


def test_single_node_sbatch_runs_ddp_on_all_gpus(slurm):
    from src.cli import parse_config

    user_args = ["--config", "configs/default.yaml", "--max_steps", "5"]
    result = slurm.run(SLURM / "single_node.sbatch", *user_args, SLURM_GPUS_ON_NODE="4")
    assert result.returncode == 0, result.stderr
    program, *argv = slurm.launched()
    assert program == "accelerate" and argv[0] == "launch"
    launched = resolve_launch(argv[1:])
    assert launched["launcher"] == "multi_gpu" and launched["args"].num_processes == 4
    assert launched["args"].config_file == "accelerate_configs/ddp.yaml"
    train_args = launched["args"].training_script_args
    assert train_args == [*user_args, *resume_args(slurm)]
    # the run lands where requeue_if_preempted.sh looks, although configs/default.yaml sets its own output_dir
    config = parse_config(train_args)
    assert (config.output_dir, config.resume_from_checkpoint, config.max_steps) == (str(slurm.output_dir), "latest", 5)
    assert int(slurm.launched_env()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < 120  # workers are killed before the limit
    assert slurm.scontrol() == []


def test_single_node_sbatch_with_one_gpu_runs_one_process(slurm):
    result = slurm.run(SLURM / "single_node.sbatch", SLURM_GPUS_ON_NODE="1")
    assert result.returncode == 0, result.stderr
    assert slurm.launched() == ["python", "train.py", *resume_args(slurm)]


@pytest.mark.parametrize("config", CONFIGS)
def test_multi_node_sbatch_gives_every_node_its_rank_and_the_c10d_endpoint(slurm, config):
    env = {"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-node-[1-2]", "SLURM_GPUS_ON_NODE": "8"}
    result = slurm.run(SLURM / "multi_node.sbatch", ACCELERATE_CONFIG=f"accelerate_configs/{config}.yaml", **env)
    assert result.returncode == 0, result.stderr
    for node in (0, 1):
        program, *argv = slurm.launched(node)
        assert program == "accelerate" and argv[0] == "launch"
        args = resolve_launch(argv[1:])["args"]
        assert args.machine_rank == node  # expanded on each node, not once in the batch script
        assert (args.num_processes, args.num_machines, args.nproc_per_node) == (16, 2, "8")
        assert args.rdzv_backend == "c10d"
        assert args.rdzv_endpoint == "gpu-node-1:29500"  # without it c10d would rendezvous on each node's localhost
        assert args.training_script_args == resume_args(slurm)


def test_cpu_sbatch_splits_the_cpus_between_processes(slurm, monkeypatch):
    result = slurm.run(SLURM / "cpu.sbatch", SLURM_CPUS_PER_TASK="16", NPROC="4")
    assert result.returncode == 0, result.stderr
    assert slurm.launched_env()["OMP_NUM_THREADS"] == "4"
    program, *argv = slurm.launched()
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    launched = resolve_launch(argv[1:])
    assert launched["launcher"] == "multi_gpu" and launched["args"].num_processes == 4
    assert launched["env"]["OMP_NUM_THREADS"] == "4"  # accelerate passes it on to every worker


@pytest.mark.parametrize("script", SBATCH_SCRIPTS, ids=lambda p: p.name)
def test_sbatch_requeues_when_the_launch_ended_in_a_preemption_checkpoint(slurm, script):
    env = {"SLURM_JOB_NODELIST": "gpu-node-1", "SLURM_GPUS_ON_NODE": "2"}
    result = slurm.run(script, FAKE_PREEMPT="1", **env)
    assert result.returncode == 0, result.stderr
    assert slurm.scontrol()[-1] == "requeue 4242"


@pytest.mark.parametrize("script", SBATCH_SCRIPTS, ids=lambda p: p.name)
def test_sbatch_fails_with_the_launchers_status_otherwise(slurm, script):
    stale = slurm.output_dir / "checkpoints" / "step_7"  # a previous job's preemption; this launch failed
    stale.mkdir(parents=True)
    (stale / "trainer_state.json").write_text('{"step": 7, "preempted": true}')
    an_hour_ago = time.time() - 3600
    os.utime(stale / "trainer_state.json", (an_hour_ago, an_hour_ago))
    env = {"SLURM_JOB_NODELIST": "gpu-node-1", "SLURM_GPUS_ON_NODE": "2"}
    result = slurm.run(script, FAKE_STATUS="3", **env)
    assert result.returncode == 3
    assert "requeue 4242" not in slurm.scontrol()


# --- requeue_if_preempted.sh on its own ---


def write_checkpoint(output_dir: Path, step: int, preempted: bool) -> None:
    path = output_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(f'{{\n  "step": {step},\n  "preempted": {str(preempted).lower()}\n}}')


@pytest.fixture
def requeue(tmp_path):
    """Run requeue_if_preempted.sh with a fake scontrol first on PATH; returns (exit code, scontrol calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {shlex.quote(str(calls))}\n')
    (bin_dir / "scontrol").chmod(0o755)

    def run(output_dir: Path, *status: str, **env: str) -> tuple[int, list[str]]:
        base = {k: v for k, v in os.environ.items() if k != "LAUNCH_START"}
        full_env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", **env}
        result = subprocess.run(
            ["bash", str(REQUEUE), str(output_dir), *status], env=full_env, capture_output=True, text=True, timeout=30
        )
        return result.returncode, calls.read_text().splitlines() if calls.exists() else []

    return run


def test_requeue_when_the_newest_checkpoint_was_preempted(requeue, tmp_path):
    write_checkpoint(tmp_path / "run", 9, preempted=False)
    write_checkpoint(tmp_path / "run", 10, preempted=True)  # newest by number (step_10 sorts before step_9 as text)
    assert requeue(tmp_path / "run", "1") == (0, ["requeue 4242"])


def test_no_requeue_when_the_final_model_exists(requeue, tmp_path):
    write_checkpoint(tmp_path / "run", 10, preempted=True)
    (tmp_path / "run" / "model").mkdir()
    (tmp_path / "run" / "model" / "model.safetensors").write_bytes(b"")
    assert requeue(tmp_path / "run", "0") == (0, [])


def test_no_requeue_when_only_an_older_checkpoint_was_preempted(requeue, tmp_path):
    write_checkpoint(tmp_path / "run", 9, preempted=True)
    write_checkpoint(tmp_path / "run", 10, preempted=False)
    assert requeue(tmp_path / "run", "1") == (1, [])


def test_no_requeue_without_checkpoints_and_the_launchers_status_is_kept(requeue, tmp_path):
    assert requeue(tmp_path / "run", "2") == (2, [])
    assert requeue(tmp_path / "run") == (0, [])


def test_no_requeue_for_a_preemption_checkpoint_older_than_this_launch(requeue, tmp_path):
    write_checkpoint(tmp_path / "run", 10, preempted=True)
    assert requeue(tmp_path / "run", "1", LAUNCH_START=str(int(time.time()) + 60)) == (1, [])
    assert requeue(tmp_path / "run", "1", LAUNCH_START=str(int(time.time()) - 60)) == (0, ["requeue 4242"])


def test_slurm_commands_run_under_a_fake_slurm(slurm):
    """docs/launching.md's sbatch commands: each script runs (under fake srun/scontrol/launchers) on every node and
    passes the command's arguments on to train.py."""
    commands = section_commands("SLURM clusters", page="docs/slurm.md")
    assert len(commands) == 3
    for command in commands:
        words = shlex.split(command)
        script = next(i for i, word in enumerate(words) if word.endswith(".sbatch"))
        assert words[0] == "sbatch" and all(word.startswith("--") for word in words[1:script]), command
        args = words[script + 1 :]
        nodes = int(next((w.split("=")[1] for w in words[1:script] if w.startswith("--nodes=")), 1))
        env = {"SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": f"gpu-node-[1-{nodes}]", "SLURM_GPUS_ON_NODE": "2",
               "SLURM_CPUS_PER_TASK": "4"}  # fmt: skip
        result = slurm.run(REPO / words[script], *args, **env)
        assert result.returncode == 0, (command, result.stderr)
        resume = ["--resume_from_checkpoint", "latest", "--output_dir", str(slurm.output_dir)]
        for node in range(nodes):
            launched = slurm.launched(node)
            assert "train.py" in launched and launched[-len(args) - 4 :] == [*args, *resume], (command, launched)


def test_the_docs_page_commands_are_run_here():
    assert_bash_blocks_run("docs/slurm.md")
