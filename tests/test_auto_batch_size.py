"""The auto_batch_size feature (src/features/auto_batch_size/): after running out of memory, a smaller per-device
batch that keeps the global batch."""

import pytest

from src.cli import parse_config
from src.config import TrainConfig
from src.errors import UsageError
from src.features.auto_batch_size import FEATURE
from tests.conftest import QUICK, assert_ok, read_metrics, run_main, series


def test_auto_find_batch_size_needs_a_global_batch():
    with pytest.raises(UsageError, match="--auto_find_batch_size needs --global_batch_size"):
        FEATURE.check(parse_config(["--auto_find_batch_size", "true", "--global_batch_size", "null"]))


@pytest.mark.slow
def test_auto_find_batch_size_keeps_the_global_batch(tmp_path, monkeypatch):
    """A simulated out-of-memory error above 16 samples per device: halve once, accumulate 4 batches instead. The
    retry starts its own MLflow run: the failed try's is finished first (MLflow refuses a second active run)."""
    from src.tasks.digits import Digits

    out = tmp_path / "run"
    loss = Digits.loss

    def loss_or_oom(self, model, batch):
        if len(batch[0]) > 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return loss(self, model, batch)

    monkeypatch.setattr(Digits, "loss", loss_or_oom)
    result = run_main(*QUICK, "--output_dir", str(out), "--auto_find_batch_size", "true", "--report_to", "mlflow")
    assert_ok(result)
    setup = read_metrics(out)[0]
    assert (setup["setup/per_device_batch"], setup["setup/gradient_accumulation"], setup["setup/global_batch"]) == (
        16, 4, 64)  # fmt: skip
    assert len(series(read_metrics(out), "train/loss")) == 3  # the failed attempts left nothing behind
    logs = result.stdout + result.stderr
    assert logs.count("out of memory with a per-device batch of") == 1  # 32 -> 16: one line per halving


def test_auto_find_batch_size_tries_only_batches_that_keep_the_global_batch(fresh_accelerate_state, caplog):
    """30 samples a step on 1 process: 15, 6 (7 would not divide 30), 3, 1, then one line saying what to do."""
    from accelerate import PartialState

    from src.errors import UsageError
    from src.features.auto_batch_size import smaller_device_batch

    PartialState(cpu=True)
    config = TrainConfig(per_device_train_batch_size=30, global_batch_size=30)
    tried = [30]
    with caplog.at_level("WARNING", logger="src.features.auto_batch_size"), pytest.raises(UsageError) as refused:
        while True:
            tried.append(smaller_device_batch(config, tried[-1]))
    assert tried == [30, 15, 6, 3, 1]
    assert "out of memory with a per-device batch of 15: retrying with 6" in caplog.text
    assert str(refused.value).startswith("out of memory with a per-device batch of 1, the smallest that keeps")
