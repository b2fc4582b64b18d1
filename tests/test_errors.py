"""Bad input costs one glance: an `error:` line naming the problem and the fix, exit code 2, nothing written.
A run that fails later says so the same way, with its own exit code (65 diverged, 74 checkpoint write failed)."""

import errno
import math
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import accelerate
import numpy as np
import pandas as pd
import pytest

from src.errors import (
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_TASK_FAILED,
    EXIT_USAGE,
    EXIT_WRITE_FAILED,
    UsageError,
    command_line,
)
from src.features import installed_names
from tests.conftest import (
    QUICK,
    REPO,
    assert_ok,
    command_env,
    last_row,
    launch_command,
    launcher_store,
    read_metrics,
    run_command,
    run_main,
    run_train,
    run_with_hook,
    series,
    signal_at,
    torchrun_variables,
)
from tests.helpers import assert_error_line

DIGITS = REPO / "data" / "digits"


def data_files(tmp_path, frame: pd.DataFrame, eval_frame: pd.DataFrame | None = None) -> list[str]:
    train, evals = tmp_path / "train.parquet", tmp_path / "eval.parquet"
    frame.to_parquet(train)
    (frame if eval_frame is None else eval_frame).to_parquet(evals)
    return ["--data_files", f"{{train: {train}, eval: {evals}}}"]


def digits(split: str = "train") -> pd.DataFrame:
    return pd.read_parquet(DIGITS / f"{split}.parquet")


def json_lines(tmp_path, split: str, frame: pd.DataFrame) -> str:
    path = tmp_path / f"{split}.jsonl"
    frame.to_json(path, orient="records", lines=True)
    return str(path)


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# id -> (build the extra arguments from tmp_path, a regex the error line must match)
CASES = {
    "missing config file": (lambda t: ["--config", str(t / "nope.yaml")], r"File does not exist.*nope\.yaml"),
    "invalid yaml": (lambda t: ["--config", write(t, "c.yaml", "lr: [1\n")], r"Problems parsing config"),
    "unknown yaml key": (lambda t: ["--config", write(t, "c.yaml", "learning_rat: 1\n")], r"learning_rat"),
    "unknown flag": (lambda t: ["--learning_rat", "1"], r"unrecognized arguments: --learning_rat"),
    "wrong type": (lambda t: ["--max_steps", "many"], r"max_steps.*many"),
    "zero batch size": (lambda t: ["--per_device_train_batch_size", "0"], r"--per_device_train_batch_size must be > 0"),
    "negative lr": (lambda t: ["--learning_rate", "-1"], r"--learning_rate must be > 0"),
    "zero steps": (lambda t: ["--max_steps", "0"], r"--max_steps must be > 0"),
    "global batch not divisible": (
        lambda t: ["--global_batch_size", "48"],
        r"not divisible by per-device batch 32 .*multiple of 32, or --per_device_train_batch_size 24$",
    ),
    "zero eval steps": (lambda t: ["--eval_steps", "0"], r"--eval_steps must be > 0 \(got 0\) \(--do_eval false: no"),
    "missing data file": (
        lambda t: ["--data_files", f"{{train: {t}/none.parquet, eval: {t}/none.parquet}}"],
        r"data file for split 'train' not found",
    ),
    "an empty data file name": (
        lambda t: ["--data_files", "{train: '', eval: ''}"],
        r"data file for split 'train' is empty text; name a file, or a folder of images$",  # not the working directory
    ),
    "missing column": (lambda t: ["--label_column", "digit"], r"no column digit .*--label_column"),
    "empty split": (lambda t: data_files(t, digits(), digits().head(0)), r"empty|could not read"),
    "labels out of range": (lambda t: ["--num_labels", "5"], r"labels must lie in 0\.\.4 but range 0\.\.9"),
    "hub dataset offline": (
        lambda t: ["--dataset_name", "someone/not-cached", "--data_files", "null"],
        r"not in the local cache and HF_HUB_OFFLINE",
    ),
    "unknown report_to": (lambda t: ["--report_to", "tensorbord"], r"unknown --report_to tensorbord; did you mean"),
    "resume from nothing": (
        lambda t: ["--resume_from_checkpoint", str(t / "ckpt")],
        r"ckpt does not exist; name a checkpoints/step_<N> folder, or 'latest'",
    ),
    "resume from a folder": (
        lambda t: ["--resume_from_checkpoint", write(t, "notes.txt", "")],  # not a checkpoint: no trainer state
        r"notes.txt is not a complete checkpoint \(no trainer_state.json\).*'latest'",
    ),
    "digits of another width": (
        lambda t: data_files(t, digits().assign(pixels=digits().pixels.map(lambda row: row[:63]))),
        r"column 'pixels' of the train split holds 63 values a row, not the 64 pixels of an 8x8 digit",
    ),
    "an empty JSON file": (
        lambda t: ["--data_files", f"{{train: {write(t, 'train.jsonl', '')}, eval: {write(t, 'eval.jsonl', '')}}}"],
        r"the json data files hold no rows \(train: .*train\.jsonl, eval: .*eval\.jsonl\); check --data_files$",
    ),
    "a folder without images": (
        lambda t: ["--data_files", f"{{train: {t}, eval: {t}}}"],
        r"the imagefolder data files hold no images in class subfolders",
    ),
    "an eval file without the label column": (
        lambda t: [
            "--data_files",
            f"{{train: {json_lines(t, 'train', digits())}, eval: "
            f"{json_lines(t, 'eval', digits('eval').drop(columns='label'))}}}",
        ],  # fmt: skip
        r"the eval split has no column 'label' \(no row has a value\); add it to its file$",  # not "N missing values"
    ),
    "no labels to classify": (lambda t: ["--num_labels", "0"], r"--num_labels must be > 0 \(got 0\)$"),
    "max_train_samples under one global batch": (
        lambda t: ["--max_train_samples", "10"],
        r"train split has 10 samples, fewer than one global batch of 64; .* or raise --max_train_samples$",
    ),
    "train split smaller than global batch": (
        lambda t: data_files(t, digits().head(40)),
        r"train split has 40 samples, fewer than one global batch of 64",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bad_input(case, tmp_path):
    build_args, pattern = CASES[case]
    out = tmp_path / "run"
    result = run_main(*QUICK, "--output_dir", str(out), *build_args(tmp_path))
    assert_error_line(result, pattern)
    assert not out.exists()  # nothing written for a run that never started
    assert "Failed to" not in result.stderr  # the one line says it: no library log lines before it (datasets')


def test_a_file_datasets_cannot_read_is_said_in_one_line(tmp_path):
    cut = '{"pixels": [1, 2\n'  # a line cut short
    files = f"{{train: {write(tmp_path, 'train.jsonl', cut)}, eval: {write(tmp_path, 'eval.jsonl', cut)}}}"
    result = run_train(*QUICK, "--output_dir", str(tmp_path / "run"), "--data_files", files)  # datasets' own stderr
    assert_error_line(result, r"could not read the json data files \(.+\); check --data_files$")
    assert result.stderr.strip().count("\n") == 0, result.stderr  # datasets' own lines about it left out


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, env",
    [
        (["--debug", "true"], {}),
        ([], {"TRAIN_DEBUG": "1"}),
        (["--config", "debug.yaml"], {}),
        (["--debug", "false"], {}),
    ],
    ids=["flag", "env", "config file", "false"],
)
def test_debug_shows_the_traceback(tmp_path, flags, env):
    """--debug true on the command line or in a --config file (the error in the same file), or TRAIN_DEBUG=1."""
    (tmp_path / "debug.yaml").write_text("debug: true\nmax_steps: 0\n")
    result = run_main("--max_steps", "0", *flags, env=env, cwd=tmp_path)
    if "false" in flags:
        assert_error_line(result, r"--max_steps must be > 0")  # one line: false is false
        return
    assert result.returncode != 0 and "Traceback (most recent call last)" in result.stderr
    assert "src.errors.UsageError: --max_steps must be > 0" in result.stderr  # the error itself, raised


def snapshot(directory):
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("done") / "run"
    assert_ok(run_main(*QUICK, "--save_steps", "3", "--output_dir", str(out)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, pattern",
    [
        ([], r"already holds a run .*--resume_from_checkpoint latest.*--overwrite_output_dir"),
        (["--label_column", "no_such_column"], r"already holds a run"),  # said before the data is read
        (["--resume_from_checkpoint", "latest", "--norm", "none"], r"does not fit this model"),
        (["--resume_from_checkpoint", "latest", "--global_batch_size", "128"], r"global batch of 64"),
    ],
)
def test_existing_run_is_left_untouched(finished_run, args, pattern):
    before = snapshot(finished_run)
    result = run_main(*QUICK, "--output_dir", str(finished_run), *args)
    assert_error_line(result, pattern)
    assert snapshot(finished_run) == before


def test_an_output_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """A file where the folder would be (or above it), a folder this process may not write: said before anything is
    read or written, not as a traceback at the first write (on 2 processes: one per process and the launcher's)."""
    (tmp_path / "file").write_text("mine\n")
    for output_dir in (tmp_path / "file", tmp_path / "file" / "run"):
        result = run_main(*QUICK, "--output_dir", str(output_dir))
        assert_error_line(result, rf"--output_dir {output_dir}: {tmp_path / 'file'} is a file, not a folder; choose")
    evaluating = ["--do_train", "false", "--model_name_or_path", str(tmp_path / "model")]  # (read after the check)
    result = run_main(*evaluating, "--output_dir", str(tmp_path / "file" / "run"))  # evaluation: before it, too
    assert_error_line(result, rf"--output_dir {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a file, not a")
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path and access(path, mode))  # as non-root
    result = run_main(*QUICK, "--output_dir", str(tmp_path / "new" / "run"))
    assert_error_line(result, rf"--output_dir .*/new/run: {tmp_path} is not writable; choose another --output_dir or")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"] and (tmp_path / "file").read_text() == "mine\n"


@pytest.mark.slow
def test_corrupt_checkpoint(finished_run, tmp_path):
    checkpoint = tmp_path / "step_3"
    checkpoint.mkdir()
    for source in (finished_run / "checkpoints" / "step_3").iterdir():
        (checkpoint / source.name).write_bytes(source.read_bytes())
    (checkpoint / "model.safetensors").write_bytes(b"garbage")
    out = tmp_path / "run"
    result = run_main(*QUICK, "--output_dir", str(out), "--resume_from_checkpoint", str(checkpoint))
    assert_error_line(result, r"checkpoint .*step_3 does not fit this model/optimiser or is damaged")
    assert not out.exists()


def infinite_rows(frame: pd.DataFrame, rows: list[int]) -> pd.DataFrame:
    """The rows' pixels infinite, so their loss is NaN (a NaN in the file would be a missing value, refused)."""
    pixels = [np.asarray(p, dtype=np.float32) for p in frame["pixels"]]
    for row in rows:
        pixels[row] = np.full(64, np.inf, dtype=np.float32)
    return frame.assign(pixels=pixels)


@pytest.mark.slow
def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(tmp_path):
    """Every sample is infinite from the 2nd epoch on, checked at the next log (step 25): the step named is 23."""
    out = tmp_path / "run"
    frame = infinite_rows(digits(), list(range(len(digits()))))
    clean = data_files(tmp_path, digits())
    assert_ok(run_main("--max_steps", "22", "--save_steps", "10", "--output_dir", str(out), *clean))
    (tmp_path / "nan").mkdir()
    broken = data_files(tmp_path / "nan", frame, digits("eval"))
    result = run_main("--max_steps", "40", "--logging_steps", "5", "--save_steps", "10", "--output_dir", str(out),
                      "--resume_from_checkpoint", "latest", *broken)  # fmt: skip
    assert_error_line(result, r"loss became NaN/inf at step 23; checkpoints saved before it are intact", EXIT_DIVERGED)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_20", "step_22"]


@pytest.mark.slow
def test_skip_nonfinite_batches_trains_on(tmp_path):
    out = tmp_path / "run"
    frame = infinite_rows(digits(), [0, 1, 2])  # 3 bad samples: the steps holding them are skipped
    result = run_main("--max_steps", "44", "--logging_steps", "44", "--skip_nonfinite_batches", "true",
                      "--output_dir", str(out), *data_files(tmp_path, frame, digits("eval")))  # fmt: skip
    assert_ok(result)
    last = last_row(read_metrics(out), "train/loss")
    assert 1 <= last["train/skipped_steps"] <= 6  # each epoch puts the 3 bad samples into 1 to 3 steps
    assert math.isfinite(last["train/loss"])  # the mean of the good steps: neither NaN nor inf
    assert last_row(read_metrics(out))["eval/accuracy"] > 0.5
    # stopped at step 22 and resumed: the count goes on from the checkpoint's
    args = ["--logging_steps", "22", "--skip_nonfinite_batches", "true", "--output_dir", str(tmp_path / "resumed"),
            "--resume_from_checkpoint", "latest", *data_files(tmp_path, frame, digits("eval"))]  # fmt: skip
    assert_ok(run_main("--max_steps", "22", *args))
    assert_ok(run_main("--max_steps", "44", *args))
    assert series(read_metrics(tmp_path / "resumed"), "train/skipped_steps")[44] == last["train/skipped_steps"]


@pytest.mark.slow
def test_disk_full_during_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    out = tmp_path / "run"
    original = accelerate.Accelerator.save_state

    def save_or_fail(self, output_dir=None, **kwargs):
        if output_dir.endswith("step_20"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, output_dir, **kwargs)

    monkeypatch.setattr(accelerate.Accelerator, "save_state", save_or_fail)
    result = run_main(*QUICK, "--max_steps", "30", "--save_steps", "10", "--output_dir", str(out))
    assert_error_line(
        result, r"could not write checkpoint .*step_20 \(OSError: .*No space left on device\)", EXIT_WRITE_FAILED
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_10"]


@pytest.mark.slow
def test_disk_full_while_the_model_is_saved_is_one_line_and_a_resume_saves_it(tmp_path, monkeypatch):
    """model/ failing to write after the last checkpoint: exit 74 and one line, as a checkpoint's (it was a
    traceback), and the resume it names writes model/; a bug in the task's save_model stays the task's (exit 70)."""
    from src.tasks.digits import Digits

    out, original = tmp_path / "run", Digits.save_model

    def save_or_fail(self, accelerator, model, directory):
        if Path(directory).name == ".tmp_model":
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, accelerator, model, directory)

    monkeypatch.setattr(Digits, "save_model", save_or_fail)
    result = run_main(*QUICK, "--output_dir", str(out))
    assert_error_line(result, rf"could not write {out}/model \(OSError: .*No space left on device\)", EXIT_WRITE_FAILED)
    assert not (out / "model").exists() and (out / "checkpoints" / "step_6").is_dir()
    assert not (out / ".tmp_model").exists()  # the partial model freed its space at once
    monkeypatch.setattr(Digits, "save_model", original)
    assert_ok(run_main(*QUICK, "--output_dir", str(out), "--resume_from_checkpoint", "latest"))
    assert (out / "model" / "model.safetensors").is_file()

    def save_model(self, accelerator, model, directory):  # the task's own bug: its line, no write failure
        raise AttributeError("'Digits' object has no attribute 'tokenizer'")

    monkeypatch.setattr(Digits, "save_model", save_model)
    result = run_main(*QUICK, "--output_dir", str(tmp_path / "bug"))
    assert_error_line(result, r"^error: Digits.save_model\(\) failed: AttributeError", EXIT_TASK_FAILED)


@pytest.mark.slow
def test_a_checkpoint_folder_that_cannot_be_made_stops_the_run_in_one_line(tmp_path, monkeypatch):
    """checkpoints/ no longer writable (made before the processes agree that they saved: outside it, a traceback)."""
    out, mkdir = tmp_path / "run", Path.mkdir

    def refuse_step_4(self, *args, **kwargs):
        if self.name == ".tmp_step_4":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse_step_4)
    result = run_main(*QUICK, "--save_steps", "2", "--output_dir", str(out))
    assert_error_line(
        result, r"could not write checkpoint .*step_4 \(PermissionError: .*Permission denied", EXIT_WRITE_FAILED
    )
    assert [path.name for path in (out / "checkpoints").iterdir()] == ["step_2"]


@pytest.mark.slow
@pytest.mark.parametrize(("limit", "raised"), [(150_000, "SafetensorError"), (300_000, "RuntimeError")])
def test_a_checkpoint_that_cannot_be_written_stops_the_run_in_one_line(tmp_path, limit, raised):
    """A real failed write: a file-size limit stands in for a full disk, where safetensors (the model's 227 KB) and
    torch.save (the optimizer's 462 KB) raise their own errors, not OSError. Exit 74, nothing half-written left."""
    out = tmp_path / "run"

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: the write fails

    result = run_train(*QUICK, "--save_steps", "2", "--output_dir", str(out), preexec_fn=limit_file_size)
    assert_error_line(result, rf"could not write checkpoint .*step_2 \({raised}: ", EXIT_WRITE_FAILED)
    assert list((out / "checkpoints").iterdir()) == []


@pytest.mark.slow
def test_ctrl_c_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    result = run_with_hook(tmp_path, [*QUICK, "--max_steps", "30", "--output_dir", str(out)],
                           hook=signal_at(4, "SIGINT"))  # fmt: skip
    assert result.returncode == EXIT_INTERRUPTED
    assert result.stderr.strip().splitlines()[-1].startswith("interrupted")
    assert "Traceback" not in result.stderr


def test_broken_accelerate_config(tmp_path, capsys):
    """scripts/launch.py's config check, in this process as the script calls it before anything else (a whole
    `python scripts/launch.py` refusing a config, with nothing more on stderr: the next test)."""
    from scripts.launch import exit_if_unusable

    broken = write(tmp_path, "broken.yaml", "distributed_type: MULTI_GPUX\nnum_processes: 2\n")
    with pytest.raises(SystemExit) as stopped:
        exit_if_unusable(["--config_file", broken, "train.py", *QUICK])
    result = subprocess.CompletedProcess("scripts/launch.py", stopped.value.code, "", capsys.readouterr().err)
    assert_error_line(result, r"accelerate config .*broken\.yaml is invalid \('MULTI_GPUX' is not a valid")


def ranks_run_to_their_end(args: list[str], folder: Path, processes: int = 2, env: dict | None = None):
    """`python train.py args` on `processes` processes, each started with the variables torchrun gives its workers
    (one launch folder for their TORCHELASTIC_ERROR_FILE, as first_to_say reads it) and each waited for to its own end:
    torchrun (and conftest's run_ranks) stop the others once one exits, so neither shows how a slower rank ends."""
    command, ranks = [sys.executable, "train.py", *args], []
    (folder / "launch").mkdir()
    with launcher_store() as port:
        for rank in range(processes):
            variables = {**torchrun_variables(rank, processes, port, folder / "launch"), **(env or {})}
            with open(folder / f"{rank}.out", "w") as out, open(folder / f"{rank}.err", "w") as err:
                ranks.append(subprocess.Popen(command, cwd=REPO, env=command_env(variables), stdout=out, stderr=err,
                                              stdin=subprocess.DEVNULL))  # fmt: skip
        try:
            codes = [rank.wait(timeout=300) for rank in ranks]  # the timeout only guards against a hang
        finally:
            for rank in ranks:
                rank.kill()
    logs = [((folder / f"{rank}.out").read_text(), (folder / f"{rank}.err").read_text()) for rank in range(processes)]
    return [subprocess.CompletedProcess(command, code, *log) for code, log in zip(codes, logs, strict=True)]


def test_why_a_launch_stopped_is_said_by_the_first_rank_to_stop(tmp_path, monkeypatch):
    """The launcher stops the other ranks as soon as one exits, so the first rank to stop says why (left to rank 0,
    the line could be lost), and the others' lines would repeat it; where no launcher's folder is shared, every rank
    says its own, or rank 0 alone a line they all find alike (main_process_only)."""
    from src.errors import first_to_say

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert first_to_say() and not first_to_say(main_process_only=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "1" / "error.json"))
    assert first_to_say(main_process_only=True)
    monkeypatch.setenv("RANK", "0")
    assert not first_to_say() and not first_to_say(main_process_only=True)  # one line for the launch


@pytest.mark.slow
@pytest.mark.parametrize(
    "build_args, pattern",
    [
        (lambda t: ["--data_files", f"{{train: {t}/none.parquet, eval: {t}/none.parquet}}"], "not found"),
        (lambda t: data_files(t, digits().head(40), digits("eval")), "train split has 40 samples, fewer than one"),
    ],
    ids=["missing data file", "train split smaller than a global batch"],
)
def test_bad_input_on_two_processes_stops_both(tmp_path, build_args, pattern):
    """Both processes find the problem before any collective and exit 2: none is left waiting for the other. The
    line they both would say comes once (src/errors.py: first_to_say)."""
    ranks = ranks_run_to_their_end([*QUICK, "--output_dir", str(tmp_path / "run"), *build_args(tmp_path)], tmp_path)
    assert [rank.returncode for rank in ranks] == [2, 2]
    errors = [line for rank in ranks for line in rank.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and pattern in errors[0]
    assert not (tmp_path / "run").exists()


FAILS_ON_RANK_1 = """
import errno, os
from src.tasks.digits import Digits

class Loss(Digits):
    def loss(self, model, batch):
        if os.environ["RANK"] == "1":
            raise ValueError("a batch only rank 1 cannot take")
        return super().loss(model, batch)

class Save(Digits):
    export_checkpoints = True  # its save_model in every checkpoint

    def save_model(self, accelerator, model, directory):
        if os.environ["RANK"] == "1":
            raise OSError(errno.ENOSPC, "No space left on device")
        super().save_model(accelerator, model, directory)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task", "codes", "said"),
    [
        ("Loss", [1, 70], ["error: Loss.loss() failed on a batch [tensor float32 [32, 1, 8, 8], tensor int64 [32]]: "
                           "ValueError: a batch only rank 1 cannot take"]),
        ("Save", [74, 74], ["error: could not write checkpoint ", "(OSError: [Errno 28] No space left on device)"]),
    ],
)  # fmt: skip
def test_a_rank_that_fails_alone_says_why_and_the_others_stop_quietly(tmp_path, task, codes, said):
    """One voice when one rank fails: its line, and no traceback of the others losing it (gloo's "Connection closed by
    peer") nor a second line of theirs ("failed on another process")."""
    (tmp_path / "fails_on_rank_1.py").write_text(FAILS_ON_RANK_1)
    args = [*QUICK, "--task", f"fails_on_rank_1.{task}", "--output_dir", str(tmp_path / "run")]
    ranks = ranks_run_to_their_end(args, tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert [rank.returncode for rank in ranks] == codes, ranks[0].stderr[-3000:]
    errors = [line for rank in ranks for line in rank.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(said[0]) and all(part in errors[0] for part in said), errors
    assert not [rank.stderr for rank in ranks if "Traceback" in rank.stderr]


@pytest.mark.slow
def test_a_rank_waiting_for_a_group_that_will_not_form_ends_on_sigterm(tmp_path):
    """A rank whose peer failed before the process group formed waits for it; the launcher's SIGTERM must end that
    wait (kept for a checkpoint, it left the rank waiting until torch elastic's SIGKILL 30 s later, or forever)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the launcher's, as launcher_store
    variables = torchrun_variables(0, 2, store.port, tmp_path / "launch")  # rank 1 never comes
    rank = subprocess.Popen([sys.executable, "train.py", *QUICK, "--output_dir", str(tmp_path / "run")], cwd=REPO,
                            env=command_env(variables), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        for _ in range(1200):  # until rank 0 has joined the store's rendezvous (a guard against a rank that never does)
            if store.num_keys() > 0 or rank.poll() is not None:
                break
            time.sleep(0.1)
        assert rank.poll() is None and store.num_keys() > 0, rank.stderr.read().decode()[-2000:] if rank.stderr else ""
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=120) == -signal.SIGTERM  # the timeout only guards against the wait going on
    finally:
        rank.kill()
        del store


def test_a_wrong_value_in_the_accelerate_config_is_one_line(tmp_path):
    """accelerate's loader takes any YAML value; its launcher then fails with a 27-line ValueError."""
    config = (REPO / "accelerate_configs" / "ddp.yaml").read_text().replace("num_processes: 2", "num_processes: two")
    path = write(tmp_path, "ddp.yaml", config)
    result = run_command([sys.executable, "scripts/launch.py", "--config_file", path, "train.py", *QUICK])
    assert_error_line(result, rf"accelerate config {re.escape(path)}: num_processes is 'two'; .*num_processes: 2")
    assert len(result.stderr.strip().splitlines()) == 1


def pin_to_one_core() -> None:
    """A child's preexec_fn: it and what it starts see one core, as in a job given one CPU (`--cpus-per-task 1`)."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["scripts/launch.py", "accelerate launch"])
def test_an_error_all_processes_find_is_said_once(tmp_path, launcher):
    """One process more than the launch has cores (on Linux it is given one, so 2 processes: fewer to start than one
    more than the machine's; the cpu_hints feature warns of it, tests/test_cpu_hints.py); a global batch of 32 is not
    divisible by 32 x that many, which every process finds: one line, and with scripts/launch.py the processes' exit
    code 2 and nothing else (`accelerate launch` adds its ChildFailedError report and exits 1)."""
    pinned = hasattr(os, "sched_setaffinity")
    processes = 2 if pinned else (os.cpu_count() or 1) + 1
    launch = launch_command(processes)
    if launcher == "scripts/launch.py":
        launch[1:3] = ["scripts/launch.py"]
    args = [*QUICK, "--global_batch_size", "32", "--output_dir", str(tmp_path / "run")]
    result = run_command([*launch, *args], timeout=300, preexec_fn=pin_to_one_core if pinned else None)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: --global_batch_size 32 is not divisible by per-device batch 32 x {processes} processes = "
        f"{32 * processes}; set --global_batch_size to a multiple of {32 * processes}"
        + (f", or --per_device_train_batch_size {32 // processes}" if 32 % processes == 0 else "")
    ]
    if "cpu_hints" in installed_names():  # its warning with the counts, once for all the processes
        assert result.stderr.count(f"warning: {processes} processes on {processes - 1} CPU cores") == 1
    if launcher == "scripts/launch.py":
        assert result.returncode == EXIT_USAGE
        lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("warning: ")]
        assert lines == errors, result.stderr  # the error, no more (and cpu_hints' warning, once)
    else:  # what README and docs/errors.md say of accelerate launch: the line first, then its report and exit 1
        assert result.stderr.index(errors[0]) < result.stderr.index("ChildFailedError") and result.returncode == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_ctrl_c_to_a_launch_of_2_processes_is_one_line_and_exit_130(tmp_path):
    """A terminal's Ctrl-C reaches the launcher (its processes are each in a session of their own), which passes it on:
    through scripts/launch.py, one line for both processes and exit 130, no traceback (`accelerate launch` ends with
    torch elastic's SignalException: docs/errors.md)."""
    out = tmp_path / "run"
    launch = launch_command(2)
    launch[1:3] = ["scripts/launch.py"]
    args = ["--max_steps", "100000", "--logging_steps", "1", "--save_steps", "0", "--output_dir", str(out)]
    with open(tmp_path / "stderr", "w+") as stderr:
        launcher = subprocess.Popen([*launch, *args], cwd=REPO, env=command_env(), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or len(read_metrics(out)) < 3:  # training
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.2)
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(timeout=120)
    console = (tmp_path / "stderr").read_text()
    assert code == EXIT_INTERRUPTED, console
    assert console.count("interrupted (Ctrl-C): stopped without saving") == 1 and "Traceback" not in console, console


def test_the_error_line_is_one_write(monkeypatch):
    """Processes on one pipe interleave between writes: the line goes out whole, its newline with it."""
    writes = []
    monkeypatch.setattr(sys, "stderr", type("Pipe", (), {"write": writes.append, "flush": lambda self: None})())

    @command_line
    def bad():
        raise UsageError("no such file: fix the path")

    with pytest.raises(SystemExit) as stopped:
        bad()
    assert stopped.value.code == EXIT_USAGE and writes == ["error: no such file: fix the path\n"]


def test_a_checkpoint_write_that_failed_on_another_process_stops_this_one_quietly(tmp_path, capsys, monkeypatch):
    """The process whose write failed says why (the test above); the others stop with the same exit code and no
    line of their own, whichever gets to say first."""
    import torch

    from src.checkpoint import TrainerState, save_checkpoint
    from src.config import TrainConfig
    from src.errors import CheckpointWriteFailed

    class AnotherProcessFailed:  # rank 1 of 2, whose peer's write failed: the agreement sums to 1
        num_processes, is_main_process, device = 2, False, "cpu"

        def reduce(self, flag, reduction):
            return torch.tensor(1.0)

        def save_state(self, path):
            pass

    with pytest.raises(CheckpointWriteFailed) as stopped:
        save_checkpoint(AnotherProcessFailed(), TrainConfig(output_dir=str(tmp_path)), TrainerState(step=3))
    assert "failed on another process" in str(stopped.value) and stopped.value.said_elsewhere
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)

    def stops():
        raise stopped.value

    with pytest.raises(SystemExit) as exited:
        command_line(stops)()
    assert exited.value.code == EXIT_WRITE_FAILED and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("variables", "main"),
    [
        ({}, True),
        ({"RANK": "1"}, False),
        ({"PMI_RANK": "1"}, False),
        ({"OMPI_COMM_WORLD_RANK": "0"}, True),
        ({"RANK": "0", "PMI_RANK": "1"}, True),
    ],  # fmt: skip  (torchrun's RANK first, as Accelerate reads them)
)
def test_the_main_process_before_the_group_forms_is_the_launchers_rank_0(monkeypatch, variables, main):
    from src.errors import RANKS, is_main_process

    for name in RANKS:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert is_main_process() is main
