"""The core promise: the same command trains the same way on 1 and N processes, with exact metrics."""

import re

import pytest
import torch
import yaml

from tests.conftest import (
    QUICK,
    REPO,
    assert_ok,
    assert_processes,
    free_port,
    launch_command,
    read_metrics,
    run_command,
    run_main,
    run_python,
    run_train,
    series,
)
from tests.helpers import as_written, needs, readme_command

# Over 40 steps at this learning rate float32 round-off (different summation order in DDP's all-reduce)
# stays below 1e-6; at higher rates training amplifies it, as it does for 1-process accumulation vs one batch.
SAME_RUN = ["--max_steps", "40", "--logging_steps", "1", "--eval_steps", "20", "--learning_rate", "1e-3"]


@pytest.fixture(scope="module")
def one_and_two_processes(tmp_path_factory):
    runs = {}
    for processes in (1, 2):
        output_dir = tmp_path_factory.mktemp(f"p{processes}") / "run"
        args = [*SAME_RUN, "--output_dir", str(output_dir)]
        result = run_main(*args) if processes == 1 else run_train(*args, processes=2)  # the README's launch, for real
        assert_ok(result)
        runs[processes] = (result, read_metrics(output_dir))
    return runs


def test_two_processes_really_ran_as_two(one_and_two_processes):
    for processes, (_, rows) in one_and_two_processes.items():
        assert [row["setup/world_size"] for row in rows if "setup/world_size" in row] == [processes]
        assert rows[0]["setup/global_batch"] == 64
        assert rows[0]["setup/gradient_accumulation"] == 2 // processes


def test_per_step_train_loss_equal_on_1_and_2_processes(one_and_two_processes):
    one, two = (series(one_and_two_processes[n][1], "train/loss") for n in (1, 2))
    assert list(one) == list(range(1, 41)) and list(two) == list(one)
    torch.testing.assert_close(torch.tensor(list(two.values())), torch.tensor(list(one.values())), rtol=0, atol=1e-5)


def test_eval_metrics_equal_on_1_and_2_processes(one_and_two_processes):
    one, two = (one_and_two_processes[n][1] for n in (1, 2))
    for key in ("eval/accuracy", "eval/num_samples"):
        assert series(one, key) == series(two, key) and len(series(one, key)) >= 2  # a forker may evaluate more
    torch.testing.assert_close(
        torch.tensor(list(series(two, "eval/loss").values())), torch.tensor(list(series(one, "eval/loss").values()))
    )


def test_ddp_holds_a_whole_copy_on_each_process(one_and_two_processes):
    """The baseline of tests/test_sharded.py's memory figures: DDP's processes each hold all of it."""
    one, two = (next(row for row in one_and_two_processes[n][1] if "memory/param_bytes" in row) for n in (1, 2))
    assert one_and_two_processes[2][1][0]["setup/strategy"] == "DDP"
    assert two["memory/param_bytes"] == one["memory/param_bytes"] > 0
    assert two["memory/optimizer_state_bytes"] == one["memory/optimizer_state_bytes"] > 0


def test_two_processes_log_each_line_once(one_and_two_processes, tmp_path):
    result, rows = one_and_two_processes[2]
    steps = [row["step"] for row in rows if "train/loss" in row]
    assert steps == sorted(set(steps))  # one metrics.jsonl, each step once
    console = result.stdout + result.stderr
    assert console.count("step 7 | train/loss") == 1
    assert console.count("model saved to") == 1


def readme_processes_command() -> str:
    """The README's launch line that names its own process count (`--num_processes 4`)."""
    from scripts.readme_commands import section_commands

    (command,) = [c for c in section_commands("Launch on any hardware") if "--num_processes" in c]
    return command


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2, "README"])
def test_eval_counts_every_sample_once(one_and_two_processes, out, processes):
    """359 eval images (a prime): uneven shards on any process count, still each sample counted once. 1 and 2
    processes: the runs above (evaluated twice each); more: the README's `--num_processes 4` command, run here as
    written (tests/test_readme.py leaves it to this test) and checked as test_readme.py checks a launch line."""
    if processes in one_and_two_processes:
        rows = one_and_two_processes[processes][1]
    else:
        words = as_written(readme_processes_command())
        result = run_command([*words, *QUICK, "--output_dir", str(out)], timeout=600)
        assert_ok(result)
        assert_processes(out, int(words[words.index("--num_processes") + 1]))
        rows = read_metrics(out)
        assert rows[0]["setup/strategy"] == "DDP"
    counted = list(series(rows, "eval/num_samples").values())
    assert counted and set(counted) == {359}


@pytest.mark.slow
def test_an_eval_split_smaller_than_the_processes_counts_its_samples_once(out):
    """1 eval sample on 2 processes trains and evaluates it once: the second process's share is padding, which
    gather_for_metrics drops (as evaluating without training does)."""
    assert_ok(run_train(*QUICK, "--max_eval_samples", "1", "--output_dir", str(out), processes=2))
    assert_processes(out, 2)
    assert list(series(read_metrics(out), "eval/num_samples").values()) == [1]


def test_the_readme_ddp_command_is_the_two_process_run_here(one_and_two_processes):
    """The README's `accelerate launch --config_file accelerate_configs/ddp.yaml train.py` is what the 2-process run
    above launches (with a free port, and the config's 2 processes), so tests/test_readme.py does not run it again."""
    from scripts.readme_commands import section_commands

    assert readme_command("ddp") in section_commands("Launch on any hardware")
    launched = launch_command(2, "ddp")
    assert launched[1:5] == ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml"]
    configured = yaml.safe_load((REPO / "accelerate_configs" / "ddp.yaml").read_text())["num_processes"]
    assert launched[-1] == "train.py" and launched[launched.index("--num_processes") + 1] == str(configured) == "2"
    rows = one_and_two_processes[2][1]
    assert (rows[0]["setup/strategy"], rows[0]["setup/world_size"]) == ("DDP", 2)


PLAIN_ACCELERATOR = """
import sys
sys.path.insert(0, {repo!r})
import src.distributed
src.distributed.has_accelerator = lambda: True  # what a plain Accelerator() assumes on a GPU-less machine
from src.errors import command_line
from train import main
command_line(main)(sys.argv[1:])
"""


def test_a_launch_that_starts_one_of_the_processes_asked_is_refused(out):
    """`accelerate launch --num_processes 2 train.py` without a config on a machine without GPUs runs one process
    (Accelerate's simple launcher): it would train alone while the user believes in DDP."""
    result = run_python("-m", "accelerate.commands.launch", "--num_processes", "2", "train.py", *QUICK,
                        "--output_dir", str(out))  # fmt: skip
    refused = re.findall(r"^error: accelerate launch started this one process, not the --num_processes asked: .* "
                         r"add --config_file accelerate_configs/ddp.yaml$", result.stderr, flags=re.M)  # fmt: skip
    assert len(refused) == 1, result.stderr[-3000:]
    assert "returned non-zero exit status 2" in result.stderr  # then the launcher's report of it
    assert not out.exists()


@pytest.mark.slow
def test_processes_that_form_no_group_are_refused(out, tmp_path):
    """torchrun starts 2 processes; without cpu=True each would see world size 1 and train alone, silently."""
    script = tmp_path / "plain_accelerator.py"
    script.write_text(PLAIN_ACCELERATOR.format(repo=str(REPO)))
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)]
    result = run_python(*command, *QUICK, "--output_dir", str(out))
    assert result.returncode != 0
    assert result.stderr.count("error: the launcher started 2 processes but they formed a group of 1") == 1
    # the launcher's report: a rank refused with 2 (the other may have been stopped by the launcher first)
    assert result.stderr.count("exitcode  : 2") >= 1
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fsdp", pytest.param("deepspeed_zero2", marks=needs("deepspeed"))])
def test_sharded_processes_that_form_no_group_are_refused(out, tmp_path, config):
    """The same guard under FSDP and DeepSpeed: without the gloo group src/strategy.py sets up, each process
    would be rank 0 of 1."""
    if config.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    script = tmp_path / "plain_accelerator.py"
    script.write_text(PLAIN_ACCELERATOR.format(repo=str(REPO)))
    command = [part if part != "train.py" else str(script) for part in launch_command(2, config)]
    result = run_command([*command, *QUICK, "--output_dir", str(out), "--mixed_precision", "no"])
    assert result.returncode != 0
    assert result.stderr.count("error: the launcher started 2 processes but they formed a group of 1") == 1
    # the launcher's report: a rank refused with 2 (the other may have been stopped by the launcher first)
    assert result.stderr.count("exitcode  : 2") >= 1
    assert not out.exists()


def test_the_strategy_is_read_through_torch_compile():
    """--torch_compile wraps the prepared model: the run's setup/strategy and its checkpoints' strategy (what resume
    checks) are the prepared model's, DDP here, not "single process"."""
    import torch.distributed as dist
    from torch import nn

    from src.strategy import strategy_of

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        assert strategy_of(torch.compile(ddp)) == strategy_of(ddp) == "DDP"  # compiled at its first call: none here
    finally:
        dist.destroy_process_group()
