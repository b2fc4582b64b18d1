"""Use a trained model without training it again: evaluation alone (--do_train false), a test split, predictions
in input order on any process count, and the best model kept (metric_for_best_model, load_best_model_at_end)."""

import json
import re
import shlex
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils.data import TensorDataset

from src.best import BestEvaluation
from src.checkpoint import TrainerState, rotate_checkpoints
from src.cli import parse_config
from src.config import TrainConfig
from src.data import MissingColumns
from src.errors import UsageError
from src.loaders import build_test_and_predict_loaders
from src.tasks.base import Task
from tests.conftest import (
    QUICK,
    REPO,
    assert_ok,
    read_metrics,
    run_main,
    run_on,
    run_with_hook,
    series,
    signal_at,
)
from tests.helpers import printed_by

DIGITS = REPO / "data" / "digits"
TRAIN = ["--max_steps", "40", "--eval_steps", "10", "--logging_steps", "10"]


def eval_results(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "eval_results.json").read_text())


def predictions(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "predictions.jsonl").read_text().splitlines()]


def folder_state(folder: Path) -> dict:
    """Every file under `folder` with its size and modification time: to prove nothing was rewritten."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A short digits run (1 process) whose model/ the tests reuse."""
    output_dir = tmp_path_factory.mktemp("trained") / "run"
    assert_ok(run_main(*TRAIN, "--output_dir", str(output_dir)))
    return output_dir


@pytest.fixture(scope="module")
def prime_input(tmp_path_factory) -> Path:
    """97 rows (a prime: uneven shards on 2 and 3 processes) with an id column and no labels."""
    frame = pd.read_parquet(DIGITS / "eval.parquet").head(97).drop(columns=["label"])
    frame.insert(0, "id", [f"digit-{i}" for i in range(len(frame))])
    path = tmp_path_factory.mktemp("data") / "unlabelled.parquet"
    frame.to_parquet(path)
    return path


@pytest.fixture(scope="module")
def on_two_processes(trained, prime_input, tmp_path_factory) -> dict:
    """One 2-process run of the trained model that evaluates it (train file absent) and predicts the prime-sized
    input, labelled here (a labelled test split is evaluated too): the eval-only and the prediction tests both read
    it. Returns its folder and whether the trained run's folder stayed as it was."""
    folder = tmp_path_factory.mktemp("two_processes")
    labelled = folder / "labelled.parquet"
    labels = pd.read_parquet(DIGITS / "eval.parquet").head(97)["label"]
    pd.read_parquet(prime_input).assign(label=labels).to_parquet(labelled)
    before = folder_state(trained)
    result = run_on(
        2,
        "--do_train", "false", "--do_predict", "true", "--model_name_or_path", str(trained / "model"),
        "--data_files", f"{{train: {folder}/absent.parquet, eval: {DIGITS}/eval.parquet, test: {labelled}}}",
        "--per_device_eval_batch_size", "8", "--output_dir", str(folder / "eval"),
    )  # fmt: skip
    assert_ok(result)
    return {"output_dir": folder / "eval", "trained_unchanged": folder_state(trained) == before}


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_eval_only_reproduces_the_runs_final_metrics_without_the_train_split(trained, tmp_path, processes, request):
    if processes == 1:
        before = folder_state(trained)
        out = tmp_path / "eval"
        result = run_on(
            processes,
            "--do_train", "false", "--model_name_or_path", str(trained / "model"), "--output_dir", str(out),
            "--data_files", f"{{train: {tmp_path}/absent.parquet, eval: {DIGITS}/eval.parquet}}",  # never read
        )  # fmt: skip
        assert_ok(result)
        assert folder_state(trained) == before
        written = ["eval_results.json"]  # no checkpoint, no model/
    else:  # the same, with a test split evaluated and predicted (on_two_processes)
        run = request.getfixturevalue("on_two_processes")
        out = run["output_dir"]
        assert run["trained_unchanged"]
        written = ["eval_results.json", "predictions.jsonl"]
    final = [row for row in read_metrics(trained) if "eval/accuracy" in row][-1]
    results = eval_results(out)
    assert results["eval/accuracy"] == final["eval/accuracy"]
    assert results["eval/num_samples"] == final["eval/num_samples"] == 359
    assert results["eval/loss"] == pytest.approx(final["eval/loss"], rel=1e-6)
    assert sorted(p.name for p in out.iterdir()) == written


@pytest.mark.slow
def test_eval_only_defaults_to_the_runs_own_model_and_writes_nothing_else(trained):
    """`python train.py --do_train false --output_dir RUN` evaluates RUN/model and adds only eval_results.json."""
    before = {name: state for name, state in folder_state(trained).items() if name != "eval_results.json"}
    assert_ok(run_main("--do_train", "false", "--output_dir", str(trained)))
    after = {name: state for name, state in folder_state(trained).items() if name != "eval_results.json"}
    assert after == before
    final = [row for row in read_metrics(trained) if "eval/accuracy" in row][-1]
    assert eval_results(trained)["eval/accuracy"] == final["eval/accuracy"]


@pytest.mark.slow
def test_predictions_of_a_prime_sized_input_are_the_same_on_1_2_and_3_processes(
    trained, prime_input, on_two_processes, tmp_path
):
    rows = {2: predictions(on_two_processes["output_dir"])}  # its input labelled: the same rows to predict
    for processes in (1, 3):  # without labels
        output_dir = tmp_path / f"p{processes}"
        result = run_on(
            processes,
            "--do_train", "false", "--do_eval", "false", "--do_predict", "true", "--output_dir", str(output_dir),
            "--model_name_or_path", str(trained), "--data_files", f"{{test: {prime_input}}}",
            "--per_device_eval_batch_size", "8",
        )  # fmt: skip
        assert_ok(result)
        rows[processes] = predictions(output_dir)
    expected_ids = [f"digit-{i}" for i in range(97)]
    for processes, found in rows.items():
        assert [row["id"] for row in found] == expected_ids, f"{processes} processes: rows missing, doubled or moved"
        assert [row["prediction"] for row in found] == [row["prediction"] for row in rows[1]]
        torch.testing.assert_close(
            torch.tensor([row["probabilities"] for row in found]),
            torch.tensor([row["probabilities"] for row in rows[1]]),
            rtol=0, atol=1e-6,
        )  # fmt: skip
    # the predicted classes are the model's: as accurate on these rows as the eval of the same rows says
    labels = pd.read_parquet(DIGITS / "eval.parquet").head(97)["label"].tolist()
    correct = sum(row["prediction"] == label for row, label in zip(rows[1], labels, strict=True))
    assert correct / 97 > 0.5
    assert all(abs(sum(row["probabilities"]) - 1) < 1e-5 for row in rows[1])


def test_rows_without_ids_follow_the_input_order_and_say_so(trained, prime_input, tmp_path):
    """The file's ids under another name than --id_column: no ids in the rows, and a line that says why."""
    out = tmp_path / "predicted"
    result = run_main("--do_train", "false", "--do_eval", "false", "--do_predict", "true", "--id_column", "doc_id",
                      "--output_dir", str(out), "--model_name_or_path", str(trained / "model"),
                      "--data_files", f"{{test: {prime_input}}}")  # fmt: skip
    assert_ok(result)
    assert "the rows follow the test split's order: it has no ids (--id_column doc_id)" in result.stderr
    rows = predictions(out)
    assert len(rows) == 97 and not {"id", "doc_id"} & set(rows[0])


@pytest.mark.slow
def test_predict_from_python_returns_the_rows_of_predictions_jsonl(trained, prime_input, monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(REPO)
    from train import predict

    rows = predict(["--output_dir", str(trained), "--data_files", f"{{test: {prime_input}}}"])
    assert len(rows) == 97 and rows[0]["id"] == "digit-0" and rows[-1]["id"] == "digit-96"
    assert rows == predictions(trained)
    run = shutil.copytree(trained, tmp_path / "run")  # a checkpoint's predictions go into its folder: this run's
    (run / "predictions.jsonl").unlink()  # not what a checkpoint's predictions return
    checkpoint = max((run / "checkpoints").iterdir())
    from_checkpoint = predict(["--model_name_or_path", str(checkpoint), "--data_files", f"{{test: {prime_input}}}"])
    assert from_checkpoint == predictions(checkpoint) and len(from_checkpoint) == 97


@pytest.mark.slow
def test_test_split_is_evaluated_and_predicted_after_training(tmp_path):
    """A labelled test split: test/ metrics next to the eval ones, predictions of the test split."""
    test_file = tmp_path / "test.parquet"
    pd.read_parquet(DIGITS / "eval.parquet").head(31).to_parquet(test_file)
    files = f"{{train: {DIGITS}/train.parquet, eval: {DIGITS}/eval.parquet, test: {test_file}}}"
    out = tmp_path / "run"
    assert_ok(run_main("--max_steps", "10", "--data_files", files, "--do_predict", "true", "--output_dir", str(out)))
    results = eval_results(out)
    assert results["test/num_samples"] == 31 and 0 <= results["test/accuracy"] <= 1
    assert {"eval/accuracy", "eval/loss", "test/loss"} <= set(results)
    assert series(read_metrics(out), "test/accuracy") == {10: results["test/accuracy"]}
    assert len(predictions(out)) == 31


def test_an_unlabelled_test_split_is_predicted_not_scored_beside_training(tmp_path, prime_input):
    """The file to predict needs no label column, also in a training run: a warning, no test/ metrics, its rows
    predicted with their ids. One that lacks the inputs too is refused, before training."""
    files = f"{{train: {DIGITS}/train.parquet, eval: {DIGITS}/eval.parquet, test: {prime_input}}}"
    out = tmp_path / "run"
    result = run_main("--max_steps", "10", "--data_files", files, "--do_predict", "true", "--output_dir", str(out))
    assert_ok(result)
    assert (
        "no test/ metrics: the test split has no column label (it has id, pixels); it is only predicted"
        in result.stderr
    )
    assert not any(key.startswith("test/") for key in eval_results(out)) and "eval/accuracy" in eval_results(out)
    assert [row["id"] for row in predictions(out)] == [f"digit-{i}" for i in range(97)]
    pd.read_parquet(prime_input).drop(columns=["pixels"]).to_parquet(no_inputs := tmp_path / "ids.parquet")
    files = f"{{train: {DIGITS}/train.parquet, eval: {DIGITS}/eval.parquet, test: {no_inputs}}}"
    result = run_main("--max_steps", "10", "--data_files", files, "--output_dir", str(tmp_path / "refused"))
    assert result.returncode == 2 and "error: the test split has no column pixels" in result.stderr
    assert not (tmp_path / "refused").exists()


def test_an_unlabelled_test_split_is_read_once_for_the_check_and_the_predictions():
    """Finding that the test split lacks labels reads its inputs; the predictions use that reading, not another."""
    reads, inputs = [], TensorDataset(torch.zeros(3, 2))

    class Unlabelled(Task):
        def build_eval_dataset(self, split: str, labelled: bool = True):
            reads.append((split, labelled))
            if labelled:
                raise MissingColumns("the test split has no column label (it has pixels)", "set --label_column")
            return inputs

    config = TrainConfig(data_files={"train": "a", "eval": "b", "test": "c"}, do_predict=True)
    test_loader, split, predict_loader = build_test_and_predict_loaders(Unlabelled(config), config)
    assert reads == [("test", True), ("test", False)]
    assert test_loader is None and split == "test" and predict_loader.dataset is inputs


def test_a_best_model_at_the_last_step_is_logged_too(tmp_path):
    """One evaluation, at the end: the best is the final model (nothing to load), and best_model/ says so."""
    out = tmp_path / "run"
    assert_ok(run_main("--max_steps", "4", "--eval_steps", "4", "--load_best_model_at_end", "true",
                       "--output_dir", str(out)))  # fmt: skip
    summary = [row for row in read_metrics(out) if "best_model/step" in row]
    assert summary and summary[-1]["best_model/step"] == 4
    assert summary[-1]["best_model/eval/loss"] == eval_results(out)["eval/loss"]


def best_run(tmp_path: Path, name: str, extra=(), hook: str | None = None):
    """The *worst* accuracy is "best" (greater_is_better false): an early step, not the last, so the final weights
    must really be replaced by an older checkpoint's. With a `hook`, a process of its own (run_with_hook)."""
    args = [*TRAIN, "--save_steps", "20", "--save_total_limit", "1", "--metric_for_best_model", "accuracy",
            "--greater_is_better", "false", "--load_best_model_at_end", "true", "--output_dir", str(tmp_path / name),
            *extra]  # fmt: skip
    return run_main(*args) if hook is None else run_with_hook(tmp_path, args, hook=hook)


@pytest.mark.slow
def test_load_best_model_at_end_keeps_the_best_checkpoint_and_model_evaluates_to_it(tmp_path):
    out = tmp_path / "best"
    assert_ok(best_run(tmp_path, "best"))
    accuracy = series(read_metrics(out), "eval/accuracy")
    best_step = min(accuracy, key=lambda step: (accuracy[step], step))
    assert best_step < 40, f"the test needs a best that is not the last step: {accuracy}"
    summary = [row for row in read_metrics(out) if "best_model/step" in row]
    assert summary and summary[-1]["best_model/step"] == best_step
    assert summary[-1]["best_model/eval/accuracy"] == accuracy[best_step]
    # rotation (save_total_limit 1) kept the best checkpoint beside the newest
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted({f"step_{best_step}", "step_40"})
    # model/ holds the best weights: evaluated alone, it gives the best logged accuracy
    assert_ok(run_main("--do_train", "false", "--output_dir", str(out)))
    assert eval_results(out)["eval/accuracy"] == accuracy[best_step]

    # killed after the step-20 checkpoint and resumed: the same best step, the same model/
    kill = signal_at(30)
    assert best_run(tmp_path, "killed", hook=kill).returncode == -9
    resumed = best_run(tmp_path, "killed", ["--resume_from_checkpoint", "latest"])
    assert_ok(resumed)
    assert "resuming from" in resumed.stderr and "step_20" in resumed.stderr
    summary = [row for row in read_metrics(tmp_path / "killed") if "best_model/step" in row]
    assert summary[-1]["best_model/step"] == best_step
    assert_ok(run_main("--do_train", "false", "--output_dir", str(tmp_path / "killed")))
    assert eval_results(tmp_path / "killed")["eval/accuracy"] == accuracy[best_step]


def test_rotation_never_deletes_the_best_checkpoint(tmp_path):
    for step in (10, 20, 30, 40):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text("{}")
    rotate_checkpoints(tmp_path, keep=1, keep_step=20)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_20", "step_40"]
    rotate_checkpoints(tmp_path, keep=1, keep_step=40)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_40"]


@pytest.mark.parametrize(
    ("metric", "greater", "values", "best"),
    [
        ("eval/accuracy", None, [0.5, 0.7, 0.7, 0.6], (1, 0.7)),  # ties keep the earlier step
        ("loss", None, [2.0, 1.0, 1.5, 0.5], (3, 0.5)),  # "loss" means eval/loss, lower is better
        ("accuracy", False, [0.5, 0.4, 0.7, 0.6], (1, 0.4)),
    ],
)
def test_best_model_follows_the_metric_and_direction(metric, greater, values, best):
    config = TrainConfig(metric_for_best_model=metric, greater_is_better=greater)
    state = TrainerState()
    tracker = BestEvaluation(config, state)
    metrics = [{config.metric_for_best_model: value, "eval/other": 0.0} for value in values]
    improved = [tracker.update(metric, step)[0] for step, metric in enumerate(metrics)]
    assert (state.best_model_step, state.best_model_metric) == best
    assert improved[0] and improved.count(True) == len({s for s, flag in enumerate(improved) if flag})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--do_train", "false", "--do_eval", "false"], "all false: nothing to do"),
        (["--do_eval", "false", "--metric_for_best_model", "accuracy"], "needs evaluations during training"),
        (["--do_eval", "false", "--load_best_model_at_end", "true"], "needs evaluations during training"),
    ],
)
def test_bad_phase_settings_are_refused_when_parsed(flags, message):
    with pytest.raises(UsageError, match=message):
        parse_config(flags)


def test_best_model_settings_do_not_apply_without_training():
    """A run's config.yaml that kept the best model evaluates as it is: `--config runs/x/config.yaml --do_train
    false` (tests/test_adapters.py runs it)."""
    config = parse_config(["--do_train", "false", "--load_best_model_at_end", "true", "--early_stopping_patience", "2"])
    assert not config.do_train and config.load_best_model_at_end


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--do_train", "false", "--do_eval", "false"], "all false: nothing to do"),
        (["--do_train", "false", "--model_name_or_path", "no/such/run"], "no such folder"),
        (["--do_train", "false"], "run has no model/ to evaluate (no run finished there): train there first, or name"),
        (["--do_train", "false", "--model_name_or_path", "src"], "does not hold weights for this model"),
        (["--max_steps", "2", "--metric_for_best_model", "f1"], "eval/f1 is not logged"),
    ],
)
def test_bad_phase_settings_are_one_line(flags, message, tmp_path):
    result = run_main(*flags, "--output_dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr.strip().splitlines()[-1]


def test_best_model_needs_eval_and_parses_transformers_names():
    config = TrainConfig(load_best_model_at_end=True)
    assert (config.metric_for_best_model, config.greater_is_better) == ("eval/loss", False)
    assert TrainConfig(metric_for_best_model="accuracy").greater_is_better is True
    with pytest.raises(UsageError, match="nothing to do"):
        TrainConfig(do_train=False, do_eval=False, do_predict=False)


@pytest.mark.slow
@pytest.mark.usefixtures("stdlib_text")  # configs/lm.yaml's data/stdlib
def test_causal_lm_model_evaluates_alone_as_at_the_end_of_training(tmp_path):
    """The GPT's tied embedding reloads (the tabular model's standardisation: tests/test_tabular.py)."""
    runs = {
        "causal_lm": [
            "--task",
            "causal_lm",
            "--config",
            "configs/lm.yaml",
            "--n_layer",
            "1",
            "--n_embd",
            "32",
            "--max_train_tokens",
            "20000",
            "--max_eval_tokens",
            "5000",
        ],  # fmt: skip
    }
    for name, args in runs.items():
        out = tmp_path / name
        assert_ok(run_main(*args, "--max_steps", "6", "--output_dir", str(out)))
        final = [row for row in read_metrics(out) if "eval/loss" in row][-1]
        assert_ok(run_main(*args, "--do_train", "false", "--output_dir", str(out)))
        assert eval_results(out)["eval/loss"] == pytest.approx(final["eval/loss"], rel=1e-6), name


@pytest.mark.slow
def test_readme_use_your_trained_model_commands_run(tmp_path, default_run):
    """The README section's commands verbatim, in a folder that links to the repository's code and data, so their
    runs/ is a fresh one (after the Quickstart's run, which they start from: conftest's default_run, copied)."""
    from scripts.readme_commands import section_commands

    for name in ("train.py", "src", "data", "configs", "accelerate_configs", "scripts"):
        (tmp_path / name).symlink_to(REPO / name)
    shutil.copytree(default_run, tmp_path / "runs" / "digits")  # the Quickstart's run
    for command in section_commands("Use your trained model", page="docs/predict.md"):
        words = shlex.split(command)
        if words[:2] == ["python", "train.py"]:  # train.py's main in this process, run in the same folder
            assert_ok(run_main(*words[2:], cwd=tmp_path))
        else:  # `python -c`: train.py's predict() from Python, in this process too
            printed = printed_by(command, tmp_path)  # predict()'s first row
            assert printed.startswith("{'prediction': ") and "'probabilities': [" in printed, printed
    runs = tmp_path / "runs"
    assert eval_results(runs / "digits")["eval/num_samples"] == 359
    assert eval_results(runs / "digits" / "checkpoints" / "step_200")["eval/num_samples"] == 359  # beside its weights
    assert len(predictions(runs / "digits")) == 359
    assert [row for row in read_metrics(runs / "digits_best") if "best_model/step" in row or "eval/loss" in row]


@pytest.mark.slow
@pytest.mark.usefixtures("stdlib_text")  # configs/lm.yaml's data/stdlib
def test_byte_language_model_generates_the_same_text_on_1_and_3_processes(tmp_path):
    """causal_lm --do_predict: greedy bytes after each of 5 prompts, left-padded to one length; rows in order."""
    args = ["--task", "causal_lm", "--config", "configs/lm.yaml", "--n_layer", "1", "--n_embd", "32",
            "--max_train_tokens", "40000", "--max_eval_tokens", "5000"]  # fmt: skip
    assert_ok(run_main(*args, "--max_steps", "30", "--learning_rate", "1e-2", "--output_dir", str(tmp_path / "lm")))
    prompts = tmp_path / "prompts.jsonl"
    texts = ["def main():\n    ", "import ", "", "    return self.", "x" * 500]
    prompts.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    rows = {}
    for processes in (1, 3):
        out = tmp_path / f"p{processes}"
        predict_args = ["--do_train", "false", "--do_eval", "false", "--do_predict", "true", "--max_new_tokens", "16",
                        "--model_name_or_path", str(tmp_path / "lm"), "--data_files", f"{{test: {prompts}}}",
                        "--output_dir", str(out)]  # fmt: skip
        assert_ok(run_on(processes, *args, *predict_args))
        rows[processes] = predictions(out)
    assert len(rows[1]) == len(texts) and rows[1] == rows[3]
    assert any(row["generated"].strip() for row in rows[1])  # 30 steps learn some bytes of Python


@pytest.mark.slow
def test_the_trained_model_is_saved_before_predictions_can_fail(tmp_path, monkeypatch):
    """What runs after training reads more data (the test split, ids): a failure there keeps the trained model."""
    from src.tasks.digits import Digits

    def prediction_ids(self, split):
        raise UsageError("the ids of this data cannot be read (simulated)")

    monkeypatch.setattr(Digits, "prediction_ids", prediction_ids)
    out = tmp_path / "run"
    result = run_main("--max_steps", "4", "--eval_steps", "1000", "--do_predict", "true", "--output_dir", str(out))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: the ids of this data cannot be read (simulated)"
    assert (out / "model" / "model.safetensors").is_file() and not (out / "predictions.jsonl").exists()


def test_eval_only_into_a_trained_run_evaluates_its_own_model_or_refuses(tmp_path):
    """A trained run's folder as output_dir: its own model/ is what --do_train false evaluates, also when the run's
    config.yaml names the model it started from, and a checkpoint's results go beside it, not over the run's; another
    model's results there are refused before anything runs."""
    from src.final_model import model_to_evaluate
    from src.run_dir import CONFIG_FILE, MODEL_DIR

    run, base = tmp_path / "run", tmp_path / "base"
    (run / MODEL_DIR).mkdir(parents=True)
    (run / CONFIG_FILE).write_text(f"model_name_or_path: {base}\n")
    (run / "checkpoints" / "step_8").mkdir(parents=True)
    (run / "checkpoints" / "step_8" / "trainer_state.json").write_text("{}")
    before = sorted(run.rglob("*"))

    def model_for(*flags: str) -> str:
        return model_to_evaluate(parse_config(["--do_train", "false", "--output_dir", str(run), *flags]))

    assert model_for().model_name_or_path == f"{run}/model"  # the default: the run's own model/
    checkpoint = str(run / "checkpoints" / "step_10")
    assert model_for("--model_name_or_path", checkpoint).model_name_or_path == checkpoint  # one of its checkpoints
    step_8 = model_for("--model_name_or_path", str(run / "checkpoints" / "step_8"))
    assert step_8.output_dir == step_8.model_name_or_path == str(run / "checkpoints" / "step_8")  # results beside it
    assert model_for("--model_name_or_path", str(base)).model_name_or_path == str(run / MODEL_DIR)  # its start
    other = tmp_path / "other"
    message = f"--output_dir {run} holds a trained run: evaluating --model_name_or_path {other} there would replace"
    with pytest.raises(UsageError, match=re.escape(message)):
        model_for("--model_name_or_path", str(other))
    assert sorted(run.rglob("*")) == before
    fresh = parse_config(["--do_train", "false", "--output_dir", str(tmp_path / "new"), "--model_name_or_path", "x"])
    assert model_to_evaluate(fresh) is fresh  # a folder without a trained run: any model


@pytest.mark.slow
@pytest.mark.usefixtures("stdlib_text")  # causal_lm's default data, data/stdlib
def test_eval_only_from_a_run_takes_its_task_options_and_data_from_its_config(tmp_path):
    """Neither --task nor the model's options: the run's config.yaml has them. The run folder, its model/, a
    checkpoint, or the run's own config.yaml with another --output_dir: each evaluates the run's model to its eval."""
    run = tmp_path / "run"
    options = ["--n_layer", "1", "--n_embd", "32", "--max_train_tokens", "20000", "--max_eval_tokens", "5000"]
    assert_ok(run_main("--task", "causal_lm", *options, "--max_steps", "6", "--output_dir", str(run)))
    final = [row for row in read_metrics(run) if "eval/loss" in row][-1]
    evaluations = {
        "run": ["--model_name_or_path", str(run)],  # results into the run's folder
        "model": ["--model_name_or_path", str(run / "model"), "--output_dir", str(tmp_path / "model")],
        "checkpoint": ["--model_name_or_path", str(run / "checkpoints" / "step_6"),
                       "--output_dir", str(tmp_path / "checkpoint")],
        "config": ["--config", str(run / "config.yaml"), "--output_dir", str(tmp_path / "config")],
    }  # fmt: skip
    for name, args in evaluations.items():
        assert_ok(run_main("--do_train", "false", *args))
        results = eval_results(run if name == "run" else tmp_path / name)
        assert results["eval/loss"] == final["eval/loss"], name
        assert results["eval/num_samples"] == final["eval/num_samples"], name


def test_a_runs_own_config_with_another_output_dir_evaluates_the_runs_model_or_refuses(tmp_path):
    """`--config runs/x/config.yaml --do_train false --output_dir elsewhere`: that config names the model the run
    started from; the run's model/ is what is evaluated, never the base model silently."""
    run, base = tmp_path / "run", tmp_path / "base"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(f"model_name_or_path: {base}\noutput_dir: {run}\n")
    flags = ["--config", str(run / "config.yaml"), "--do_train", "false", "--output_dir", str(tmp_path / "eval")]
    with pytest.raises(UsageError, match=re.escape(f"is the config of the run {run}, which has no model/ yet")):
        parse_config(flags)
    (run / "model").mkdir()
    assert parse_config(flags).model_name_or_path == str(run / "model")
    assert parse_config([*flags, "--model_name_or_path", str(base)]).model_name_or_path == str(base)  # as asked


@pytest.mark.slow
def test_eval_only_in_the_default_folder_takes_the_runs_options(tmp_path):
    """`python train.py --do_train false` (the README's) after a run with its own task options, both in the default
    folder runs/digits: the run's config.yaml gives the model's options there too, as where the folder is named."""
    data = f"{{train: {DIGITS}/train.parquet, eval: {DIGITS}/eval.parquet}}"
    assert_ok(run_main(*QUICK, "--model", "linear", "--norm", "none", "--data_files", data, cwd=tmp_path))
    trained = eval_results(tmp_path / "runs" / "digits")
    assert_ok(run_main("--do_train", "false", cwd=tmp_path))
    assert eval_results(tmp_path / "runs" / "digits") == pytest.approx(trained, rel=1e-6)
