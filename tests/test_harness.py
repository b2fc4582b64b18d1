"""The harness's in-process runs (conftest.run_main): what `python train.py` gives (exit status, the error line,
the files), and this process as it was before (environment, cwd, argv, logging, signal handlers, Accelerate)."""

import logging
import os
import signal
import sys

from tests.conftest import QUICK, read_metrics, run_main, run_train, series


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
