"""A fork server for the tests' 1-process runs: a short `python train.py ...` spends most of its time importing torch,
torch._dynamo, datasets, evaluate and deepspeed, not training. One server per pytest worker imports them once;
each run is a child forked from it that starts where a fresh `python script.py args` would, with its own pid, cwd,
environment, stdout/stderr and exit status (signals and SIGKILL included), so tests read it exactly as a
subprocess. The server never runs torch code, so no thread pool exists at the fork.

Only runs it cannot change are forked: the repo as cwd (a copied project imports its own src/), and an environment
that differs from the server's only in variables read at run time, not at import. Everything else, and every run
with TEST_FRESH_PROCESSES=1, starts a fresh process.

    python tests/forkserver.py     # reads one JSON request per line on stdin, answers {"pid"} then {"returncode"}
"""

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# botocore reads these when a run makes its S3 client (tests/test_object_storage.py), not when it is imported
AWS_VARIABLES = {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"}
AWS_VARIABLES |= {"AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"}
RUN_TIME_VARIABLES = {"TRAIN_DEBUG", "MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_API_KEY", "NETRC", *AWS_VARIABLES}


class ForkServer:
    """The tests' side: start the server with `env` (run_command's base environment), fork runs from it."""

    def __init__(self, env: dict):
        self.env = env
        pipe = subprocess.PIPE
        self.server = subprocess.Popen(
            [sys.executable, __file__], stdin=pipe, stdout=pipe, stderr=subprocess.DEVNULL, env=env, cwd=REPO
        )
        self.pending = b""

    def accepts(self, command: list[str], env: dict, cwd, options: dict) -> bool:
        """A script run (`python x.py ...`) from the repo, with only run-time variables changed."""
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return (
            os.environ.get("TEST_FRESH_PROCESSES", "") in ("", "0")
            and self.server.poll() is None
            and not options
            and len(command) > 1
            and command[0] == sys.executable
            and command[1].endswith(".py")
            and Path(cwd).resolve() == REPO
            and changed <= RUN_TIME_VARIABLES
        )

    def run(self, command: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as folder:
            stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"argv": command[1:], "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
            self.server.stdin.write((json.dumps(request) + "\n").encode())
            self.server.stdin.flush()
            pid = self.reply(None)["pid"]
            answer = self.reply(timeout)
            if answer is None:  # as subprocess.run(timeout=...): the child killed, TimeoutExpired raised
                os.kill(pid, signal.SIGKILL)
                self.reply(None)
                raise subprocess.TimeoutExpired(command, timeout, stdout.read_text(), stderr.read_text())
            return subprocess.CompletedProcess(command, answer["returncode"], stdout.read_text(), stderr.read_text())

    def reply(self, timeout: float | None) -> dict | None:
        """The server's next line, or None after `timeout` seconds."""
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.server.stdout], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.server.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError("the tests' fork server exited")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)


def serve(answers) -> dict | None:
    """The server's loop; in a forked child it returns that child's request."""
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            return request
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)
    return None


def run(request: dict) -> None:
    """In the child: become `python <argv>` in `cwd` with `env`, its output in the given files. Ends the process."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"]), (0, os.devnull)):
        target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = exit_code(stop)
    except BaseException as err:  # reported as the interpreter does, from the script's first frame on: exit 1
        trace = err.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename != script:
            trace = trace.tb_next
        sys.excepthook(type(err), err.with_traceback(trace), trace)
        code = 1
    exit_as_the_interpreter_does(code)


def exit_code(stop: SystemExit) -> int:
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def exit_as_the_interpreter_does(code: int) -> None:
    """What an exiting interpreter does that a run can see (its threads joined, atexit handlers, output flushed),
    without tearing down every module the server imported: that is the tests' cost, not the run's."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    answers = os.fdopen(os.dup(1), "w")  # the tests read the answers here; what the imports print goes to stderr
    os.dup2(2, 1)
    sys.path[0] = str(REPO)  # as `python train.py` has it
    import datasets  # noqa: F401  (imported by the runs' data loading)
    import evaluate  # noqa: F401  (metrics)
    import torch._dynamo  # noqa: F401  (torch.optim imports it)

    import train  # noqa: F401

    with contextlib.suppress(ImportError):
        import deepspeed  # noqa: F401  (accelerate imports it when unwrapping a model, where installed)
    sys.stdout.flush()
    sys.stderr.flush()
    child = serve(answers)
    if child is not None:
        run(child)
