"""The tests' fork server (tests/forkserver.py) runs a script as a fresh `python script.py` would: the same output,
exit status, environment, cwd, threads and atexit handlers, a SIGKILL seen as -9, a timeout raised."""

import subprocess
import sys

import pytest

from tests.conftest import REPO, fork_server, run_command

SCRIPT = """
import atexit, os, signal, sys, threading, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("debug", os.environ.get("TRAIN_DEBUG"), "name", __name__)
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
what = sys.argv[1]
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif what == "raise":
    raise ValueError("a bug")
elif what == "sleep":
    time.sleep(60)
sys.exit(int(what))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return str(path)


def run_both(monkeypatch, command, **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    forked = run_command(command, **kwargs)
    monkeypatch.setenv("TEST_FRESH_PROCESSES", "1")
    fresh = run_command(command, **kwargs)
    monkeypatch.delenv("TEST_FRESH_PROCESSES")
    return forked, fresh


@pytest.mark.parametrize("what, returncode", [("0", 0), ("3", 3), ("kill", -9), ("raise", 1)])
def test_a_forked_run_is_what_a_fresh_process_gives(monkeypatch, script, what, returncode):
    command = [sys.executable, script, what]
    assert fork_server().accepts(command, fork_server().env | {"TRAIN_DEBUG": "1"}, REPO, {})
    forked, fresh = run_both(monkeypatch, command, env={"TRAIN_DEBUG": "1"})
    assert forked.returncode == fresh.returncode == returncode
    assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr
    if what != "kill":  # SIGKILL: what stdout held in its buffer is lost, as in any process
        assert forked.stdout.startswith(f"argv ['{what}'] cwd {REPO} path0 True\ndebug 1 name __main__\n")
        assert forked.stdout.endswith("thread finished\natexit ran\n")  # threads joined, then atexit, as at exit
    if what == "raise":
        assert forked.stderr.splitlines()[2].startswith(f'  File "{script}"') and "ValueError: a bug" in forked.stderr


def test_forked_only_when_nothing_read_at_import_differs(script, tmp_path):
    server, command = fork_server(), [sys.executable, script, "0"]
    assert server.accepts(command, server.env, REPO, {})
    assert not server.accepts(command, server.env | {"OMP_NUM_THREADS": "2"}, REPO, {})  # read when torch loads
    assert not server.accepts(command, server.env, tmp_path, {})  # another project's src/ would be shadowed
    assert not server.accepts([sys.executable, "-m", "accelerate.commands.launch", script], server.env, REPO, {})
    pid = run_command([sys.executable, "-c", "import os; print(os.getppid())"]).stdout.strip()
    assert int(pid) != server.server.pid  # `python -c` starts fresh
    forked = run_command([sys.executable, script, "0"])
    assert forked.returncode == 0 and "argv ['0']" in forked.stdout


def test_the_child_really_is_forked_with_the_imports_done(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nprint(os.getppid(), 'torch' in sys.modules)\n")
    parent, imported = run_command([sys.executable, str(probe)]).stdout.split()
    assert int(parent) == fork_server().server.pid and imported == "True"


def test_a_timeout_kills_the_run_and_raises(script):
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, script, "sleep"], timeout=1)
    assert run_command([sys.executable, script, "0"]).returncode == 0  # the server serves on
