"""The deepspeed feature (src/features/deepspeed/): what a DeepSpeed launch can't do is one line. Its 1-vs-N and
resume proofs are tests/test_sharded.py's, run for each accelerate config there is."""

import dataclasses
import importlib.util

import pytest
import torch

from src.config import TrainConfig
from src.errors import LaunchError, UsageError
from src.strategy import check_launch
from tests.conftest import QUICK, REPO, resolve_launch

installed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="pip install deepspeed")


@pytest.mark.parametrize(
    "env, message",
    [({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, r"offloads to the CPU \(offload_optimizer_device\)"),
     ({"ACCELERATE_GRADIENT_CLIPPING": "0.5"}, "sets gradient_clipping 0.5 but --max_grad_norm is 1.0")],
)  # fmt: skip
@installed
def test_a_deepspeed_launch_this_machine_cannot_run_is_one_line(monkeypatch, env, message):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=message):
        check_launch(use_cpu=True, config=TrainConfig())


@installed
def test_what_the_cpu_can_run_with_deepspeed_passes_the_launch_check(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")
    check_launch(use_cpu=True, config=TrainConfig())
    check_launch(use_cpu=True)  # scripts/launch.py: the accelerate config alone


@pytest.mark.parametrize(
    "flag, message",
    [("skip_nonfinite_batches", "--skip_nonfinite_batches does not work with DeepSpeed"),
     ("torch_compile", "--torch_compile is not supported with DeepSpeed")],
)  # fmt: skip
@installed
def test_what_deepspeed_cannot_do_is_one_line(monkeypatch, flag, message):
    config = dataclasses.replace(TrainConfig(), **{flag: True})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    check_launch(use_cpu=True, config=config)  # FSDP can
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UsageError, match=message):
        check_launch(use_cpu=True, config=config)


def test_deepspeed_config_without_deepspeed_is_one_line(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(LaunchError, match="asks for DeepSpeed, which is not installed; `pip install deepspeed`"):
        check_launch(use_cpu=False, config=TrainConfig())


@installed
def test_launch_script_refuses_cpu_offload_in_one_line(tmp_path, capsys):
    """scripts/launch.py's config check, in this process as its main() calls it before anything else
    (tests/test_errors.py runs a whole `python scripts/launch.py` refusing a config with one line and nothing more)."""
    from scripts.launch import exit_if_unusable

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    text = (REPO / "accelerate_configs" / "deepspeed_zero3.yaml").read_text()
    path = tmp_path / "deepspeed_zero3.yaml"
    path.write_text(text.replace("offload_param_device: none", "offload_param_device: cpu"))
    with pytest.raises(SystemExit) as stopped:
        exit_if_unusable(["--config_file", str(path), "--num_processes", "2", "train.py", *QUICK])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2
    assert stderr.strip().splitlines() == [stderr.strip()]  # one line, nothing else
    assert stderr.startswith(f"error: accelerate config {path}: ")
    assert "offloads to the CPU (offload_param_device)" in stderr


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_config_reaches_accelerates_deepspeed_plugin(stage):
    from accelerate.utils import DeepSpeedPlugin, patch_environment

    argv = ["--config_file", f"accelerate_configs/deepspeed_zero{stage}.yaml", "train.py"]
    env = resolve_launch(argv)["env"]
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with patch_environment(**{key: value for key, value in env.items() if key.startswith("ACCELERATE_")}):
        plugin = DeepSpeedPlugin()
    config = plugin.deepspeed_config
    assert config["zero_optimization"]["stage"] == stage
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    assert config["zero_optimization"]["offload_param"]["device"] == "none"
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is (stage == 3)
    assert plugin.zero3_init_flag is (stage == 3)
    assert config["gradient_clipping"] == "auto"  # train.py sets it from --max_grad_norm (src/strategy.py)
    # not fixed by the config: accelerate fills in train.py's accumulation (derived from global_batch_size)
    assert config["gradient_accumulation_steps"] == "auto"
