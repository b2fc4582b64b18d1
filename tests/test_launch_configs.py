"""accelerate_configs/, checked without launching anything (no GPU, no DeepSpeed needed).

Configs go through accelerate's own loader, argument parser and `launch_command`, with the final step (starting
torchrun or DeepSpeed) replaced by a recorder: what is checked is what `accelerate launch` would start. (The SLURM
scripts: tests/test_slurm.py.)
"""

import shlex
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import launch_command_parser
from accelerate.utils import DistributedType, patch_environment

from tests.conftest import REPO, resolve_launch

CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))

# Every config file, and what accelerate must read from it: (distributed_type, num_processes).
EXPECTED = {
    "cpu": (DistributedType.NO, 1),
    "single_gpu": (DistributedType.NO, 1),
    "ddp": (DistributedType.MULTI_GPU, 2),
    "fsdp": (DistributedType.FSDP, 2),
    "deepspeed_zero2": (DistributedType.DEEPSPEED, 2),
    "deepspeed_zero3": (DistributedType.DEEPSPEED, 2),
    "fsdp_tp": (DistributedType.FSDP, 4),
    "hsdp": (DistributedType.FSDP, 4),
    "multi_node": (DistributedType.MULTI_GPU, 16),
}
LAUNCHER = {
    DistributedType.NO: "simple",
    DistributedType.MULTI_GPU: "multi_gpu",
    DistributedType.FSDP: "multi_gpu",  # accelerate runs FSDP through torchrun too
    DistributedType.DEEPSPEED: "deepspeed",
}


def leading_comment(path: Path) -> list[str]:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return lines


def comment_launch_commands(path: Path) -> list[str]:
    """The commands shown in a config's header: comment lines that start with `accelerate launch`."""
    return [line for line in leading_comment(path) if line.startswith("accelerate launch ")]


# --- the config files ---


def test_every_config_file_is_known():
    """Every config is known here (the deepspeed and tensor_parallel features' may have been removed with them)."""
    optional = {"deepspeed_zero2", "deepspeed_zero3", "fsdp_tp", "hsdp"} - {path.stem for path in CONFIGS}
    assert {path.stem for path in CONFIGS} == set(EXPECTED) - optional, "add new accelerate_configs/*.yaml to EXPECTED"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_with_accelerates_loader(path):
    config = load_config_from_file(str(path))
    assert (config.distributed_type, config.num_processes) == EXPECTED[path.stem]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_header_says_when_and_how_to_launch_it(path):
    header = leading_comment(path)
    assert len(header) >= 2, f"{path.name} needs a leading comment: when to use it and the launch command"
    commands = comment_launch_commands(path)
    assert commands, f"{path.name}: no `accelerate launch` line in its leading comment"
    for command in commands:
        words = shlex.split(command)
        assert words[words.index("--config_file") + 1] == f"accelerate_configs/{path.name}", command
        assert "train.py" in words, command


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_sections_use_only_options_accelerate_launch_knows(path):
    """accelerate copies fsdp_config / deepspeed_config keys onto its arguments without checking them: a misspelt
    key (`fsdp_backward_prefetch_policy`, an old name) would be ignored silently."""
    config = load_config_from_file(str(path))
    options = vars(launch_command_parser().parse_args(["train.py"]))
    for section in (config.fsdp_config, config.deepspeed_config):
        assert not [key for key in section if key not in options]


COMMENT_COMMANDS = [
    pytest.param(path, command, id=f"{path.stem}-{i}")
    for path in CONFIGS
    for i, command in enumerate(comment_launch_commands(path))
]


@pytest.mark.parametrize("path, command", COMMENT_COMMANDS)
def test_comment_launch_command_parses_and_resolves(path, command):
    words = shlex.split(command)
    assert words[:2] == ["accelerate", "launch"]
    launched = resolve_launch(words[2:])
    args, env = launched["args"], launched["env"]
    distributed_type, processes = EXPECTED[path.stem]
    if "--num_processes" in words:
        processes = int(words[words.index("--num_processes") + 1])
    assert launched["launcher"] == LAUNCHER[distributed_type]
    assert args.training_script == "train.py"
    assert args.num_processes == processes
    assert env.get("ACCELERATE_USE_FSDP") == ("true" if distributed_type == DistributedType.FSDP else None)
    assert env.get("ACCELERATE_USE_DEEPSPEED") == ("true" if distributed_type == DistributedType.DEEPSPEED else None)


def test_fsdp_config_reaches_accelerates_fsdp_plugin(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    env = resolve_launch(["--config_file", "accelerate_configs/fsdp.yaml", "train.py"])["env"]
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with patch_environment(**{key: value for key, value in env.items() if key.startswith("FSDP_")}):
        plugin = FullyShardedDataParallelPlugin()  # as a worker builds it, from these variables
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    assert plugin.transformer_cls_names_to_wrap is None  # the model's _no_split_modules (GPT2Block, BertLayer)
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert not plugin.cpu_ram_efficient_loading and not isinstance(plugin.cpu_offload, CPUOffloadPolicy)
