"""Helpers to run train.py as a user would: `python train.py` or `accelerate launch` with N CPU processes."""

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from scripts.launch import free_port  # noqa: F401  (the tests take it from here)

REPO = Path(__file__).resolve().parents[1]

# Bytecode cached, as where PYTHONDONTWRITEBYTECODE is not set (CI's image sets it): the suite starts hundreds of
# processes (pytest-xdist's workers start after this), and scripts/setup.sh --dev compiles nothing up front
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

LAUNCHER_VARIABLES = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"}
HARNESS_VARIABLES = LAUNCHER_VARIABLES  # the tests' own: never a run's

# A short run of the default example; tests add their own flags after these.
QUICK = ["--max_steps", "6", "--logging_steps", "2", "--eval_steps", "1000"]


def launch_command(processes: int, config: str = "ddp") -> list[str]:
    """`python train.py`, or `accelerate launch` of accelerate_configs/<config>.yaml on `processes` processes."""
    if processes == 1:
        return [sys.executable, "train.py"]
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", f"accelerate_configs/{config}.yaml", "--num_processes", str(processes),
        "--main_process_port", str(free_port()), "train.py",
    ]  # fmt: skip


def run_train(*args: str, processes: int = 1, config: str = "ddp", **kwargs) -> subprocess.CompletedProcess:
    """Run train.py in a fresh process (or N of them, launched with accelerate_configs/<config>.yaml) from the repo
    root."""
    return run_command([*launch_command(processes, config), *args], **kwargs)


def run_python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return run_command([sys.executable, *args], **kwargs)


def run_snippet(code: str, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c code args` from the repo, a fresh process."""
    return run_command([sys.executable, "-c", code, *args], env=env, timeout=timeout)


def command_env(env: dict | None = None) -> dict:
    """Offline, one thread per process, no inherited launcher (or pytest-xdist worker) variables; `env` on top, its
    None values unset."""
    base = {k: v for k, v in os.environ.items() if k not in HARNESS_VARIABLES and not k.startswith("PYTEST_")}
    full_env = {**base, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", **(env or {})}
    return {k: v for k, v in full_env.items() if v is not None}


def run_command(command: list[str], env: dict | None = None, timeout: float = 300, cwd: Path = REPO, **kwargs):
    """Run `command` as a process of its own in `command_env(env)`, stdin closed."""
    return subprocess.run(
        command, cwd=cwd, env=command_env(env), capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL, **kwargs,
    )  # fmt: skip


def run_main(*args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python train.py args` as a call of train.py's `main` in this process: the same exit status, stdout and
    stderr, at no import cost. For 1-process runs checked by what they write, print and exit with; a check of how a
    process starts or ends (signals, imports, a launch) runs a real process instead. What a run changes
    process-wide is put back after it: Accelerate's singletons, os.environ, sys.argv, cwd, logging, signal handlers,
    torch's threads and random generators."""
    import io
    import logging
    import random
    import traceback

    import numpy as np
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from src.errors import command_line
    from train import main

    stdout, stderr = io.StringIO(), io.StringIO()
    loggers = [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    saved = {
        "environ": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "threads": torch.get_num_threads(),
        "handlers": logging.root.handlers[:], "levels": {logger: logger.level for logger in loggers},
        "signals": {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)},
        "random": (random.getstate(), np.random.get_state(), torch.get_rng_state()),
    }  # fmt: skip
    run_env = command_env(env)
    os.environ.clear()
    os.environ.update(run_env)
    sys.argv = ["train.py", *args]  # --debug is read from it
    os.chdir(cwd)  # the repo, or a copy of it (a page's commands run as written there)
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    returncode = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                command_line(main)(list(args))
            except SystemExit as stop:  # as the interpreter exits: an int is the status, anything else is printed
                if stop.code is None or isinstance(stop.code, int):
                    returncode = stop.code or 0
                else:
                    print(stop.code, file=sys.stderr)
                    returncode = 1
            except Exception:  # as the interpreter reports an uncaught exception: its traceback, exit status 1
                traceback.print_exc()
                returncode = 1
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        torch.compiler.reset()
        os.environ.clear()
        os.environ.update(saved["environ"])
        sys.argv = saved["argv"]
        os.chdir(saved["cwd"])
        torch.set_num_threads(saved["threads"])
        logging.root.handlers[:] = saved["handlers"]
        for logger, level in saved["levels"].items():
            logger.setLevel(level)
        for number, handler in saved["signals"].items():
            signal.signal(number, handler)
        random.setstate(saved["random"][0])
        np.random.set_state(saved["random"][1])
        torch.set_rng_state(saved["random"][2])
    command = [sys.executable, "train.py", *args]
    return subprocess.CompletedProcess(command, returncode, stdout.getvalue(), stderr.getvalue())


def run_on(processes: int, *args: str, config: str = "ddp", env: dict | None = None) -> subprocess.CompletedProcess:
    """train.py on `processes` processes: 1 in this process (run_main), more from the fork server (run_ranks)."""
    if processes == 1:
        return run_main(*args, env=env)
    return run_ranks(REPO / "train.py", list(args), processes, config=config, env=env)


def resolve_launch(argv: list[str]) -> dict:
    """What `accelerate launch <argv>` would start, without starting it: accelerate's own parsing and config merging
    (`launch_command`) run unchanged; the launcher it picks is replaced by a recorder that keeps the arguments and the
    environment the workers would get."""
    from unittest import mock

    import accelerate.commands.launch as launch
    import accelerate.utils.launch as launch_utils

    def recorder(name, prepare_env):
        def launcher(args):
            launched.update(launcher=name, args=args, env=prepare_env(args))

        return launcher

    launched = {}
    with contextlib.ExitStack() as stack:
        stack.callback(os.chdir, os.getcwd())
        os.chdir(REPO)  # the commands use paths relative to the repository root
        stack.enter_context(mock.patch.object(launch_utils, "is_port_in_use", lambda port: False))  # machine 0's check
        for name, prepare in [
            ("simple", lambda args: launch_utils.prepare_simple_launcher_cmd_env(args)[1]),
            ("multi_gpu", launch_utils.prepare_multi_gpu_env),
            ("deepspeed", lambda args: launch_utils.prepare_deepspeed_cmd_env(args)[1]),
        ]:
            stack.enter_context(mock.patch.object(launch, f"{name}_launcher", recorder(name, prepare)))
        launch.launch_command(launch.launch_command_parser().parse_args(argv))
    return launched


def run_ranks(script: Path, args: list[str], processes: int, config: str = "ddp", env: dict | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:  # fmt: skip
    """`accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes N script args`, its N ranks
    started from the fork server (run_forked), as torch's own distributed tests fork theirs: each rank gets the
    variables accelerate's launch code computes (resolve_launch) and torchrun adds. The exit status is the first
    failing rank's (torchrun's own is 1). What a launch itself does (its signals, its report, scripts/launch.py)
    runs a real one."""
    launch = ["--config_file", f"accelerate_configs/{config}.yaml", "--num_processes", str(processes)]
    error_files = Path(tempfile.mkdtemp(prefix="ranks-"))  # first_to_say's claims go there too
    with launcher_store() as port:
        launched = resolve_launch([*launch, "--main_process_port", str(port), str(script), *args])
        variables = {k: v for k, v in launched["env"].items() if os.environ.get(k) != v}
        environments = [
            command_env({**variables, **torchrun_variables(rank, processes, port, error_files), **(env or {})})
            for rank in range(processes)
        ]
        try:
            result = run_forked(script, args, environments, timeout=timeout)
        finally:
            shutil.rmtree(error_files, ignore_errors=True)
    command = ["accelerate", "launch", *launch, str(script), *args]
    return subprocess.CompletedProcess(command, result.returncode, result.stdout, result.stderr)


@contextlib.contextmanager
def launcher_store():
    """The ranks' store, held in this process as torchrun's agent holds it (torchrun_variables makes each rank its
    client): on a port the system picks, kept until the ranks end, so that no other run can take the port between
    its choice and the ranks' start. Yields the port."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def torchrun_variables(rank: int, processes: int, port: int, error_files: Path) -> dict[str, str]:
    """What torchrun gives rank `rank` of `processes` on one machine, the store at `port` held by the launcher
    (launcher_store); `error_files` is the launch's folder of TORCHELASTIC_ERROR_FILEs, where first_to_say claims its
    lines."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(processes),
        "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": error_files.name, "TORCHELASTIC_ERROR_FILE": str(error_files / str(rank) / "error.json"),
    }  # fmt: skip


def run_forked(script: Path, args: list[str], environments: list[dict], cwd: Path = REPO, timeout: float = 300):
    """`python script args` in `cwd`, once in each of `environments` (command_env's), each a real process that does
    not pay the imports again (~4 CPU-s a process for torch and the optimizer's torch._dynamo): a child of
    multiprocessing's fork server (`forking_context`), which imported them once. As torchrun does, the first process
    to fail stops the others. The exit status is the first failing process's (or 0; minus the signal's number for a
    process a signal ended); stdout and stderr are theirs, in the order of `environments`."""
    from multiprocessing.connection import wait

    folder = Path(tempfile.mkdtemp(prefix="forked-"))
    context = forking_context()
    processes = [
        context.Process(target=run_as_script, args=(str(script), args, environment, str(cwd), str(folder / str(i))))
        for i, environment in enumerate(environments)
    ]
    for process in processes:
        process.start()
    codes: list[int | None] = [None] * len(processes)
    deadline, failed, first_failure = time.monotonic() + timeout, False, 0
    while not failed and None in codes:
        waiting = [process.sentinel for process, code in zip(processes, codes, strict=True) if code is None]
        wait(waiting, timeout=min(REPORT_GRACE, max(0.0, deadline - time.monotonic())))
        codes = [code if code is not None else exit_status(process, folder / str(i))
                 for i, (process, code) in enumerate(zip(processes, codes, strict=True))]  # fmt: skip
        first_failure = next((code for code in codes if code), 0)  # before any kill
        failed = bool(first_failure) or time.monotonic() > deadline
    timed_out = not first_failure and failed
    # beside `exitcode`, which the fork server reports: ended with no stacks written, only the report was late
    running = [running_at(process.pid) for process in processes] if timed_out else []
    if timed_out:  # where each process is, into its stderr (run_as_script's faulthandler), before it is killed
        for process, code in zip(processes, codes, strict=True):
            if code is None:
                os.kill(process.pid, STACKS_SIGNAL)
        time.sleep(2)
    for i, process in enumerate(processes):  # the others, once one failed (or the time is up)
        if codes[i] is None:
            process.kill()
            process.join(REPORT_GRACE)
            codes[i] = process.exitcode
    outputs = [[read_if_there(folder / str(i) / name) for i in range(len(processes))] for name in ("out", "err")]
    shutil.rmtree(folder)
    if timed_out:
        raise ProcessesTimedOut(
            [str(script), *args], timeout, *("".join(o) for o in outputs), codes, outputs[1], running
        )
    return subprocess.CompletedProcess(
        [sys.executable, str(script), *args], first_failure, *("".join(o) for o in outputs)
    )


STACKS_SIGNAL = signal.SIGUSR2  # not the template's: SIGTERM and SIGUSR1 preempt a run
REPORT_GRACE = 2.0  # seconds between looks at a process's own exit file (exit_status)


def exit_status(process, folder: Path) -> int | None:
    """The exit status of a forked process, None while it runs: the fork server's report (`exitcode`), or, once the
    process has ended without one, the status it wrote itself (run_as_script's `exit` file). CI saw two finished ranks
    whose report came only after run_forked's 300 s timeout."""
    if process.exitcode is not None or running_at(process.pid):
        return process.exitcode
    own = folder / "exit"
    return int(own.read_text()) if own.is_file() else None


def running_at(pid: int) -> bool:
    """Whether process `pid` still runs (not ended, nor a zombie waiting to be reaped)."""
    import psutil  # accelerate's own dependency

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ProcessesTimedOut(subprocess.TimeoutExpired):
    """run_forked's processes outlived its timeout; the message holds each one's exit code and the end of its own
    stderr, where its threads' stacks were written as it was stopped (a CI log shows the message, not the output)."""

    def __init__(self, command, timeout, stdout, stderr, codes: list, errors: list[str], running: list[bool]):
        super().__init__(command, timeout, stdout, stderr)
        self.codes, self.errors, self.running = codes, errors, running

    def __str__(self):
        ends = "".join(
            f"\n--- process {i}, exit code {code} (-9: stopped then), running at the timeout: {running}, its stderr "
            f"ends:\n{error[-3000:]}"
            for i, (code, error, running) in enumerate(zip(self.codes, self.errors, self.running, strict=True))
        )
        return f"{super().__str__()}{ends}"


def read_if_there(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


@functools.cache
def manifest() -> dict:
    """features.yaml: each optional feature of this project by name ({}: every feature removed). Read once per pytest
    run (each test module's `needs` asks it at collection, in every removal check's copy too); don't edit it."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML was built with it
    return yaml.load((REPO / "features.yaml").read_text(), Loader=loader) or {}


def fork_server_imports() -> list[str]:
    """What the fork server imports once: train.py, the optimizer's first step (torch._dynamo, ~1 CPU-s a process) and
    what each feature's runs import at their start (features.yaml's `preload`, e.g. Hugging Face's auto classes: ~5
    CPU-s). The multiprocessing fork server skips a module that is not installed."""
    preloads = [name for feature in manifest().values() for name in feature.get("preload", [])]
    return ["torch._dynamo", "train", "tests.conftest", *preloads]


@functools.cache
def forking_context():
    """multiprocessing's "forkserver" start method, its server (one per test process, a fresh interpreter started at
    the first run) having imported `fork_server_imports()`; each run is a fork of it. The server's environment is this
    process's with the repository on PYTHONPATH (to import train.py and this module), given by starting a first process
    there; each run sets its own (run_as_script)."""
    import multiprocessing
    from unittest import mock

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(fork_server_imports())
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with mock.patch.dict(os.environ, {**command_env(), "PYTHONPATH": path}, clear=True):
        first = context.Process(target=int)  # the server starts with the first process, in this environment
        first.start()
    first.join()
    return context


def run_as_script(script: str, args: list[str], env: dict, cwd: str, folder: str) -> None:
    """In a child of the fork server: run `script` as `python script args` would in `env` and `cwd`, stdout and
    stderr to files in `folder` (stdin is already closed). What ends the interpreter ends the process: multiprocessing
    turns a SystemExit into the exit status, joins the threads left and flushes the streams; the script's at-exit
    functions run here, last registered first, as the interpreter runs them."""
    import atexit
    import faulthandler
    import multiprocessing
    import runpy
    import traceback

    import torch

    Path(folder).mkdir()
    for fd, name in ((1, "out"), (2, "err")):
        opened = os.open(Path(folder) / name, os.O_WRONLY | os.O_CREAT)
        os.dup2(opened, fd)
        os.close(opened)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it, as a pytest-xdist worker does
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # run_forked's timeout asks where each process is
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv, sys.path[0:0] = [script, *args], [str(Path(script).parent)]
    torch.set_num_threads(1)
    multiprocessing.set_start_method(None, force=True)  # a fresh interpreter's default (a child inherits "forkserver")
    exit_functions = []  # the script's: a multiprocessing child ends without running the interpreter's
    atexit.register = lambda function, *a, **k: exit_functions.append((function, a, k)) or function
    atexit.unregister = lambda function: exit_functions.__setitem__(
        slice(None), [entry for entry in exit_functions if entry[0] != function]
    )
    status = 1
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit:  # multiprocessing's reading of it
        status = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        raise
    except KeyboardInterrupt:  # multiprocessing prints it, exit status 1
        raise
    except BaseException:  # as the interpreter reports an uncaught exception: its traceback, exit status 1
        traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        for function, a, k in reversed(exit_functions):
            try:
                function(*a, **k)
            except Exception:  # the interpreter prints it and goes on
                traceback.print_exc()
        (Path(folder) / "exit.tmp").write_text(str(status))  # exit_status's, in case the fork server's report is late
        os.replace(Path(folder) / "exit.tmp", Path(folder) / "exit")


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def last_row(rows: list[dict], key: str = "eval/num_samples") -> dict:
    """The last metrics.jsonl row that logged `key` (by default the final evaluation's): a forker's own rows (an EMA's
    eval_ema/ after the final eval) may follow it."""
    return next(row for row in reversed(rows) if key in row)


def assert_processes(output_dir: Path, processes: int) -> None:
    """The run really trained on `processes` processes: every start logged (a resumed run logs one per start) says
    so in metrics.jsonl. A launcher that fell back to one process, or N copies that never formed a group, fail it."""
    starts = [row["setup/world_size"] for row in read_metrics(output_dir) if "setup/world_size" in row]
    assert starts and set(starts) == {processes}, f"{output_dir}: world sizes {starts}, expected {processes}"


def series(rows: list[dict], key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in rows if key in row}


def logged_losses(output_dir: Path) -> dict[int, float]:
    """step -> train/loss of a run, each step logged once (a resumed run must not repeat one)."""
    rows = read_metrics(output_dir)
    steps = [row["step"] for row in rows if "train/loss" in row]
    assert steps == sorted(set(steps)), f"a step was logged twice: {steps}"
    return series(rows, "train/loss")


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    )


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate used in this process (main(), a prepared loader): its process-wide singletons reset around it."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# train.py run through a wrapper that can inject a failure at a step (`hook`, with `step` and `metrics` in scope)
# or patch a function before training (`extra`), then the normal command line.
WRAPPER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import train
import src.checkpoint
import src.tracking
from src.errors import command_line

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts it: a pytest-xdist worker ignores it

def at_step(step, metrics):
    {hook}

log_metrics = src.tracking.log_metrics
def log_and_maybe_fail(accelerator, metrics, step):
    log_metrics(accelerator, metrics, step)
    if "train/loss" in metrics:
        at_step(step, metrics)
src.tracking.log_metrics = log_and_maybe_fail  # train.py calls tracking.log_metrics
{extra}
command_line(train.main)(sys.argv[1:])
"""


def signal_at(step: int, name: str = "SIGKILL") -> str:
    """A run_with_hook hook: the process sends itself signal `name` at log step `step` (SIGKILL: no handler runs)."""
    return f"if step == {step}: os.kill(os.getpid(), signal.{name})"


def run_with_hook(
    tmp_path: Path,
    args: list[str],
    hook: str = "pass",
    extra: str = "",
    processes: int = 1,
    config: str = "ddp",
    **kwargs,
):
    """`python wrapped_train.py args`, train.py through WRAPPER, in a process from the fork server (run_forked), or on
    N such ranks (run_ranks). `kwargs`: env, cwd, timeout."""
    script = tmp_path / "wrapped_train.py"
    script.write_text(WRAPPER.format(repo=str(REPO), hook=hook, extra=extra))
    if processes > 1:
        return run_ranks(script, args, processes, config=config, **kwargs)
    env, cwd = command_env(kwargs.pop("env", None)), kwargs.pop("cwd", REPO)
    return run_forked(script, args, [env], cwd=cwd, **kwargs)


def requirements_not_as_pinned() -> list[str]:
    """`package==pin (file: installed)` for each requirement that `bash scripts/setup.sh --dev` installs and this
    environment lacks or holds at another version: the tests of a missing one fail in ways that don't name it."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    files = [REPO / "requirements.txt", REPO / "requirements-dev.txt", *sorted((REPO / "requirements").glob("*.txt"))]
    wrong = []
    for file in files:
        lines = (line.split("#")[0].strip() for line in file.read_text().splitlines())
        for requirement in [Requirement(line) for line in lines if line]:
            try:
                installed = version(requirement.name)
            except PackageNotFoundError:
                installed = None
            if installed is None or not requirement.specifier.contains(installed, prereleases=True):
                wrong.append(f"{requirement} ({file.relative_to(REPO)}: {installed or 'not installed'})")
    return wrong


def pytest_report_header(config) -> str | None:
    """Said first, before failures that would not say it."""
    if wrong := requirements_not_as_pinned():
        return f"not as `bash scripts/setup.sh --dev` installs: {', '.join(wrong)}; run it before the tests"
    return None


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): one worker per usable core, at most 4. A worker's test may itself start 2 or 3
    training processes, and files run whole on one worker (--dist loadfile), so more workers mostly add memory."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 4))


# The test files that take longest, longest first (summed --durations on the 2-core VM, 2026-12-03; rerun
# `pytest --durations=0` to refresh it): pytest-xdist hands them out first, so that none of them starts last and sets
# the suite's length alone (pyproject.toml's --no-loadscope-reorder keeps this order; xdist's own puts the files with
# the most tests first, which sent the single 90 s lean-core check last). The rest follow in their usual order; a
# name that is no longer here (a feature removed) drops out.
LONGEST_FIRST = [
    "test_hf.py", "test_sharded.py", "test_generator.py", "test_sweep.py", "test_lean_core.py", "test_ray.py",
    "test_adapters.py", "test_lm.py", "test_tensor_parallel.py", "test_distributed.py", "test_streaming.py",
    "test_predict.py", "test_scale.py", "test_images.py", "test_object_storage.py", "test_checkpoint.py",
    "test_errors.py", "test_cluster_launch.py", "test_customize.py", "test_tracking.py", "test_harness.py",
    "test_benchmark.py", "test_docs.py", "test_plan_memory.py", "test_benchmark_trainer.py", "test_setup.py",
    "test_plot_metrics.py", "test_torchrun.py", "test_readme.py", "test_project.py",
]  # fmt: skip


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@contextlib.contextmanager
def built_once(request, name: str):
    """(folder, whether it still has to be built): one folder for the whole test run, shared by pytest-xdist's
    workers (a file lock makes the others wait for the one that builds it), a fresh one on the next run."""
    import fcntl

    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    shared = base.parent if hasattr(request.config, "workerinput") else base  # a worker's: pytest-N/popen-gwK/
    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / ".built"
        yield folder, not done.is_file()
        folder.mkdir(exist_ok=True)
        done.touch()


@pytest.fixture(scope="session")
def hf_assets(request) -> dict[str, str]:
    """A tiny BERT and GPT-2 with tokenizers trained here, and a text-classification data set: all offline, built
    once per test run, by both scripts with their defaults in an empty folder (tests/test_hf.py, test_sharded.py,
    test_streaming.py, test_hf_assets.py, which checks what the defaults make). Skipped where the hf feature was
    removed."""
    if not (REPO / "scripts" / "make_tiny_model.py").is_file():
        pytest.skip("the hf feature is not in this project")
    pytest.importorskip("transformers")
    with built_once(request, "hf") as (root, missing):
        if missing:
            root.mkdir(exist_ok=True)
            assert_ok(run_python(str(REPO / "scripts" / "make_tiny_model.py"), cwd=root))
            assert_ok(run_python(str(REPO / "scripts" / "make_text_data.py"), cwd=root))
    text = root / "data" / "text"
    data = f"{{train: {text / 'train.jsonl'}, eval: {text / 'eval.jsonl'}}}"
    tiny = root / "data" / "tiny"
    return {"bert": str(tiny / "bert"), "gpt2": str(tiny / "gpt2"), "data": data, "eval": str(text / "eval.jsonl"),
            "root": str(root / "data")}  # fmt: skip


STDLIB = REPO / "data" / "stdlib"


@pytest.fixture(scope="session")
def stdlib_text(request) -> Path:
    """data/stdlib/{train,eval}.parquet (configs/lm.yaml's data), built once (a second or two) where missing, by one
    xdist worker while the others wait; git-ignored. Skipped where the gpt feature was removed."""
    if not (REPO / "src" / "features" / "gpt").is_dir():
        pytest.skip("the gpt feature is not in this project")
    with built_once(request, "stdlib"):
        if not all((STDLIB / f"{split}.parquet").is_file() for split in ("train", "eval")):
            assert_ok(run_python("scripts/prepare_text.py"))
    return STDLIB


@pytest.fixture(scope="session")
def default_run(request) -> Path:
    """`python train.py`: the default digits example as the Quickstart runs it, trained once per test run for the
    tests that only read it (tests/test_train.py; tests/test_predict.py copies it as the Quickstart's runs/digits)."""
    with built_once(request, "default_run") as (folder, missing):
        if missing:
            assert_ok(run_train("--output_dir", str(folder / "run")))
    return folder / "run"
