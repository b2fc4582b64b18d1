"""`accelerate launch`, with the accelerate config file checked first.

    python scripts/launch.py --config_file accelerate_configs/ddp.yaml train.py --learning_rate 1e-3

Takes exactly the arguments of `accelerate launch`. A missing or broken config file, or one this machine can't run
(FSDP or DeepSpeed without a GPU, DeepSpeed not installed), is reported as one `error:` line and exit code 2 before
any process starts. (`accelerate launch` itself answers with a traceback; train.py catches the second case too, but
there the launcher adds its own ChildFailedError report after train.py's one line.)
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
    return check_machine(path, str(getattr(config, "distributed_type", "")))


def check_machine(path: str, distributed_type: str) -> str | None:
    """The same check train.py makes in every process (src/distributed.py: check_launch), once, before launching."""
    import importlib.util

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from src.distributed import has_accelerator

    wanted = next((name for name in ("FSDP", "DEEPSPEED") if name in distributed_type.upper()), None)
    label = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed"}.get(wanted)
    if wanted and not has_accelerator():
        return (f"accelerate config {path} asks for {label}, which needs GPUs, and this machine has none; "
                "use accelerate_configs/ddp.yaml (gloo DDP on the CPU) or accelerate_configs/cpu.yaml")  # fmt: skip
    if wanted == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        return f"accelerate config {path} asks for DeepSpeed, which is not installed; `pip install deepspeed`"
    return None


def main() -> None:
    args = sys.argv[1:]
    path = config_file_argument(args)
    problem = check_config_file(path) if path else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    os.execv(sys.executable, [sys.executable, "-m", "accelerate.commands.launch", *args])


if __name__ == "__main__":
    main()
