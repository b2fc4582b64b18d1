"""The harness's in-process runs (conftest.run_main) and forked ranks (conftest.run_ranks): what `python train.py` and
`accelerate launch` give (exit status, the error line, the files), and this process as it was before (environment,
cwd, argv, logging, signal handlers, Accelerate)."""

import logging
import os
import signal
import sys

import pytest

from tests.conftest import (
    QUICK,
    REPO,
    ProcessesTimedOut,
    command_env,
    read_metrics,
    run_command,
    run_forked,
    run_main,
    run_on,
    run_train,
    run_with_hook,
    series,
    signal_at,
)


def process_state() -> dict:
    from accelerate.state import AcceleratorState

    return {
        "environ": dict(os.environ), "cwd": os.getcwd(), "argv": list(sys.argv),
        "handlers": list(logging.root.handlers), "level": logging.root.level,
        "signals": [signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)],
        "accelerate": AcceleratorState._shared_state == {},
    }  # fmt: skip


def test_a_call_of_main_exits_writes_and_says_what_a_process_does(tmp_path):
    before = process_state()
    runs = {}
    for name, run in (("process", run_train), ("in_process", run_main)):
        out = tmp_path / name
        ok = run(*QUICK, "--output_dir", str(out))
        refused = run(*QUICK, "--output_dir", str(out))  # a run is already there
        runs[name] = (ok.returncode, refused.returncode, refused.stderr.strip().splitlines()[-1].replace(name, "-"))
        runs[name] += (series(read_metrics(out), "train/loss"), series(read_metrics(out), "eval/accuracy"))
    assert runs["in_process"] == runs["process"]
    assert runs["process"][:2] == (0, 2)
    assert process_state() == before


def test_forked_ranks_train_as_a_launch_does_and_stop_as_a_process_does(tmp_path):
    """run_on(2) starts its ranks from the fork server (conftest.run_forked): a real `accelerate launch` of the same
    run gives the same losses, metrics and world size; a refused run exits with its ranks' status (2) and its one
    error line (the launcher's own status would be 1, its report naming the 2); the test's process stays as it was."""
    before = process_state()
    runs = {}
    for name, run in (
        ("launched", lambda *args: run_train(*args, processes=2)),
        ("forked", lambda *args: run_on(2, *args)),
    ):
        out = tmp_path / name
        assert run(*QUICK, "--output_dir", str(out)).returncode == 0
        rows = read_metrics(out)
        runs[name] = (rows[0]["setup/world_size"], series(rows, "train/loss"), series(rows, "eval/accuracy"))
    assert runs["forked"] == runs["launched"] and runs["forked"][0] == 2
    refused = run_on(2, *QUICK, "--output_dir", str(out))  # a run is already there
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode == 2 and len(errors) == 1 and f"{out} already holds a run" in errors[0]
    assert process_state() == before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hook", "status"), [("if step == 2: raise RuntimeError('a bug')", 1), (signal_at(2), -signal.SIGKILL)]
)
def test_a_forked_process_ends_as_python_ends_it(tmp_path, hook, status):
    """A process from the fork server (run_with_hook) and `python wrapped_train.py` of the same script end alike:
    the exit status, an uncaught exception's traceback as stderr's end, and the script's at-exit functions run (none
    after SIGKILL)."""
    at_exit = "import atexit; atexit.register(print, 'the at-exit function ran', flush=True)"
    forked = run_with_hook(tmp_path, [*QUICK, "--output_dir", str(tmp_path / "forked")], hook=hook, extra=at_exit)
    process = run_command([sys.executable, str(tmp_path / "wrapped_train.py"), *QUICK, "--output_dir",
                           str(tmp_path / "process")])  # fmt: skip
    ends = {}
    for name, result in (("forked", forked), ("process", process)):
        traceback = "Traceback" in result.stderr and result.stderr.strip().splitlines()[-1]
        ends[name] = (result.returncode, "the at-exit function ran" in result.stdout, traceback)
    assert ends["forked"] == ends["process"], ends
    assert ends["process"] == (status, status == 1, status == 1 and "RuntimeError: a bug")


@pytest.mark.slow
def test_forked_processes_that_outlive_the_timeout_say_where_they_are(tmp_path):
    """A hang in forked ranks (a collective one never joins) fails with each process's stack in the message: a CI log
    shows the message only. The one that finished in time has its exit code."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, time\n"
        "def waiting_for_a_peer():\n    time.sleep(60)\n"
        "if os.environ['RANK'] == '1':\n    waiting_for_a_peer()\n"
    )
    environments = [command_env({"RANK": str(rank)}) for rank in range(2)]
    with pytest.raises(ProcessesTimedOut) as stopped:
        run_forked(script, [], environments, cwd=REPO, timeout=3)
    assert stopped.value.codes == [0, -signal.SIGKILL] and stopped.value.running == [False, True]
    message = str(stopped.value)
    assert "timed out after 3 seconds" in message and "in waiting_for_a_peer" in message, message
    assert message.index("process 1, exit code -9") < message.index("in waiting_for_a_peer"), message  # its own


def test_forked_processes_whose_report_never_comes_end_on_their_own_status(tmp_path, monkeypatch):
    """The fork server's report of a process's end can come late (CI saw two finished ranks reported only after the
    300 s timeout): run_forked then reads the status each process wrote itself, once it no longer runs. Here the
    report never comes: `exitcode` stays None and the sentinel is a pipe nobody writes."""
    from multiprocessing.process import BaseProcess

    pipes = {}  # a pipe nobody writes, for each process
    monkeypatch.setattr(BaseProcess, "exitcode", property(lambda self: None))
    monkeypatch.setattr(BaseProcess, "sentinel", property(lambda self: pipes.setdefault(id(self), os.pipe())[0]))
    script = tmp_path / "ends.py"
    script.write_text("import os, sys\nsys.exit(int(os.environ['RANK']) * 3)\n")
    environments = [command_env({"RANK": str(rank)}) for rank in range(2)]
    try:
        assert run_forked(script, [], environments, cwd=REPO, timeout=60).returncode == 3
    finally:
        for fd in (fd for pipe in pipes.values() for fd in pipe):
            os.close(fd)
