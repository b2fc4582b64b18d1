"""Checkpoints and exact resume: a killed or preempted run continues as if nothing happened."""

import json
import re
import shutil
import signal
import sys

import pytest

from src import run_dir
from src.config import TrainConfig
from src.errors import EXIT_PREEMPTED, UsageError
from src.features import installed_names
from tests.conftest import (
    QUICK,
    REPO,
    assert_ok,
    assert_processes,
    last_row,
    read_metrics,
    run_main,
    run_snippet,
    run_with_hook,
    series,
    signal_at,
)
from tests.helpers import train_losses

RUN = ["--max_steps", "60", "--logging_steps", "1", "--save_steps", "10", "--eval_steps", "25"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Through the DataLoader: with the index_batches feature (`--dataloader_index_batches false` here) the runs
    compared with it batch by index, so each comparison also proves the index path trains as the DataLoader does."""
    through_the_loader = ["--dataloader_index_batches", "false"] if "index_batches" in installed_names() else []
    runs = {}
    for processes in (1, 2):
        output_dir = tmp_path_factory.mktemp(f"full{processes}") / "run"
        args = [*RUN, "--output_dir", str(output_dir), *through_the_loader]
        assert_ok(run_main(*args) if processes == 1 else run_with_hook(output_dir.parent, args, processes=processes))
        assert_processes(output_dir, processes)
        runs[processes] = train_losses(output_dir)
    return runs


@pytest.fixture(scope="module")
def preempted_then_killed(tmp_path_factory):
    """One run on 1 process, stopped twice: SIGUSR1 at step 5 (SLURM's --signal), which saves a preemption checkpoint
    and exits 75; then, resumed from it, SIGKILL while it renames its step-30 checkpoint into place (mid-epoch 1).
    (output_dir, args, the first start's result and what it left, the second's result and what it left.)"""
    tmp_path = tmp_path_factory.mktemp("preempted_then_killed")
    out = tmp_path / "run"
    args = [*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    checkpoints = out / "checkpoints"
    preempted = run_with_hook(tmp_path, args, signal_at(5, "SIGUSR1"))
    left = {"checkpoints": [p.name for p in checkpoints.glob("*")], "model": (out / "model").exists()}
    step_5 = checkpoints / "step_5" / "trainer_state.json"
    left["state"] = json.loads(step_5.read_text()) if step_5.is_file() else None
    die_in_rename = """
replace = src.run_dir.os.replace
def replace_or_die(src_path, dst_path):
    if str(dst_path).endswith("step_30"):
        os.kill(os.getpid(), signal.SIGKILL)
    replace(src_path, dst_path)
src.run_dir.os.replace = replace_or_die
"""
    killed = run_with_hook(tmp_path, args, extra=die_in_rename)
    left_killed = {
        "checkpoints": sorted(p.name for p in checkpoints.glob("*")),
        "complete": (checkpoints / ".tmp_step_30" / "trainer_state.json").is_file(),
    }
    return out, args, (preempted, left), (killed, left_killed)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(preempted_then_killed, uninterrupted):
    """22 steps per epoch: killed while it renames its step-30 checkpoint into place (mid-epoch 1), the run resumes
    from step_20, in the middle of epoch 0, after removing the unrenamed folder (and metrics.jsonl's line cut short,
    which would stop it); the per-step losses and eval metrics
    (of all three starts: the first one preempted at step 5) are those of the uninterrupted run through the
    DataLoader, bit for bit. (2 processes: the test below.)"""
    out, args, _, (killed, left) = preempted_then_killed
    assert killed.returncode == -signal.SIGKILL
    assert "resuming from" in killed.stdout + killed.stderr  # from the preemption checkpoint
    assert left["checkpoints"] == [".tmp_step_30", "step_10", "step_20"]  # 30: not renamed
    assert left["complete"]  # fully written
    with open(out / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 31, "train/lo')  # and a line cut short, as a kill or a full disk leaves it

    resumed = run_main(*args)
    assert_ok(resumed)
    logs = resumed.stdout + resumed.stderr
    assert "removing" in logs and "incomplete checkpoint" in logs and "at step 20" in logs and "resuming from" in logs
    assert "dropping 1 line(s) of" in logs and "metrics.jsonl that a kill or full disk cut short" in logs
    assert_processes(out, 1)  # all three starts
    losses, accuracy = train_losses(out)
    expected_losses, expected_accuracy = uninterrupted[1]
    assert list(losses) == list(expected_losses) == list(range(1, 61))
    assert losses == expected_losses  # bit for bit
    assert accuracy == expected_accuracy
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step_50", "step_60"]  # save_total_limit 2


@pytest.mark.slow
def test_sigkill_then_sigterm_on_one_of_2_processes_then_resume_matches_uninterrupted(tmp_path, uninterrupted):
    """One run on 2 processes, stopped twice: SIGKILL at step 27 (resumed from step_20, mid-epoch 0), then SIGTERM
    on rank 0 at step 33, which every process saves for at the same step and exits 75; the third start finishes
    with the per-step losses (within 1e-5) and eval metrics of the uninterrupted run through the DataLoader."""
    out = tmp_path / "run"
    args = [*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    killed = run_with_hook(tmp_path, args, signal_at(27), processes=2)
    assert killed.returncode != 0
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step_10", "step_20"]

    hook = "if step == 33 and os.environ.get('RANK', '0') == '0': os.kill(os.getpid(), signal.SIGTERM)"
    preempted = run_with_hook(tmp_path, args, hook, processes=2)
    assert preempted.returncode == EXIT_PREEMPTED  # the status of the first rank to exit (run_ranks)
    assert "resuming from" in preempted.stdout + preempted.stderr
    assert "preempted: checkpoint" in preempted.stderr
    # CPU processes agree every 10 steps (fewer where steps are slow: src/preemption.py): the all-reduce started at
    # step 40 carries the flag, read at step 50 (at 0.1 s a step or more: sooner)
    states = [json.loads((path / "trainer_state.json").read_text()) for path in (out / "checkpoints").iterdir()]
    (state,) = [state for state in states if state["preempted"]]
    assert 33 < state["step"] <= 50 and max(state["step"] for state in states) == state["step"]

    resumed = run_with_hook(tmp_path, args, processes=2)
    assert_ok(resumed)
    assert "resuming from" in resumed.stdout + resumed.stderr
    assert_processes(out, 2)  # all three starts
    losses, accuracy = train_losses(out)
    expected_losses, expected_accuracy = uninterrupted[2]
    assert list(losses) == list(expected_losses) == list(range(1, 61))
    assert max(abs(losses[s] - expected_losses[s]) for s in losses) <= 1e-5
    assert accuracy == expected_accuracy
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step_50", "step_60"]  # save_total_limit 2


@pytest.mark.slow
def test_preemption_signal_on_one_process_saves_and_exits_75(preempted_then_killed):
    """SLURM's --signal (USR1 or TERM before the time limit): a checkpoint at the next step, marked preempted. SIGUSR1
    here (the first start of preempted_then_killed); SIGTERM takes the same handler (PreemptionSignals.handle), tested
    on 2 processes above."""
    _, _, (result, left), _ = preempted_then_killed
    assert result.returncode == EXIT_PREEMPTED
    assert result.stderr.strip().splitlines()[-1].startswith("preempted: checkpoint")
    assert left["state"]["step"] == 5 and left["state"]["preempted"] is True
    assert left["checkpoints"] == ["step_5"] and not left["model"]


def test_a_signal_while_the_run_sets_up_is_kept_for_its_first_step(tmp_path):
    """A job preempted as it starts (SIGTERM while it builds its task: reading data, building the model) saves a
    preemption checkpoint at its first step and exits 75, as a signal in the loop does; before, the signal killed it
    unsaved and the sbatch scripts' requeue chain ended there."""
    out = tmp_path / "run"
    early = (
        "import src.tasks\nbuild_task = src.tasks.build_task\n"
        "src.tasks.build_task = lambda config: os.kill(os.getpid(), signal.SIGTERM) or build_task(config)"
    )
    result = run_with_hook(tmp_path, [*QUICK, "--output_dir", str(out)], extra=early)
    assert result.returncode == EXIT_PREEMPTED, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("preempted: checkpoint")
    state = json.loads((out / "checkpoints/step_1/trainer_state.json").read_text())
    assert state["step"] == 1 and state["preempted"] is True and not (out / "model").exists()


@pytest.mark.parametrize("when", ["in the loop", "before the loop"])
def test_a_checkpoint_requested_by_code_is_saved_as_a_signals_is(tmp_path, when):
    """src/preemption.py: request_checkpoint, what a feature calls for a preemption that is no signal (e.g. a dead
    launcher): the running loop saves at its next agreed step and exits 75, a loop that starts later at its first;
    the call says whether a loop runs now to save it."""
    out = tmp_path / "run"
    request = "__import__('src.preemption').preemption.request_checkpoint()"
    if when == "in the loop":
        step, hook, extra = 2, f"if step == 2: assert {request}", ""
    else:
        step, hook, extra = 1, "pass", f"assert not {request}"
    result = run_with_hook(tmp_path, [*QUICK, "--output_dir", str(out)], hook, extra=extra)
    assert result.returncode == EXIT_PREEMPTED, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("preempted: checkpoint")
    state = json.loads((out / f"checkpoints/step_{step}/trainer_state.json").read_text())
    assert state["step"] == step and state["preempted"] is True and not (out / "model").exists()


@pytest.mark.slow
def test_latest_without_checkpoint_starts_fresh(tmp_path):
    out = tmp_path / "run"
    result = run_main("--max_steps", "3", "--output_dir", str(out), "--resume_from_checkpoint", "latest")
    assert_ok(result)
    assert "starting fresh" in result.stdout + result.stderr
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_3"]


@pytest.mark.slow
def test_resume_with_other_global_batch_is_refused(tmp_path):
    out = tmp_path / "run"
    assert_ok(run_main("--max_steps", "3", "--output_dir", str(out)))
    before = (out / "metrics.jsonl").read_text()
    result = run_main("--max_steps", "6", "--output_dir", str(out), "--resume_from_checkpoint", "latest",
                      "--global_batch_size", "128")  # fmt: skip
    assert result.returncode == 2
    assert "global batch of 64, this run has 128" in result.stderr.strip().splitlines()[-1]
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_resuming_a_finished_run_trains_no_further(tmp_path):
    """`--resume_from_checkpoint latest` on a run that has finished: no step past the last, the same losses."""
    out = tmp_path / "run"
    args = ["--max_steps", "6", "--logging_steps", "2", "--eval_steps", "1000", "--output_dir", str(out),
            "--resume_from_checkpoint", "latest"]  # fmt: skip
    assert_ok(run_main(*args))
    before = series(read_metrics(out), "train/loss")
    assert_ok(run_main(*args))
    rows = read_metrics(out)
    assert max(row["step"] for row in rows) == 6 and series(rows, "train/loss") == before


@pytest.mark.slow
def test_a_resume_on_another_accumulation_count_logs_the_uninterrupted_loss(tmp_path):
    """A checkpoint between two log steps, saved with 2 micro-batches a step (32 x 2), resumed with 1 (64, as on 2
    processes): the losses of the steps before it weigh as the steps after it, as in the uninterrupted run."""
    args = ["--max_steps", "4", "--logging_steps", "4", "--eval_steps", "100", "--save_steps", "3"]
    assert_ok(run_main(*args, "--per_device_train_batch_size", "32", "--output_dir", str(tmp_path / "full")))
    step_3 = tmp_path / "full" / "checkpoints" / "step_3"
    resumed = ["--per_device_train_batch_size", "64", "--resume_from_checkpoint", str(step_3)]
    assert_ok(run_main(*args, *resumed, "--output_dir", str(tmp_path / "resumed")))
    full, after = (series(read_metrics(tmp_path / name), "train/loss") for name in ("full", "resumed"))
    assert list(full) == list(after) == [4] and after[4] == pytest.approx(full[4], abs=1e-5)


@pytest.mark.slow
def test_going_back_to_an_earlier_checkpoint_is_refused_while_later_ones_are_there(tmp_path):
    """Resuming at step 3 beside step 6: `latest` would later take step 6 (another history) for this run's; nothing
    changes. A copy of a checkpoint under another name (step_6.bak) is no checkpoint for `latest`."""
    out = tmp_path / "run"
    args = [*QUICK, "--save_steps", "3", "--output_dir", str(out)]
    assert_ok(run_main(*args))
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    result = run_main(*args, "--resume_from_checkpoint", str(out / "checkpoints" / "step_3"))
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        f"error: --resume_from_checkpoint {out}/checkpoints/step_3 goes on from step 3, but {out} holds later "
        "checkpoints (step_6) that `latest` would take for this run's; delete them"
    )
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
    result = run_main(*args, "--resume_from_checkpoint", str(out / "checkpoints" / "step_5"))
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        f"error: --resume_from_checkpoint {out}/checkpoints/step_5 does not exist ({out}/checkpoints has step_3, "
        "step_6); name a checkpoints/step_<N> folder, or 'latest'"
    )
    shutil.copytree(out / "checkpoints" / "step_6", out / "checkpoints" / "step_6.bak")
    assert_ok(run_main(*args, "--resume_from_checkpoint", "latest"))  # a finished run: nothing more to train


@pytest.mark.slow
def test_a_kill_while_the_model_is_saved_leaves_the_previous_model_whole(tmp_path):
    """A finished run resumed saves model/ again: killed in the middle, the previous model/ is still there, whole, and
    the next start removes the part written. A damaged model file is one line when evaluated (exit 2)."""
    out = tmp_path / "run"
    args = [*QUICK, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    assert_ok(run_main(*args))
    weights = out / "model" / "model.safetensors"
    saved = weights.read_bytes()
    dies_saving = (
        "import src.tasks.base\n"
        "def save_model(self, accelerator, model, directory):\n"
        "    directory.mkdir(parents=True, exist_ok=True)\n"
        "    (directory / 'model.safetensors').write_bytes(b'cut')\n"
        "    os._exit(137)\n"
        "src.tasks.base.Task.save_model = save_model\n"
    )
    killed = run_with_hook(tmp_path, args, extra=dies_saving)
    assert killed.returncode == 137 and weights.read_bytes() == saved
    resumed = run_main(*args)
    assert_ok(resumed)
    assert "removing" in resumed.stderr and not list(out.glob(".tmp_*")) and weights.read_bytes() == saved
    weights.write_bytes(b"cut short")
    evaluated = run_main("--do_train", "false", "--output_dir", str(out))
    assert evaluated.returncode == 2 and "does not hold weights for this model, or is damaged" in evaluated.stderr


@pytest.mark.slow
def test_latest_never_replaces_a_finished_run_it_cannot_continue(tmp_path):
    """`--resume_from_checkpoint latest` (as the refusal of a rerun advises) on a finished run whose checkpoints were
    deleted: its model/ is the only copy of what it trained, so it is refused, not started afresh over it."""
    out = tmp_path / "run"
    args = [*QUICK, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    assert_ok(run_main(*args))
    shutil.rmtree(out / "checkpoints")
    weights = (out / "model" / "model.safetensors").read_bytes()
    result = run_main(*args)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        f"error: {out} holds a finished run (metrics.jsonl, config.yaml, model, eval_results.json) but no checkpoint "
        "to continue it from"
    )
    assert (out / "model" / "model.safetensors").read_bytes() == weights


@pytest.mark.slow
def test_another_folders_checkpoint_starts_a_new_run(tmp_path):
    """A checkpoint of another folder is refused into a folder that holds a trained run (the two runs would mix), and
    into a new folder starts a new run there from its weights: with --load_best_model_at_end the best is chosen again
    (the old best's checkpoint is not there), and model/ is written."""
    best = ["--metric_for_best_model", "eval/loss", "--load_best_model_at_end", "true", "--eval_steps", "2"]
    source, trained, fresh = tmp_path / "source", tmp_path / "trained", tmp_path / "fresh"
    assert_ok(run_main(*QUICK, *best, "--save_steps", "2", "--output_dir", str(source)))
    assert_ok(run_main(*QUICK, "--output_dir", str(trained)))
    before = {path: path.read_bytes() for path in trained.rglob("*") if path.is_file()}
    step_4 = ["--resume_from_checkpoint", str(source / "checkpoints" / "step_4")]
    result = run_main(*QUICK, "--max_steps", "8", *step_4, "--output_dir", str(trained))
    assert result.returncode == 2 and f"error: {trained} already holds a run" in result.stderr
    assert {path: path.read_bytes() for path in trained.rglob("*") if path.is_file()} == before
    replace = ["--overwrite_output_dir", "true", "--output_dir", str(tmp_path / "replaced")]
    shutil.copytree(trained, tmp_path / "replaced")  # its step_6 is no later checkpoint of the run that replaces it
    assert_ok(run_main(*QUICK, "--max_steps", "8", *step_4, *replace))
    assert [path.name for path in (tmp_path / "replaced" / "checkpoints").iterdir()] == ["step_8"]
    result = run_main(*QUICK, *best, "--max_steps", "8", *step_4, "--output_dir", str(fresh))
    assert_ok(result)
    assert "the best model so far (step 4) has no checkpoint in" in result.stderr
    rows = read_metrics(fresh)
    assert min(series(rows, "train/loss")) == 6 and last_row(rows, "best_model/step")["best_model/step"] in (6, 8)
    assert (fresh / "model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_model_renamed_aside_by_a_stopped_save_is_restored(tmp_path):
    """Killed between move_into_place's two renames (the previous model/ aside, the new one not yet in place): the
    next start puts the previous model/ back rather than removing it as a leftover."""
    out = tmp_path / "run"
    args = [*QUICK, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    assert_ok(run_main(*args))
    weights = (out / "model" / "model.safetensors").read_bytes()
    (out / "model").rename(out / ".tmp_previous_model")
    restarted = run_main(*args)
    assert_ok(restarted)
    assert "restoring" in restarted.stderr and (out / "model" / "model.safetensors").read_bytes() == weights


def claimed_elsewhere(folder) -> bool:
    """Whether another process holds folder's run lock: a fresh process's claim of it is refused."""
    claim = f"from pathlib import Path; from src import run_dir; run_dir.claim(Path({str(folder)!r}), make=True)"
    result = run_snippet(claim)
    assert result.returncode == 0 or f"UsageError: another run is training in {folder}" in result.stderr, result.stderr
    return result.returncode != 0


def test_a_folder_is_held_while_a_run_trains_and_freed_after(tmp_path):
    """run_dir.one_run_at_a_time: a folder new at the start is held once prepare_output_dir makes it; another
    process's claim is refused; leaving frees it, an error too, and a later run claims the folder at its start."""
    out = tmp_path / "run"
    config = TrainConfig(output_dir=str(out))
    with run_dir.one_run_at_a_time(config):
        assert not out.exists() and not run_dir._held  # nothing written before the run's input is checked
        out.mkdir()
        run_dir.claim(out, make=True)  # what prepare_output_dir does once it made the folder
        assert claimed_elsewhere(out)
    assert not claimed_elsewhere(out)
    with pytest.raises(RuntimeError), run_dir.one_run_at_a_time(config):
        assert claimed_elsewhere(out)  # held from the start: the folder has a run's lock file
        raise RuntimeError("the run failed")
    assert not claimed_elsewhere(out)
    older = tmp_path / "older"  # a run's folder without a lock file: nothing written into it at the start
    older.mkdir()
    (older / "config.yaml").write_text("seed: 1\n")
    with run_dir.one_run_at_a_time(TrainConfig(output_dir=str(older))):
        assert [path.name for path in older.iterdir()] == ["config.yaml"]


@pytest.mark.slow
def test_a_second_run_in_a_folder_where_one_trains_is_refused(tmp_path):
    """The same command twice, or a requeued job beside its first: the second is refused (one line, exit 2) before it
    changes anything, and the first trains on unmixed; once it has ended, the folder is free."""
    out = tmp_path / "run"
    args = [*QUICK, "--output_dir", str(out), "--save_steps", "2", "--resume_from_checkpoint", "latest"]
    second, said = [sys.executable, "train.py", *args], tmp_path / "second.txt"
    hook = (f"if step == 4: r = __import__('subprocess').run({second!r}, capture_output=True, text=True); "
            f"open({str(said)!r}, 'w').write(f'{{r.returncode}} {{r.stderr.strip().splitlines()[-1]}}')")  # fmt: skip
    assert_ok(run_with_hook(tmp_path, args, hook=hook))
    code, line = said.read_text().split(" ", 1)
    assert code == "2" and re.fullmatch(
        rf"error: another run is training in {re.escape(str(out))} \(pid \d+ on [^)]+\); wait for it to end, or "
        rf"choose another --output_dir \(where none is, .* delete {re.escape(str(out / '.lock'))}\)",
        line,
    ), line
    assert [row["step"] for row in read_metrics(out) if "train/loss" in row] == [2, 4, 6]  # one run's lines
    assert_ok(run_main(*args))  # resumed at its end: nothing to train, the folder free
    assert not claimed_elsewhere(out)


def test_a_compiled_sharded_runs_checkpoint_of_0_6_0_resumes():
    """0.6.0 recorded a compiled DDP or FSDP2 run as "single process" on its N processes (strategy_of did not see
    through torch.compile): such a checkpoint is read as one whose strategy was not recorded, not refused."""
    from src.checkpoint import TrainerState, check_sharding

    saved = TrainerState(world_size=2, strategy="single process")
    check_sharding(REPO, saved, TrainerState(world_size=2, strategy="FSDP2"))
    with pytest.raises(UsageError, match="was saved by single process on 1 processes"):
        whole = TrainerState(world_size=1, strategy="single process")  # one process: a whole model, recorded right
        check_sharding(REPO, whole, TrainerState(world_size=2, strategy="FSDP2"))
