"""The tests' fork server (tests/forkserver.py) runs a script as a fresh `python script.py` would: the same output,
exit status, environment, cwd, threads and atexit handlers, a SIGKILL seen as -9, a timeout raised; and an
Accelerate launch as a fresh launcher would, its ranks forked: the same variables, exit status and clean-up."""

import subprocess
import sys

import pytest

from tests.conftest import REPO, fork_server, free_port, run_command, run_python, run_snippet

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
    assert not server.accepts([sys.executable, "-m", "accelerate", "launch", script], server.env, REPO, {})
    pid = run_command([sys.executable, "-c", "import os; print(os.getppid())"]).stdout.strip()
    assert int(pid) != server.server.pid  # `python -c` starts fresh
    forked = run_command([sys.executable, script, "0"])
    assert forked.returncode == 0 and "argv ['0']" in forked.stdout


@pytest.mark.parametrize("code", ["import os, sys; print(sys.argv, repr(sys.path[0]), __name__)", "1 / 0"])
def test_a_snippet_forked_when_asked_is_what_python_c_gives(code):
    forked, fresh = run_snippet(code, "an arg"), run_python("-c", code, "an arg")
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    parent = run_snippet("import os; print(os.getppid())").stdout.strip()
    assert int(parent) == fork_server().server.pid


def test_the_child_really_is_forked_with_the_imports_done(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nprint(os.getppid(), 'torch' in sys.modules)\n")
    parent, imported = run_command([sys.executable, str(probe)]).stdout.split()
    assert int(parent) == fork_server().server.pid and imported == "True"


def test_a_timeout_kills_the_run_and_raises(script):
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, script, "sleep"], timeout=1)
    assert run_command([sys.executable, script, "0"]).returncode == 0  # the server serves on


RANK_PROBE = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
names = sorted(k for k in os.environ if k.startswith(("RANK", "LOCAL_", "WORLD", "MASTER", "TORCHELASTIC", "ACCELERATE",
                                                       "GROUP_", "ROLE_", "OMP_")))
default = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
# one write a line: ranks run unbuffered (`python -u`) on one pipe, and print's separate newline could interleave
leader = os.getsid(0) == os.getpid()
os.write(1, f"rank {rank} of {os.environ['WORLD_SIZE']} names {names} default {default} leader {leader}\\n".encode())
os.write(2, f"imported {rank} {'torch' in sys.modules} parent {os.getppid()}\\n".encode())
printed = sys.argv[2] + ".printed"
if sys.argv[1] == "fail" and rank == 1:
    for _ in range(600):  # fail once the other rank has printed
        if os.path.exists(printed):
            sys.exit(3)
        time.sleep(0.05)
if sys.argv[1] == "fail":
    open(printed, "w").close()
    time.sleep(60)  # the agent stops this rank when the other fails
"""


def launch(script, what: str, marker) -> list[str]:
    """A free port: torch's default 29500 is the notebook's (test_scale runs it beside this on the other worker)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml",
            "--num_processes", "2", "--monitor_interval", "0.2", "--main_process_port", str(free_port()),
            script, what, str(marker)]  # fmt: skip


@pytest.mark.parametrize("what", ["ok", "fail"])
def test_a_forked_launch_is_what_a_fresh_launch_gives(monkeypatch, tmp_path, what):
    """Each rank sees the same launcher variables, the interpreter's SIGTERM handler, its own session; a failing
    rank stops the other and the launch fails, as with fresh processes. The forked ranks start with torch imported,
    as children of the (forked) launcher."""
    probe = tmp_path / "rank_probe.py"
    probe.write_text(RANK_PROBE)
    command = launch(str(probe), what, tmp_path / "forked")
    assert fork_server().accepts(command, fork_server().env, REPO, {})
    forked = run_command(command)
    monkeypatch.setenv("TEST_FRESH_PROCESSES", "1")
    fresh = run_command(launch(str(probe), what, tmp_path / "fresh"))
    assert forked.returncode == fresh.returncode == (0 if what == "ok" else 1)
    lines = {run: sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
             for run, result in (("forked", forked), ("fresh", fresh))}  # fmt: skip
    pairs = zip(*(lines[run] for run in ("forked", "fresh")), strict=False)
    words = [(set(a.replace(",", " ").split()), set(b.replace(",", " ").split())) for a, b in pairs]
    differ = [{"forked only": sorted(a - b), "fresh only": sorted(b - a)} for a, b in words if a != b]
    assert lines["forked"] == lines["fresh"] and len(lines["fresh"]) == 2, (differ, forked.stderr[-2000:])
    assert all(line.endswith("default True leader True") for line in lines["fresh"])
    imported = [line.split() for line in forked.stderr.splitlines() if line.startswith("imported ")]
    assert sorted(rank for _, rank, torch, _, _ in imported if torch == "True") == ["0", "1"]
    assert all(int(parent) != fork_server().server.pid for *_, parent in imported)  # the launcher's children
    if what == "fail":
        assert "ChildFailedError" in forked.stderr and "exitcode  : 3" in forked.stderr
