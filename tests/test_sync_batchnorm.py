"""The sync_batchnorm feature (src/features/sync_batchnorm/): BatchNorm statistics over every CPU process's batch, so
`--norm batch` trains the same on 1 and N processes."""

import pytest
import torch

from tests.conftest import assert_ok, assert_processes, read_metrics, run_on, series

# As tests/test_distributed.py's: float32 round-off stays below 1e-6 over 40 steps at this learning rate.
# 3e-4: at 1e-3 AdamW amplified the last-bit differences of another order of additions past 1e-5 after ~10 steps on an
# AVX2-only CPU (up to 6.8e-4 by step 40; 2026-12-04); at 3e-4 the runs stay within 4.8e-7
SAME_RUN = ["--max_steps", "40", "--logging_steps", "1", "--eval_steps", "20", "--learning_rate", "3e-4"]


def test_batchnorm_layers_become_synchronised_on_cpu_processes_only(caplog):
    """The feature's layers on N CPU processes (then the core warns of nothing), plain BatchNorm alone or on CUDA
    (where the core converts to torch's); the state dict stays BatchNorm's, so saved models load into the plain
    network."""
    from types import SimpleNamespace

    from torch import nn

    from src.distributed import sync_batchnorm
    from src.features.sync_batchnorm import FEATURE
    from src.features.sync_batchnorm.batchnorm import CPUSyncBatchNorm

    def adapted(device: str, processes: int) -> nn.Module:
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(4)))
        model[1].running_mean.fill_(0.5)
        accelerator = SimpleNamespace(
            num_processes=processes, device=torch.device(device), gradient_accumulation_steps=1
        )
        return FEATURE.adapt_model(model, accelerator)

    plain = adapted("cpu", 1)
    assert [type(m) for m in (plain[1], plain[2][0])] == [nn.BatchNorm2d, nn.BatchNorm1d]
    assert type(adapted("cuda", 2)[1]) is nn.BatchNorm2d
    model = adapted("cpu", 2)
    assert type(model[1]) is type(model[2][0]) is CPUSyncBatchNorm
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert torch.equal(model[1].running_mean, plain[1].running_mean)
    accelerator = SimpleNamespace(num_processes=2, device=torch.device("cpu"), gradient_accumulation_steps=1)
    with caplog.at_level("WARNING", logger="src.distributed"):
        assert sync_batchnorm(model, accelerator) is model
    assert caplog.records == []


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
