"""A fork server for the tests' 1-process runs: a short `python train.py ...` spends most of its time importing torch,
torch._dynamo, datasets, evaluate and deepspeed, not training. One server per pytest worker imports them once;
each run is a child forked from it that starts where a fresh `python script.py args` would, with its own pid, cwd,
environment, stdout/stderr and exit status (signals and SIGKILL included), so tests read it exactly as a
subprocess. The server never runs torch code, so no thread pool exists at the fork.

A multi-process launch (`python -m accelerate.commands.launch ... train.py`) is forked the same way, and so are its
ranks: the launcher runs as it always does (Accelerate's command line, torch elastic's agent with its monitoring,
its SIGTERM to the other ranks when one fails, its exit code), except that where the agent would start each rank as
`python -u train.py ...`, the rank is forked from the launcher instead, in a session of its own with that
environment and the interpreter's default signal handlers, unbuffered output and no atexit handlers of the launcher.

Only runs it cannot change are forked: the repo as cwd (a copied project imports its own src/), and an environment
that differs from the server's only in variables read at run time, not at import. Everything else, and every run
with TEST_FRESH_PROCESSES=1, starts a fresh process.

    python tests/forkserver.py     # reads one JSON request per line on stdin, answers {"pid"} then {"returncode"}
"""

import atexit
import contextlib
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = "accelerate.commands.launch"
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

    def accepts(self, command: list[str], env: dict, cwd, options: dict, snippet: bool = False) -> bool:
        """A script run (`python x.py ...`) or an Accelerate launch (`python -m accelerate.commands.launch ...`)
        from the repo, with only run-time variables changed; with `snippet`, a `python -c code` whose caller says
        that what the server imported can't change it (a check of what a process imports can't be one)."""
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        script = len(command) > 1 and (command[1].endswith(".py") or command[1:3] == ["-m", LAUNCHER])
        return (
            os.environ.get("TEST_FRESH_PROCESSES", "") in ("", "0")
            and self.server.poll() is None
            and not options
            and command[0] == sys.executable
            and (command[1:2] == ["-c"] if snippet else script)
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
    """In the child: become `python <argv>` (or `python -m accelerate.commands.launch <argv>`) in `cwd` with `env`,
    its output in the given files. Ends the process."""
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"]), (0, os.devnull)):
        target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    argv = request["argv"]
    if argv[:2] == ["-m", LAUNCHER]:
        fork_the_ranks()
        become(argv[1:], request["env"], launcher=True)
    become(argv, request["env"])


def become(argv: list[str], env: dict, launcher: bool = False) -> None:
    """Run the script argv[0] (or the launcher module) as __main__ with sys.argv = argv and `env`; exit as the
    interpreter would."""
    os.environ.clear()
    os.environ.update(env)
    script = "<string>" if argv[0] == "-c" else argv[0]
    sys.argv = ["-c", *argv[2:]] if argv[0] == "-c" else list(argv)
    sys.path[0] = "" if argv[0] == "-c" else os.getcwd() if launcher else os.path.dirname(os.path.abspath(script))
    try:
        if launcher:
            runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            exec(compile(argv[1], script, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = exit_code(stop)
    except BaseException as err:  # reported as the interpreter does, from the script's first frame on: exit 1
        trace = err.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename != script:
            trace = trace.tb_next
        sys.excepthook(type(err), err.with_traceback(trace), trace or err.__traceback__)
        code = 1
    exit_as_the_interpreter_does(code)


class ForkedRank:
    """What torch elastic's agent reads of a rank's `subprocess.Popen`: pid, poll(), wait(timeout)."""

    def __init__(self, pid: int, args: tuple):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


def fork_the_ranks() -> None:
    """In the launcher: the agent's `python -u script args` ranks become forks of this process (see the module's
    docstring); any other command is started as the agent would."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    popen = subprocess_handler.SubprocessHandler._popen

    def fork_or_popen(handler, args: tuple, env: dict):
        if len(args) < 3 or args[0] != sys.executable or args[1] != "-u" or not args[2].endswith(".py"):
            return popen(handler, args, env)
        pid = os.fork()
        if pid:
            return ForkedRank(pid, args)
        os.setsid()  # start_new_session, as the agent's Popen: it signals the rank's process group
        for number in range(1, signal.NSIG):  # a fresh interpreter's handlers, not the agent's
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        atexit._clear()  # the launcher's exit handlers are not the rank's
        for fd, file in ((1, handler._stdout), (2, handler._stderr)):
            if file is not None:
                os.dup2(file.fileno(), fd)
        for name, fd in (("stdout", 1), ("stderr", 2)):  # -u: unbuffered
            stream = getattr(sys, name)
            raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115
            setattr(sys, name, io.TextIOWrapper(raw, stream.encoding, stream.errors, write_through=True))
        become(list(args[2:]), env)

    subprocess_handler.SubprocessHandler._popen = fork_or_popen


def exit_code(stop: SystemExit) -> int:
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def exit_as_the_interpreter_does(code: int) -> None:
    """What an exiting interpreter does that a run can see (its threads joined, atexit handlers, output flushed),
    without tearing down every module the server imported: that is the tests' cost, not the run's."""
    threading._shutdown()  # the interpreter's own step: the main thread marked ended, then the others joined
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    answers = os.fdopen(os.dup(1), "w")  # the tests read the answers here; what the imports print goes to stderr
    os.dup2(2, 1)
    sys.path[0] = str(REPO)  # as `python train.py` has it
    import accelerate.commands.launch  # noqa: F401  (multi-process launches)
    import datasets  # noqa: F401  (imported by the runs' data loading)
    import evaluate  # noqa: F401  (metrics)
    import torch._dynamo  # noqa: F401  (torch.optim imports it)
    import torch.distributed.run  # noqa: F401

    import train  # noqa: F401

    with contextlib.suppress(ImportError):
        import deepspeed  # noqa: F401  (accelerate imports it when unwrapping a model, where installed)
    sys.stdout.flush()
    sys.stderr.flush()
    child = serve(answers)
    if child is not None:
        run(child)
