"""scripts/plot_metrics.py, its command line run as a user would (its `__main__`, in this process), on small
synthetic metrics.jsonl files."""

import contextlib
import io
import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.readme_commands import section_commands
from tests.conftest import QUICK, assert_ok, assert_processes, run_command
from tests.helpers import as_written, workspace

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, world_size: int, extra_eval: str = "eval/accuracy") -> Path:
    rows = [{"step": 0, "setup/world_size": world_size, "setup/device": "cpu"}]
    for step in range(5, 65, 5):
        rows.append({"step": step, "train/loss": 2.3 / step, "train/lr": 1e-3, "train/samples_per_s": 100.0 + step})
        if step % 20 == 0:
            rows.append({"step": step, "eval/loss": 2.0 / step, extra_eval: 0.5 + step / 200, "eval/num_samples": 359})
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def plot(*args) -> subprocess.CompletedProcess:
    """`python scripts/plot_metrics.py args`: the script's own `__main__` run in this process (runpy), its exit
    status, stdout and stderr; no process start for a few milliseconds of work."""
    command = [sys.executable, "scripts/plot_metrics.py", *map(str, args)]
    stdout, stderr, saved_argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = command[1:]
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(str(REPO / "scripts" / "plot_metrics.py"), run_name="__main__")
        returncode = 0
    except SystemExit as stop:  # sys.exit(main()): its status (argparse's own errors exit 2 too)
        returncode = stop.code or 0
    finally:
        sys.argv = saved_argv
    return subprocess.CompletedProcess(command, returncode, stdout.getvalue(), stderr.getvalue())


def assert_input_error(result: subprocess.CompletedProcess, out: Path, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr
    assert all(word in last for word in words), last
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_two_runs_make_a_png(tmp_path):
    one, two = write_run(tmp_path / "one", 1), write_run(tmp_path / "two", 2, extra_eval="eval/perplexity")
    out = tmp_path / "plots" / "curves.png"
    result = plot(one, two, "-o", out)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == PNG_SIGNATURE

    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    # train/loss, eval/accuracy, eval/loss, eval/perplexity, train/lr, train/samples_per_s: a 2 x 3 grid.
    assert width >= 1000 and 500 <= height < width, (width, height)


def test_labels_and_one_run(tmp_path):
    out = tmp_path / "one.png"
    result = plot(write_run(tmp_path / "one", 4), "-o", out, "--label", "baseline")
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_missing_metrics_file(tmp_path):
    good, empty = write_run(tmp_path / "good", 1), tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out.png"
    assert_input_error(plot(good, empty, "-o", out), out, str(empty / "metrics.jsonl"), "--output_dir")


def test_unreadable_line(tmp_path):
    run = write_run(tmp_path / "run", 1)
    bad_line = len((run / "metrics.jsonl").read_text().splitlines()) + 1
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 65, "train/lo')  # a line cut short by a killed run
    out = tmp_path / "out.png"
    assert_input_error(plot(run, "-o", out), out, str(run / "metrics.jsonl"), f"line {bad_line} ")


def test_label_count_must_match(tmp_path):
    one, two = write_run(tmp_path / "one", 1), write_run(tmp_path / "two", 2)
    out = tmp_path / "out.png"
    assert_input_error(plot(one, two, "-o", out, "--label", "only one"), out, "--label")


@pytest.mark.slow
def test_plot_command_draws_a_1_and_a_2_process_run(tmp_path, default_run, monkeypatch):
    """The page's command over the Quickstart's `python train.py` run (conftest's default_run, trained once for the
    tests that read it) as runs/digits and a 2-process launch as runs/digits_ddp; the command in the workspace, its
    `__main__` in this process (plot)."""
    (command,) = section_commands("Plots", page="docs/tracking.md")
    cwd = workspace(tmp_path)
    shutil.copytree(default_run, cwd / "runs" / "digits")
    ddp = "accelerate launch --config_file accelerate_configs/ddp.yaml train.py"
    assert_ok(run_command([*as_written(ddp), *QUICK, "--output_dir", "runs/digits_ddp"], cwd=cwd))
    for name, processes in (("digits", 1), ("digits_ddp", 2)):
        assert_processes(cwd / "runs" / name, processes)
    _, script, *args = as_written(command)
    assert script == "scripts/plot_metrics.py", command
    monkeypatch.chdir(cwd)
    assert_ok(plot(*args))
    assert (cwd / "curves.png").read_bytes().startswith(b"\x89PNG")
