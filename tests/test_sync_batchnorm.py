"""The sync_batchnorm feature (src/features/sync_batchnorm/): BatchNorm statistics over every process's batch (CUDA's
and, its own, CPU processes'), so `--norm batch` trains the same on 1 and N processes; warnings where it can't."""

import pytest
import torch

from tests.conftest import assert_ok, assert_processes, read_metrics, run_on, series

# As tests/test_distributed.py's: float32 round-off stays below 1e-6 over 40 steps at this learning rate.
# 3e-4: at 1e-3 AdamW amplified the last-bit differences of another order of additions past 1e-5 after ~10 steps on an
# AVX2-only CPU (up to 6.8e-4 by step 40; 2026-12-04); at 3e-4 the runs stay within 4.8e-7
SAME_RUN = ["--max_steps", "40", "--logging_steps", "1", "--eval_steps", "20", "--learning_rate", "3e-4"]


def test_batchnorm_layers_become_synchronised_on_n_processes(caplog):
    """torch's SyncBatchNorm on CUDA, the feature's on CPU processes, plain BatchNorm alone; on another device a
    warning says the statistics stay per process. The state dict stays BatchNorm's, so saved models load into the
    plain network."""
    from types import SimpleNamespace

    from torch import nn

    from src.features.sync_batchnorm import FEATURE
    from src.features.sync_batchnorm.batchnorm import CPUSyncBatchNorm

    def adapted(device: str, processes: int) -> nn.Module:
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(4)))
        model[1].running_mean.fill_(0.5)
        accelerator = SimpleNamespace(
            num_processes=processes, device=torch.device(device), gradient_accumulation_steps=1
        )
        return FEATURE.adapt_model(model, accelerator)

    with caplog.at_level("WARNING", logger="src.features.sync_batchnorm"):
        plain = adapted("cpu", 1)
        assert [type(m) for m in (plain[1], plain[2][0])] == [nn.BatchNorm2d, nn.BatchNorm1d]
        for device, synchronised in (("cuda", nn.SyncBatchNorm), ("cpu", CPUSyncBatchNorm)):
            model = adapted(device, 2)
            assert type(model[1]) is type(model[2][0]) is synchronised
            assert model.state_dict().keys() == plain.state_dict().keys()
            assert torch.equal(model[1].running_mean, plain[1].running_mean)
        assert caplog.records == []
        per_process = adapted("mps", 2)
        assert [type(m) for m in (per_process[1], per_process[2][0])] == [nn.BatchNorm2d, nn.BatchNorm1d]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("BatchNorm statistics are per process: no synchronised BatchNorm on mps")


@pytest.mark.parametrize("norm, accumulation, warned", [("batch", 2, True), ("batch", 1, False), ("group", 2, False)])
def test_batchnorm_under_accumulation_is_warned_at_start(norm, accumulation, warned, caplog):
    """BatchNorm's statistics are one micro-batch's: accumulated, another process count trains differently."""
    from types import SimpleNamespace

    from torch import nn

    from src.features.sync_batchnorm import FEATURE

    layer = nn.BatchNorm2d(4) if norm == "batch" else nn.GroupNorm(2, 4)
    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"), gradient_accumulation_steps=accumulation)
    with caplog.at_level("WARNING", logger="src.features.sync_batchnorm"):
        FEATURE.adapt_model(nn.Sequential(nn.Conv2d(1, 4, 3), layer), accelerator)
    lines = [r.getMessage() for r in caplog.records if "BatchNorm" in r.getMessage()]
    if warned:
        assert lines == [
            "the model has BatchNorm and each optimiser step accumulates 2 micro-batches: its statistics are those of "
            "one micro-batch, so another process count or per-device batch trains differently; use a per-device batch "
            "2 times as large (--global_batch_size / 1 processes: no accumulation), or GroupNorm (digits: --norm group)"
        ]
    else:
        assert lines == []


@pytest.mark.slow
def test_batchnorm_on_2_processes_trains_like_1_process_with_the_whole_batch(tmp_path):
    """--norm batch, per-device batch 32 on 2 CPU processes (BatchNorm synchronised by this feature) vs one
    process with the batch of 64, no accumulation on either: the same statistics, so the same per-step loss, eval
    (running statistics) and saved running statistics."""
    from safetensors.torch import load_file

    runs = {}
    for processes, per_device in ((1, "64"), (2, "32")):
        runs[processes] = tmp_path / f"p{processes}"
        result = run_on(processes, *SAME_RUN, "--norm", "batch", "--per_device_train_batch_size", per_device,
                        "--output_dir", str(runs[processes]))  # fmt: skip
        assert_ok(result)
        assert "FutureWarning" not in result.stderr  # no deprecated all-reduce (batchnorm.py)
        assert_processes(runs[processes], processes)
        assert read_metrics(runs[processes])[0]["setup/gradient_accumulation"] == 1
    one, two = (read_metrics(runs[n]) for n in (1, 2))
    for key in ("train/loss", "eval/loss"):
        assert list(series(two, key)) == list(series(one, key))
        torch.testing.assert_close(torch.tensor(list(series(two, key).values())),
                                   torch.tensor(list(series(one, key).values())), rtol=0, atol=1e-5)  # fmt: skip
    assert series(two, "eval/accuracy") == series(one, "eval/accuracy")
    saved = [load_file(runs[n] / "model" / "model.safetensors") for n in (1, 2)]
    statistics = [key for key in saved[0] if key.endswith(("running_mean", "running_var"))]
    assert statistics and set(saved[1]) == set(saved[0])
    for key in statistics:
        torch.testing.assert_close(saved[1][key], saved[0][key], rtol=0, atol=1e-5)
