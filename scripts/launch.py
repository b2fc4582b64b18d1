"""`accelerate launch`, with the accelerate config file checked first.

    python scripts/launch.py --config_file accelerate_configs/ddp.yaml train.py --learning_rate 1e-3

Takes exactly the arguments of `accelerate launch`. A missing or broken config file, or one this machine can't run
(DeepSpeed not installed; on a CPU-only machine: fp16, CPU offload, FSDP version 1), is reported as one `error:` line
and exit code 2 before any process starts. (`accelerate launch` itself answers with a traceback; train.py catches
the second case too, but there the launcher adds its own ChildFailedError report after train.py's one line.)
"""

import os
import sys


def config_file_argument(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--config_file" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config_file="):
            return arg.split("=", 1)[1]
    return None


def check_config_file(path: str) -> str | None:
    """None if accelerate's own loader accepts the file, else the reason."""
    from accelerate.commands.config.config_args import load_config_from_file

    if not os.path.isfile(path):
        return f"accelerate config {path} does not exist; pick one from accelerate_configs/"
    try:
        config = load_config_from_file(path)
    except Exception as err:  # yaml, enum and dataclass errors: any of them means the file is unusable
        reason = " ".join(str(err).split())
        return f"accelerate config {path} is invalid ({reason}); fix it or regenerate it with `accelerate config`"
    problem = check_machine(config)
    return f"accelerate config {path}: {problem}" if problem else None


def check_machine(config) -> str | None:
    """The check train.py makes in every process (src/strategy.py: check_launch), once, before launching: the
    config's settings passed as the variables `accelerate launch` would give the processes."""
    from accelerate.utils import patch_environment

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from src.distributed import has_accelerator
    from src.errors import LaunchError
    from src.strategy import check_launch

    distributed_type = str(getattr(config, "distributed_type", "")).upper()
    fsdp, deepspeed = getattr(config, "fsdp_config", {}) or {}, getattr(config, "deepspeed_config", {}) or {}
    launched = {
        "ACCELERATE_USE_FSDP": str("FSDP" in distributed_type).lower(),
        "ACCELERATE_USE_DEEPSPEED": str("DEEPSPEED" in distributed_type).lower(),
        "ACCELERATE_MIXED_PRECISION": str(getattr(config, "mixed_precision", "no")),
        "FSDP_VERSION": str(fsdp.get("fsdp_version", 1)),
        "FSDP_OFFLOAD_PARAMS": str(fsdp.get("fsdp_offload_params", False)).lower(),
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": str(deepspeed.get("offload_optimizer_device", "none")),
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": str(deepspeed.get("offload_param_device", "none")),
    }
    try:
        with patch_environment(**launched):
            check_launch(use_cpu=not has_accelerator(), mixed_precision=None)
    except LaunchError as err:
        return str(err)
    return None


def exit_if_unusable(args: list[str]) -> None:
    """One `error:` line and exit code 2 when the launch's config file can't run here."""
    path = config_file_argument(args)
    problem = check_config_file(path) if path else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    args = sys.argv[1:]
    exit_if_unusable(args)
    os.execv(sys.executable, [sys.executable, "-m", "accelerate.commands.launch", *args])


if __name__ == "__main__":
    main()
