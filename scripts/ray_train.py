"""train.py on N Ray Train workers: the unchanged `train.main` in each worker of a `TorchTrainer`.

    python scripts/ray_train.py --num_workers 2 --config_file accelerate_configs/ddp.yaml --max_steps 100
    python scripts/ray_train.py --address auto --num_workers 8 --use_gpu --config_file accelerate_configs/fsdp.yaml

This script's own options are below; every other argument goes to train.py (`--config`, `--max_steps`, ...).
Without `--address` it starts a new local Ray cluster for this run; `--address auto` (or `host:port`) joins a running
one, whose nodes must see this repository and `--output_dir` at the same paths (a shared file system, as with SLURM).

Ray's own AccelerateTrainer is deprecated (Ray 2.8), so each worker builds its Accelerator inside train.main as any
launch does. No `accelerate launch` reads the accelerate config here: this script reads it with Accelerate's own
launcher code (`_validate_launch_command`, then the same `prepare_*_env` the launcher would call) and gives every
worker the ACCELERATE_* / FSDP_* variables it would have set, so the config's strategy and mixed precision apply.
Ray sets up the process group itself (gloo on CPUs, NCCL on GPUs) and RANK, WORLD_SIZE, MASTER_ADDR...; train.py's
world-size check (src/distributed.py) then proves the workers formed one group.

A worker that dies is Ray's to handle: `FailureConfig(max_failures=...)` restarts the whole group, and train.py is
always run with `--resume_from_checkpoint latest` (as the SLURM scripts are), so a restart continues from the
template's latest checkpoint in --output_dir. Ray's own files go to <output_dir>/ray/.

Bad input (train.py's flags, the accelerate config, a Ray address that answers nothing) is one `error:` line and exit
code 2 before Ray starts; a run that stops for a known reason (src/errors.py) exits with its code and line.
"""

import argparse
import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.launch import check_config_file  # noqa: E402
from src.errors import RunStopped, UsageError, say  # noqa: E402

# What `accelerate launch` sets that describes the process topology: Ray Train sets its own, or decides (the device)
TOPOLOGY_VARIABLES = {"ACCELERATE_USE_CPU", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"}
ADDRESS_TIMEOUT_S = 5


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--num_workers", type=int, default=2, help="Ray Train workers (processes), default 2")
    parser.add_argument("--use_gpu", action="store_true", help="one GPU per worker (NCCL); default: CPU workers")
    parser.add_argument("--address", default=None, help="a running Ray cluster (auto, host:port); default: local")
    parser.add_argument("--config_file", default=None, help="the accelerate config: strategy, mixed precision")
    parser.add_argument("--max_failures", type=int, default=3, help="worker-group restarts Ray may make")
    return parser.parse_known_args(argv)


def launch_environment(config_file: str | None, num_workers: int) -> dict[str, str]:
    """The variables `accelerate launch --config_file F --num_processes N` would give each process (strategy,
    mixed precision, dynamo, FSDP_*, DeepSpeed's), from Accelerate's own launcher code and the same dispatch as
    accelerate/commands/launch.py: launch_command, without the topology (Ray's)."""
    import warnings

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    flags = ["--config_file", config_file] if config_file else []
    args = launch_command_parser().parse_args([*flags, "--num_processes", str(num_workers), "train.py"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "port 29500 in use": no port of the launcher's is used here
        args, defaults, mixed_precision_from_config = _validate_launch_command(args)
        if args.use_deepspeed and not args.cpu:
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            fields += ["mixed_precision"] if mixed_precision_from_config else []
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            _, env = prepare_deepspeed_cmd_env(args)
        elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
            env = prepare_multi_gpu_env(args)
        else:
            _, env = prepare_simple_launcher_cmd_env(args)
    set_here = {k: v for k, v in env.items() if os.environ.get(k) != v and k not in TOPOLOGY_VARIABLES}
    return {k: v for k, v in set_here.items() if k.startswith(("ACCELERATE_", "FSDP_", "MEGATRON_LM_"))}


def check_address(address: str | None) -> None:
    """A `host:port` (or ray://host:port) that accepts no connection is said now, not after Ray's own retries."""
    if address in (None, "auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address {address} is not host:port; give the head node's address, or auto")
    try:
        socket.create_connection((host, int(port)), timeout=ADDRESS_TIMEOUT_S).close()
    except OSError as err:
        raise UsageError(
            f"the Ray cluster at --address {address} does not answer ({err.strerror or err}); start it with "
            "`ray start --head`, check the address, or leave --address out for a local cluster"
        ) from err


def train_worker(job: dict) -> None:
    """One Ray Train worker: the driver's folder and the accelerate config's variables, then train.main."""
    os.chdir(job["cwd"])  # Ray starts workers in its own folder; train.py's paths are the driver's
    if job["repo"] not in sys.path:
        sys.path.insert(0, job["repo"])
    os.environ.update(job["environment"])
    if job.get("setup"):
        job["setup"]()
    import train

    train.main(job["train_args"])


def run(argv: list[str], worker_setup=None) -> None:
    """Check everything, then train on Ray. `worker_setup`: a function each worker calls before train.main (tests
    inject a failure with it)."""
    options, train_args = parse_args(argv)
    from src.cli import parse_config

    if options.num_workers < 1:
        raise UsageError(f"--num_workers must be >= 1, got {options.num_workers}")
    train_args = [*train_args, "--resume_from_checkpoint", "latest"]
    config = parse_config(train_args)  # train.py's own flag and config-file errors, before Ray starts
    if options.config_file and (problem := check_config_file(options.config_file)):
        raise UsageError(problem)
    environment = launch_environment(options.config_file, options.num_workers)
    check_address(options.address)

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    try:
        ray.init(
            address=options.address or "local",  # "local": a new cluster, never one some `ray start` left running
            include_dashboard=False if options.address is None else None,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}},
        )
    except ConnectionError as err:
        hint = "start one with `ray start --head`"
        raise UsageError(f"no Ray cluster at --address {options.address} ({err}); {hint}") from err
    job = {"cwd": os.getcwd(), "repo": str(REPO), "environment": environment, "train_args": train_args,
           "setup": worker_setup}  # fmt: skip
    trainer = TorchTrainer(
        train_worker,
        train_loop_config=job,
        scaling_config=ScalingConfig(num_workers=options.num_workers, use_gpu=options.use_gpu),
        run_config=RunConfig(
            name="ray",
            storage_path=os.path.abspath(config.output_dir),
            failure_config=FailureConfig(max_failures=options.max_failures),
        ),
    )
    try:
        trainer.fit()
    except ray.train.WorkerGroupError as err:
        stopped = [e for _, e in sorted(err.worker_failures.items()) if isinstance(e, RunStopped)]
        if stopped:
            raise stopped[0] from None
        raise
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None, worker_setup=None) -> None:
    """The command line: `run`, with a stop for a known reason as its one line and exit code."""
    try:
        run(sys.argv[1:] if argv is None else argv, worker_setup)
    except RunStopped as err:
        say(f"{err.prefix}: {err}")
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
