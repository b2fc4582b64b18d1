"""Scaling features through the same train.py: notebooks, auto batch size, early stopping, debug presets, profiler."""

import json

import pytest

from tests.conftest import QUICK, REPO, assert_ok, read_metrics, run_python, run_train, run_with_hook, series

LAUNCH_TWICE = """
import sys
sys.path.insert(0, {repo!r})
from accelerate import notebook_launcher
from train import main
for run in ("a", "b"):  # a second launch from the same process, like re-running a notebook cell
    notebook_launcher(main, args=({quick!r} + ["--output_dir", {out!r} + run],), num_processes=2)
"""


def test_notebook_launcher_forms_a_two_process_group_and_can_rerun(tmp_path):
    result = run_python("-c", LAUNCH_TWICE.format(repo=str(REPO), quick=QUICK, out=str(tmp_path / "run_")))
    assert_ok(result)
    for run in ("a", "b"):
        rows = read_metrics(tmp_path / f"run_{run}")
        assert rows[0]["setup/world_size"] == 2
        assert [r["step"] for r in rows if "train/loss" in r] == [2, 4, 6]  # one metrics file, each step once


def test_the_notebook_runs(tmp_path):
    notebook = json.loads((REPO / "notebooks" / "train_in_notebook.ipynb").read_text())
    code = "\n\n".join("".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code")
    result = run_python("-c", code, cwd=REPO / "notebooks")
    assert_ok(result)
    assert "world size: 2" in result.stdout


def test_auto_find_batch_size_keeps_the_global_batch(tmp_path):
    """A simulated out-of-memory error above 16 samples per device: halve once, accumulate 4 batches instead."""
    out = tmp_path / "run"
    oom_above_16 = """
from src.tasks.digits import Digits
loss = Digits.loss
def loss_or_oom(self, model, batch):
    if len(batch[0]) > 16:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    return loss(self, model, batch)
Digits.loss = loss_or_oom
"""
    result = run_with_hook(tmp_path, [*QUICK, "--output_dir", str(out), "--auto_find_batch_size", "true"],
                           extra=oom_above_16)  # fmt: skip
    assert_ok(result)
    setup = read_metrics(out)[0]
    assert (setup["setup/per_device_batch"], setup["setup/gradient_accumulation"], setup["setup/global_batch"]) == (
        16, 4, 64)  # fmt: skip
    assert len(series(read_metrics(out), "train/loss")) == 3  # the failed attempts left nothing behind
    logs = result.stdout + result.stderr
    assert logs.count("out of memory with a per-device batch of") == 1  # 32 -> 16: one line per halving


def test_early_stopping_stops_every_process_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    result = run_train("--max_steps", "200", "--eval_steps", "10", "--logging_steps", "10", "--learning_rate", "1e-9",
                       "--early_stopping_patience", "2", "--early_stopping_metric", "eval/accuracy",
                       "--early_stopping_mode", "max", "--output_dir", str(out), processes=2, timeout=120)  # fmt: skip
    assert_ok(result)  # a process that stopped alone would leave the other hanging until the timeout
    rows = read_metrics(out)
    assert rows[-1]["step"] == 30  # no improvement at steps 20 and 30
    assert (out / "checkpoints" / "step_30").is_dir() and (out / "model" / "model.safetensors").exists()
    assert (result.stdout + result.stderr).count("early stopping at step 30") == 1


def test_overfit_preset_drives_the_train_loss_to_zero(tmp_path):
    out = tmp_path / "run"
    result = run_train("--config", "configs/default.yaml", "--config", "configs/debug/overfit.yaml",
                       "--output_dir", str(out))  # fmt: skip
    assert_ok(result)
    assert series(read_metrics(out), "train/loss")[150] < 0.05


def test_smoke_preset_and_profiler_trace(tmp_path):
    out = tmp_path / "run"
    result = run_train("--config", "configs/default.yaml", "--config", "configs/debug/smoke.yaml",
                       "--output_dir", str(out), "--profile_steps", "2")  # fmt: skip
    assert_ok(result)
    assert read_metrics(out)[-1]["eval/num_samples"] == 64
    trace = json.loads((out / "profile" / "trace_rank0.json").read_text())
    assert any("aten::" in event.get("name", "") for event in trace["traceEvents"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gradient_checkpointing", "true"], "DigitsCNN does not support --gradient_checkpointing"),
        (["--early_stopping_patience", "1", "--early_stopping_metric", "eval/f1", "--eval_steps", "2"],
         "--early_stopping_metric eval/f1 is not logged"),
    ],
)  # fmt: skip
def test_unsupported_options_are_clear_errors(tmp_path, flags, message):
    result = run_train(*QUICK, "--output_dir", str(tmp_path / "run"), *flags)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
