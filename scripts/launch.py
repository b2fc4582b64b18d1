"""`accelerate launch`, with the accelerate config file checked first and the processes' exit code passed on.

    python scripts/launch.py --config_file accelerate_configs/ddp.yaml train.py --learning_rate 1e-3

Takes exactly the arguments of `accelerate launch`. A missing or broken config file, a value of the wrong type
(`num_processes: two`), or one this machine can't run (DeepSpeed not installed; on a CPU-only machine: fp16, CPU
offload, FSDP version 1), is reported as one `error:` line and exit code 2 before any process starts. When the
processes stop with one of train.py's documented exit codes (src/errors.py: 2 bad input, 75 preempted, ...), they
have said why in one line: the launch exits with that code, without the launcher's ChildFailedError report
(`accelerate launch` itself answers these with a traceback and exit code 1).
"""

import logging
import os
import socket
import subprocess
import sys
import typing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # for src/, imported where it is needed


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
    problem = check_values(config) or check_machine(config)
    return f"accelerate config {path}: {problem}" if problem else None


def check_values(config) -> str | None:
    """The count or port whose value is not a whole number (accelerate's loader takes any YAML value, and the
    launcher fails on it later with a traceback), or a count below 1. Only the int fields: accelerate itself writes
    'no' into some of its bool ones (downcast_bf16)."""
    import dataclasses

    hints = typing.get_type_hints(type(config))
    examples = {"num_processes": 2, "num_machines": 1, "machine_rank": 0, "main_process_port": 29500}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if int not in (typing.get_args(hints[field.name]) or [hints[field.name]]) or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):  # YAML's true is an int to Python
            example = f", e.g. {field.name}: {examples[field.name]}" if field.name in examples else ""
            return f"{field.name} is {value!r}; write a whole number{example}"
    for name in ("num_processes", "num_machines"):
        value = getattr(config, name, 1)
        if value < 1 and not (name == "num_processes" and value == -1):  # -1: accelerate's "not set"
            return f"{name} is {value}; write 1 or more"
    return None


def check_machine(config) -> str | None:
    """The check train.py makes in every process (src/strategy.py: check_launch), once, before launching: the
    config's settings passed as the variables `accelerate launch` would give the processes."""
    from accelerate.utils import patch_environment

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
            check_launch(use_cpu=not has_accelerator())
    except LaunchError as err:
        return str(err)
    return None


def exit_if_unusable(args: list[str]) -> None:
    """One `error:` line and exit code 2 when the launch's config file can't run here."""
    from accelerate.commands.launch import launch_command_parser

    path = launch_command_parser().parse_args(args).config_file  # as `accelerate launch` reads it
    problem = check_config_file(path) if path else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def free_port() -> int:
    """A TCP port free now, for `--main_process_port`: launches side by side (sweep trials, checks, tests) can't clash
    on accelerate's default 29500."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def launch(args: list[str]) -> int:
    """`accelerate launch args` in this process, as the `accelerate` command runs it; the exit code. A documented
    exit code of a process (its one line said why) ends the launch with it, and the launcher's lines about the
    other processes it then stopped are left out."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from src.errors import DOCUMENTED_EXIT_CODES

    def reported(record: logging.LogRecord) -> bool:  # "process N failed (exitcode: 2)", "Sending process M SIGTERM"
        message = str(record.msg)
        if message.startswith("failed (exitcode"):
            return record.args[0] not in DOCUMENTED_EXIT_CODES
        return not message.startswith("Sending process")  # the others stopped: the report below names them

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(reported)
    try:
        launch_command(launch_command_parser().parse_args(args))
    except (ChildFailedError, subprocess.CalledProcessError) as err:
        # torch elastic: the processes' first failure is the cause; one process: Accelerate's simple launcher's
        code = err.get_first_failure()[1].exitcode if isinstance(err, ChildFailedError) else err.returncode
        if code in DOCUMENTED_EXIT_CODES:
            return code
        raise
    except SignalException as err:  # Ctrl-C or SIGTERM to the launcher: passed on, its processes said what they did
        return 128 + int(err.sigval)  # what a shell reports for a process the signal ended (130: Ctrl-C)
    return 0


if __name__ == "__main__":
    exit_if_unusable(sys.argv[1:])
    sys.exit(launch(sys.argv[1:]))
