"""The launcher_watch feature (src/features/launcher_watch/): a torch elastic rank whose launcher died takes the
preemption path (a checkpoint at the next agreed step, or a stop outside a training loop) and exits 129."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, WRAPPER, command_env, launch_command, read_metrics, run_snippet


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a zombie has ended: only its exit status is left
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("rank_1", ["trains", "hangs", "slow"])
def test_a_killed_launcher_takes_its_processes_along_through_a_preemption_checkpoint(tmp_path, rank_1):
    """SIGKILL of `accelerate launch` (kill -9, the OOM killer): torch elastic started each rank in a session of its
    own, so nothing signals them. They find their launcher gone, save a preemption checkpoint at the next step
    boundary and exit; none is left 10 s later, and nothing (model/, eval results) is written after the checkpoint.
    Rank 0 says why, also when rank 1 found the launcher gone first (here rank 0's own watch polls too slowly to).
    When the ranks can't agree (rank 1 hangs, rank 0 then waits in a collective), the deadline ends rank 1, and rank 0
    at once, through the error that raises (no slow teardown), both unsaved.
    Real processes: the launcher is `accelerate launch` and its ranks are its children."""
    out, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    record = f"open(f'{pids}/{{os.environ[\"RANK\"]}}', 'w').write(f'{{os.getpid()}} {{os.getppid()}}')"
    kill_launcher = "if step == 4 and os.environ['RANK'] == '0': os.kill(os.getppid(), signal.SIGKILL)"
    if rank_1 == "trains":  # rank 1 finds the launcher gone first; rank 0 learns it as the ranks agree to stop
        record += "\nfrom src.features import launcher_watch\nif os.environ['RANK'] == '0': launcher_watch.POLL_S = 600"
    if rank_1 == "slow":  # 0.4 s steps: 10 to agree would outlast the 5 s given to save; they agree every 2
        kill_launcher += "\n    __import__('time').sleep(0.4)"
    if rank_1 == "hangs":
        kill_launcher += "\n    if step == 4 and os.environ['RANK'] == '1': __import__('time').sleep(600)"
        # rank 0 ends through the error rank 1's exit raises in its collective, with its own deadline far off and a
        # slow interpreter teardown (a process group's, under load): it must not wait for that teardown
        record += "\nimport atexit, time\nfrom src.features import launcher_watch"
        record += "\nif os.environ['RANK'] == '0': launcher_watch.GRACE_S = 600; atexit.register(time.sleep, 600)"
    script = tmp_path / "wrapped_train.py"
    script.write_text(WRAPPER.format(repo=str(REPO), hook=kill_launcher, extra=record))
    command = [part if part != "train.py" else str(script) for part in launch_command(2)]
    args = ["--max_steps", "100000", "--logging_steps", "1", "--save_steps", "0", "--eval_steps", "100000"]
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        launcher = subprocess.Popen(
            [*command, *args, "--output_dir", str(out)], cwd=REPO, env=command_env(), stdin=subprocess.DEVNULL,
            stdout=stdout, stderr=stderr,
        )  # fmt: skip
        assert launcher.wait(timeout=300) == -9
    ranks = {int(pid): int(parent) for pid, parent in (path.read_text().split() for path in pids.iterdir())}
    assert len(ranks) == 2 and set(ranks.values()) == {launcher.pid}  # the launcher was the ranks' parent
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in ranks if alive(pid)]
    for pid in left:  # ours to clean up, then the failure
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher by 10 s"
    console = (tmp_path / "stderr").read_text()
    assert f"the launcher (pid {launcher.pid}) exited" in console
    if rank_1 == "hangs":
        assert not (out / "checkpoints").exists() and not (out / "model").exists()
        return
    said = f"the launcher (pid {launcher.pid}) exited: saving a checkpoint, then stopping (at most 5 s)"
    assert "preempted: checkpoint" in console and console.index(said) < console.index("preempted: checkpoint")
    (saved,) = (out / "checkpoints").iterdir()
    state = json.loads((saved / "trainer_state.json").read_text())
    assert state["preempted"] is True and state["step"] >= 4
    assert not (out / "model").exists() and not (out / "eval_results.json").exists()
    assert max(row["step"] for row in read_metrics(out)) == state["step"]  # no step trained after it


RANK_STARTING = """
import os, sys, time
while os.getppid() == int(sys.argv[1]):  # still importing torch & co. when its launcher is killed
    time.sleep(0.05)
from src.features import installed
installed().before_process_group()  # what build_accelerator calls first, before the rendezvous that would never come
time.sleep(120)
"""
LAUNCHER_KILLED = """
import os, subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdout=subprocess.DEVNULL,
                        stderr=open(sys.argv[2], "w"))
print(rank.pid, flush=True)
os._exit(0)  # as a SIGKILL ends it: nothing cleaned up, the rank not waited for
"""


def test_a_rank_whose_launcher_died_before_it_watched_it_stops(tmp_path):
    """A launcher killed while its ranks still start leaves them to init (PID 1, or a subreaper), which runs no Python
    launcher: the rank stops at once, not once its rendezvous timed out or after joining the next launch's."""
    environment = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "RANK": "0"}
    launched = run_snippet(LAUNCHER_KILLED, RANK_STARTING, str(tmp_path / "stderr"), env=environment)
    rank = int(launched.stdout)
    deadline = time.monotonic() + 60
    while alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left := alive(rank):
        os.kill(rank, signal.SIGKILL)
    assert not left, "the rank outlived its launcher by 60 s"
    assert (tmp_path / "stderr").read_text().strip().endswith("the launcher exited: stopping")
