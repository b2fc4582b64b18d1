"""End to end on the default digits example: accuracy, outputs, the Python API."""

# every test here trains: the slow tier (pytest -m "not slow" skips them)

import pytest
from safetensors.torch import load_file

from src.config import TrainConfig
from tests.conftest import QUICK, assert_ok, last_row, read_metrics, run_main, series


@pytest.mark.slow
def test_default_example_reaches_95_percent(default_run):
    out = default_run  # `python train.py`, trained once per test run (tests/conftest.py)
    rows = read_metrics(out)
    final = last_row(rows)
    assert final["eval/accuracy"] >= 0.95, final
    assert final["eval/num_samples"] == 359
    assert final["step"] == 220  # 10 epochs x (1438 // 64) optimiser steps
    losses = series(rows, "train/loss")
    assert losses[220] < losses[10] / 10
    logged = next(row for row in rows if "train/loss" in row)  # by its keys: a forker's own rows may come between
    assert set(logged) >= {"step", "epoch", "train/loss", "train/lr", "train/grad_norm", "train/samples_per_s"}
    weights = load_file(out / "model" / "model.safetensors")
    assert any(name.startswith("classifier") for name in weights)
    assert "learning_rate: 0.003" in (out / "config.yaml").read_text()


@pytest.mark.slow
def test_main_takes_a_config_object_or_cli_args(tmp_path, fresh_accelerate_state):
    from train import main

    config = TrainConfig(output_dir=str(tmp_path / "a"), max_steps=4, logging_steps=2, eval_steps=1000)
    metrics = main(config)
    assert metrics["eval/num_samples"] == 359
    rows = read_metrics(tmp_path / "a")
    assert [row["step"] for row in rows if "train/loss" in row or "eval/loss" in row] == [2, 4, 4]

    metrics = main(["--output_dir", str(tmp_path / "b"), "--max_steps", "2", "--eval_steps", "1000"])
    assert metrics["eval/num_samples"] == 359


@pytest.mark.slow
def test_existing_run_is_not_clobbered(out):
    assert_ok(run_main(*QUICK, "--output_dir", str(out)))
    before = (out / "metrics.jsonl").read_bytes()
    result = run_main(*QUICK, "--output_dir", str(out), "--learning_rate", "0.1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {out} already holds a run")
    assert (out / "metrics.jsonl").read_bytes() == before

    (out / "mlflow.db").write_bytes(b"the previous run's")  # what --report_to mlflow,dvclive leaves (src/tracking.py)
    (out / "dvclive").mkdir()
    assert_ok(run_main(*QUICK, "--output_dir", str(out), "--overwrite_output_dir", "true"))
    assert len(series(read_metrics(out), "train/loss")) == 3  # replaced, not appended
    assert not (out / "mlflow.db").exists() and not (out / "dvclive").exists()  # nothing of it mixes into this run


@pytest.mark.slow
def test_main_in_process_restores_signal_handlers_even_when_training_fails(tmp_path, fresh_accelerate_state,
                                                                           monkeypatch):  # fmt: skip
    """A notebook calling main() keeps its own SIGTERM/SIGUSR1 handlers, after a run that raised as well."""
    import signal

    from src.errors import TaskFailed
    from src.tasks.digits import Digits
    from train import main

    def loss(self, model, batch):
        raise RuntimeError("the model broke")

    before = {name: signal.getsignal(name) for name in (signal.SIGTERM, signal.SIGUSR1)}
    monkeypatch.setattr(Digits, "loss", loss)
    with pytest.raises(
        TaskFailed,
        match=r"Digits.loss\(\) failed on a batch \[tensor float32 \[32, 1, 8, 8\], "
        r"tensor int64 \[32\]\]: RuntimeError: the model broke",
    ):
        main(TrainConfig(output_dir=str(tmp_path / "run"), max_steps=4, eval_steps=1000))
    assert {name: signal.getsignal(name) for name in before} == before
