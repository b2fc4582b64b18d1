"""Scaling features through the same train.py: notebooks, early stopping, debug presets, profiler."""

import json
import math

import pytest

from src.features import installed_names
from tests.conftest import (
    QUICK,
    REPO,
    assert_ok,
    assert_processes,
    free_port,
    last_row,
    read_metrics,
    run_main,
    run_python,
    run_train,
    series,
)
from tests.helpers import needs

NOTEBOOK = REPO / "notebooks" / "train_in_notebook.ipynb"

LAUNCH_TWICE = """
import os, signal, sys
os.setpgrp()  # a hang ends with its forked processes: the deadline kills the whole group, not only this process
signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))
signal.alarm({deadline})
{notebook}
sys.path.insert(0, {repo!r})
from accelerate import notebook_launcher
from train import main
for args in {runs!r}:  # a second launch from the same process, like re-running a notebook cell
    notebook_launcher(main, args=(args,), num_processes=2, use_port=str({port}))  # not 29500: tests run side by side
"""

# No improvement at steps 20 and 30 (the learning rate moves nothing): patience 2 stops at step 30.
EARLY_STOPPING = ["--max_steps", "200", "--eval_steps", "10", "--logging_steps", "10", "--learning_rate", "1e-9",
                  "--early_stopping_patience", "2", "--early_stopping_metric", "eval/accuracy",
                  "--early_stopping_mode", "max"]  # fmt: skip


def notebook_code() -> str:
    """The notebook's code cells, in order, as Jupyter runs them; none where the notebook feature was removed."""
    if not NOTEBOOK.is_file():
        return ""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")


@pytest.fixture(scope="module")
def launched_twice(tmp_path_factory):
    """Two 2-process runs from one Python process through notebook_launcher, as a notebook re-runs its cell: a short
    one, then one that stops early (result, {name: output_dir}). Where the project has notebooks/train_in_notebook.ipynb
    its code runs first in that process, from the notebooks/ folder as Jupyter starts it: three launches, two reruns."""
    folder = tmp_path_factory.mktemp("notebook_launcher")
    runs = {"quick": [*QUICK, "--output_dir", str(folder / "quick")],
            "early": [*EARLY_STOPPING, "--output_dir", str(folder / "early")]}  # fmt: skip
    # a process that stopped early alone would leave the other hanging until the deadline (then exit -9)
    code = LAUNCH_TWICE.format(repo=str(REPO), runs=list(runs.values()), deadline=200, notebook=notebook_code(),
                               port=free_port())  # fmt: skip
    result = run_python("-c", code, cwd=NOTEBOOK.parent if NOTEBOOK.is_file() else REPO)
    return result, {name: folder / name for name in runs}


@pytest.mark.slow
def test_notebook_launcher_forms_a_two_process_group_and_can_rerun(launched_twice):
    result, runs = launched_twice
    assert_ok(result)
    for out in runs.values():
        assert_processes(out, 2)
    rows = read_metrics(runs["quick"])
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 4, 6]  # one metrics file, each step once


@pytest.mark.slow
@needs("notebook")
def test_the_notebook_runs(launched_twice):
    """The notebook's cells, run as the first launch of launched_twice's process."""
    result, _ = launched_twice
    assert_ok(result)
    assert "world size: 2" in result.stdout
    assert_processes(REPO / "runs" / "notebook", 2)  # the notebook's output_dir, relative to the repo root


@pytest.mark.slow
def test_early_stopping_stops_every_process_at_the_same_step(launched_twice):
    """The second run of launched_twice, on 2 processes."""
    result, runs = launched_twice
    assert_ok(result)
    out = runs["early"]
    assert_processes(out, 2)
    rows = read_metrics(out)
    assert max(row["step"] for row in rows) == 30  # no improvement at steps 20 and 30
    assert [r["step"] for r in rows if "train/loss" in r] == [10, 20, 30]
    assert (out / "checkpoints" / "step_30").is_dir() and (out / "model" / "model.safetensors").exists()
    assert (result.stdout + result.stderr).count("early stopping at step 30") == 1


@pytest.mark.slow
def test_overfit_preset_drives_the_train_loss_to_zero(tmp_path):
    out = tmp_path / "run"
    result = run_main("--config", "configs/default.yaml", "--config", "configs/debug/overfit.yaml",
                      "--output_dir", str(out))  # fmt: skip
    assert_ok(result)
    assert series(read_metrics(out), "train/loss")[150] < 0.05


@pytest.mark.slow
def test_smoke_preset(tmp_path):
    out = tmp_path / "run"
    result = run_main("--config", "configs/default.yaml", "--config", "configs/debug/smoke.yaml",
                      "--output_dir", str(out))  # fmt: skip
    assert_ok(result)
    assert last_row(read_metrics(out))["eval/num_samples"] == 64


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gradient_checkpointing", "true"], "DigitsCNN does not support --gradient_checkpointing"),
        (["--early_stopping_patience", "1", "--early_stopping_metric", "eval/f1", "--eval_steps", "2"],
         "--early_stopping_metric eval/f1 is not logged"),
    ],
)  # fmt: skip
def test_unsupported_options_are_clear_errors(tmp_path, flags, message):
    result = run_main(*QUICK, "--output_dir", str(tmp_path / "run"), *flags)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_torch_compile_trains_on_the_cpu_and_saves_plain_keys(tmp_path):
    """--torch_compile true: inductor compiles the model (its cache fills), the losses are eager's, and the saved
    model and checkpoints have the plain model's keys (no `_orig_mod.`): an eager run resumes a compiled checkpoint."""
    from safetensors.torch import load_file

    flags = [*QUICK, "--max_steps", "4", "--logging_steps", "1", "--save_steps", "2", "--model", "linear",
             "--norm", "none"]  # fmt: skip
    cache = tmp_path / "inductor"  # empty: the run compiles for real instead of loading an earlier compilation
    inductor = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no pool of compilers
    compiled = run_train(*flags, "--torch_compile", "true", "--output_dir", str(tmp_path / "compiled"),
                         env=inductor, timeout=600)  # fmt: skip
    assert_ok(compiled)
    assert any(path.suffix == ".py" for path in cache.rglob("*")), "inductor generated no code"
    assert_ok(run_main(*flags, "--output_dir", str(tmp_path / "eager")))
    losses, eager = (series(read_metrics(tmp_path / run), "train/loss") for run in ("compiled", "eager"))
    assert list(losses) == [1, 2, 3, 4] and all(math.isfinite(loss) for loss in losses.values())
    assert losses == pytest.approx(eager, abs=1e-5)

    def keys(run: str, path: str) -> list[str]:
        return sorted(load_file(tmp_path / run / path))

    for path in ("model/model.safetensors", "checkpoints/step_2/model.safetensors"):
        assert keys("compiled", path) == keys("eager", path) == ["1.bias", "1.weight"]
    checkpoint = str(tmp_path / "compiled" / "checkpoints" / "step_2")
    assert_ok(run_main(*flags, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", checkpoint))
    resumed = series(read_metrics(tmp_path / "resumed"), "train/loss")
    assert list(resumed) == [3, 4] and resumed == pytest.approx({3: eager[3], 4: eager[4]}, abs=1e-5)


@pytest.mark.slow
def test_bf16_mixed_precision_trains_on_the_cpu(out, monkeypatch):
    from src.models.digits_cnn import DigitsCNN

    forward = DigitsCNN.forward

    # the model's own output, inside Accelerate's autocast wrapper (which casts what leaves the model back to float32)
    def recording(self, images):
        logits = forward(self, images)
        print("LOGITS DTYPE", logits.dtype, flush=True)
        return logits

    monkeypatch.setattr(DigitsCNN, "forward", recording)
    hints = "cpu_hints" in installed_names()
    if hints:
        monkeypatch.setattr("src.features.cpu_hints.cpu_has_bf16", lambda: False)  # as on an AMD EPYC: emulated, slow
    result = run_main("--max_steps", "30", "--logging_steps", "10", "--eval_steps", "1000", "--mixed_precision", "bf16",
                      "--output_dir", str(out))  # fmt: skip
    assert_ok(result)
    if hints:
        assert "warning: bf16 mixed precision on a CPU without bf16 instructions" in result.stderr
    rows = read_metrics(out)
    assert rows[0]["setup/mixed_precision"] == "bf16"
    dtypes = [line for line in result.stdout.splitlines() if line.startswith("LOGITS DTYPE")]
    checked = "preflight" in installed_names()  # its eval batch before training
    assert len(dtypes) == 30 * 2 + 3 + checked and set(dtypes) == {"LOGITS DTYPE torch.bfloat16"}  # train, eval
    losses = series(rows, "train/loss")
    assert list(losses) == [10, 20, 30] and all(math.isfinite(loss) for loss in losses.values())
    assert losses[30] < losses[20] < losses[10]
