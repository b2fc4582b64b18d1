"""The throughput feature (src/features/throughput/): train/tokens_per_s for tasks that count their tokens, and
train/mfu for those that count their FLOPs too, on GPUs with a known peak (faked here: the formula, not a GPU)."""

from types import SimpleNamespace

import pytest
import torch

from src.errors import EXIT_TASK_FAILED
from src.features import throughput
from src.features.throughput import FEATURE, CountsFlops, CountsTokens, throughput_metrics
from tests.conftest import QUICK, assert_ok, read_metrics, run_main
from tests.helpers import needs, needs_package, packed_from_scratch


class TokensTask:
    """A task that counts its tokens, not its FLOPs (as packed language_modeling)."""

    def __init__(self, tokens_per_sample: int | None = 128):
        self.tokens = tokens_per_sample

    def tokens_per_sample(self) -> int | None:
        return self.tokens


class TokensAndFlopsTask(TokensTask):
    """One that counts both (as causal_lm)."""

    def __init__(self, tokens_per_sample: int | None = 128, flops_per_token: float | None = 6e6):
        super().__init__(tokens_per_sample)
        self.flops = flops_per_token

    def flops_per_token(self) -> float | None:
        return self.flops


def fake_accelerator(device: str, num_processes: int = 1):
    return SimpleNamespace(device=torch.device(device), num_processes=num_processes)


def on_gpu(monkeypatch, name: str) -> None:
    monkeypatch.setattr(throughput.torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize("processes", [1, 4])
def test_mfu_on_a_known_gpu_is_tokens_times_flops_over_peak(monkeypatch, processes):
    on_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    metrics = throughput_metrics(TokensAndFlopsTask(), fake_accelerator("cuda:0", processes), samples_per_s=1000.0)
    assert metrics["train/tokens_per_s"] == 1000.0 * 128
    assert metrics["train/mfu"] == pytest.approx(1000.0 * 128 * 6e6 / (989e12 * processes), rel=1e-12)


def test_the_most_specific_gpu_name_gives_the_peak(monkeypatch):
    on_gpu(monkeypatch, "NVIDIA H100 PCIe")  # also contains "H100" (989e12): its own peak is 756e12
    metrics = throughput_metrics(TokensAndFlopsTask(), fake_accelerator("cuda:0"), samples_per_s=1000.0)
    assert metrics["train/mfu"] == pytest.approx(1000.0 * 128 * 6e6 / 756e12, rel=1e-12)


def test_no_mfu_on_an_unknown_gpu(monkeypatch):
    on_gpu(monkeypatch, "NVIDIA GeForce RTX 3090")
    metrics = throughput_metrics(TokensAndFlopsTask(), fake_accelerator("cuda:0"), samples_per_s=10.0)
    assert metrics == {"train/tokens_per_s": 10.0 * 128}


@pytest.mark.parametrize("task", [TokensTask(), TokensAndFlopsTask(flops_per_token=None)])
def test_no_mfu_for_a_task_that_does_not_count_its_flops(monkeypatch, task):
    on_gpu(monkeypatch, "NVIDIA H200")
    assert throughput_metrics(task, fake_accelerator("cuda:0"), samples_per_s=10.0) == {"train/tokens_per_s": 1280.0}


def test_cpu_logs_tokens_per_s_and_no_mfu():
    metrics = throughput_metrics(TokensAndFlopsTask(tokens_per_sample=64), fake_accelerator("cpu"), samples_per_s=3.0)
    assert metrics == {"train/tokens_per_s": 3.0 * 64}


@pytest.mark.parametrize("task", [object(), TokensAndFlopsTask(tokens_per_sample=None)], ids=["no_count", "none"])
def test_a_task_that_counts_no_tokens_logs_nothing_more(task):
    """A task without `tokens_per_sample` (digits), or whose count is None (unpacked texts)."""
    assert throughput_metrics(task, fake_accelerator("cpu"), samples_per_s=5.0) == {}
    metrics = {"train/loss": 1.0, "train/samples_per_s": 5.0, "epoch": 0.5}
    assert FEATURE.train_metrics(metrics, fake_accelerator("cpu"), task) == metrics


def test_the_hook_logs_tokens_per_s_right_after_samples_per_s():
    metrics = {"train/loss": 1.0, "train/samples_per_s": 5.0, "train/step_time_s": 0.1, "epoch": 0.5}
    logged = FEATURE.train_metrics(metrics, fake_accelerator("cpu"), TokensTask(tokens_per_sample=8))
    assert list(logged.items()) == [("train/loss", 1.0), ("train/samples_per_s", 5.0), ("train/tokens_per_s", 40.0),
                                    ("train/step_time_s", 0.1), ("epoch", 0.5)]  # fmt: skip


def test_the_contract_is_the_methods_not_a_base_class():
    """Typed protocols that tasks meet by having the methods: the core's Task declares neither."""
    from src.tasks.digits import Digits

    assert isinstance(TokensAndFlopsTask(), CountsTokens) and isinstance(TokensAndFlopsTask(), CountsFlops)
    assert isinstance(TokensTask(), CountsTokens) and not isinstance(TokensTask(), CountsFlops)
    assert not issubclass(Digits, CountsTokens) and not issubclass(Digits, CountsFlops)


@needs("gpt")
def test_the_gpt_counts_its_tokens_and_flops():
    from src.features.gpt.causal_lm import CausalLM

    assert issubclass(CausalLM, CountsTokens) and issubclass(CausalLM, CountsFlops)


@needs("hf")
@needs_package("transformers", "pip install -r requirements/hf.txt")
def test_hugging_face_language_modeling_counts_its_tokens_only():
    from src.features.hf.language_modeling import LanguageModeling

    assert issubclass(LanguageModeling, CountsTokens) and not issubclass(LanguageModeling, CountsFlops)


def test_a_tokens_per_sample_failing_is_one_line_naming_it(tmp_path, monkeypatch):
    """The hook runs in the task's error handling: a task's count failing at a log step is one line, as a loss()."""
    from src.tasks.digits import Digits

    def tokens_per_sample(self):
        raise ValueError("a counting bug")

    monkeypatch.setattr(Digits, "tokens_per_sample", tokens_per_sample, raising=False)
    failed = run_main(*QUICK, "--output_dir", str(tmp_path / "run"))
    assert failed.returncode == EXIT_TASK_FAILED, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert (
        last
        == "error: Digits.tokens_per_sample() failed: ValueError: a counting bug (--debug true shows the traceback)"
    )


def assert_tokens_per_s(out, tokens_per_sample: int) -> None:
    """Every log step's tokens/s, next to its samples/s, and no MFU (a CPU)."""
    logged = [row for row in read_metrics(out) if "train/loss" in row]
    assert logged
    for row in logged:
        assert row["train/tokens_per_s"] == pytest.approx(row["train/samples_per_s"] * tokens_per_sample, rel=1e-12)
        assert list(row).index("train/tokens_per_s") == list(row).index("train/samples_per_s") + 1
        assert "train/mfu" not in row  # MFU needs a GPU with a known peak


@pytest.mark.slow
@needs("gpt")
@pytest.mark.usefixtures("stdlib_text")
def test_a_causal_lm_run_logs_tokens_per_s_at_every_log_step(tmp_path):
    out = tmp_path / "run"
    args = ["--max_steps", "4", "--logging_steps", "2", "--eval_steps", "1000", "--max_eval_tokens", "4096"]
    assert_ok(run_main("--config", "configs/lm.yaml", *args, "--output_dir", str(out)))
    assert_tokens_per_s(out, tokens_per_sample=128)  # configs/lm.yaml's block_size


@pytest.mark.slow
@needs("hf")
@needs_package("transformers", "pip install -r requirements/hf.txt")
def test_a_packed_language_modeling_run_logs_tokens_per_s(hf_assets, tmp_path):
    out = tmp_path / "run"
    args = packed_from_scratch(hf_assets, 2, "--output_dir", str(out))
    assert_ok(run_main(*args))
    assert_tokens_per_s(out, tokens_per_sample=64)  # full blocks of --block_size 64
