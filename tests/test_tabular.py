"""The tabular feature (src/features/tabular/): `--task tabular`, a table's rows classified by an MLP, and
docs/customize.md's commands for it."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from scripts.readme_commands import section_commands
from src.cli import parse_config, resolve
from src.config import TrainConfig, save_config
from src.errors import UsageError
from src.features.tabular.tabular import Tabular
from src.tasks import build_task, task_class
from tests.conftest import QUICK, REPO, assert_ok, last_row, read_metrics, run_command, run_main
from tests.helpers import as_written, docs_code_block, workspace

GUIDE = (REPO / "docs" / "customize.md").read_text()


def digits_as_csv(tmp_path) -> dict[str, str]:
    """The digits as a plain table: 64 numeric columns p0..p63 and a `digit` label column."""
    files = {}
    for split in ("train", "eval"):
        frame = pd.read_parquet(REPO / f"data/digits/{split}.parquet")
        table = pd.DataFrame(np.stack(frame["pixels"].to_numpy()), columns=[f"p{i}" for i in range(64)])
        table["digit"] = frame["label"]
        files[split] = str(tmp_path / f"{split}.csv")
        table.to_csv(files[split], index=False)
    return files


def test_the_task_is_found_by_name_and_module():
    assert task_class("tabular") is Tabular
    assert task_class("src.features.tabular.tabular") is Tabular
    with pytest.raises(UsageError, match="did you mean tabular\\? use"):
        task_class("tabluar")


def test_its_options_are_flags_yaml_keys_and_saved_flat(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task: tabular\nnum_layers: 3\n")
    config = parse_config(["--config", str(path), "--hidden_size", "16", "--data_files", "{train: a.csv, eval: b.csv}"])
    assert config.task_args["num_layers"] == 3 and config.task_args["hidden_size"] == 16
    assert config.output_dir == "runs/tabular"
    save_config(config, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["num_layers"] == 3 and "task_args" not in saved and "norm" not in saved
    assert parse_config(["--config", str(tmp_path / "config.yaml")]) == config


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--task", "tabular", "--norm", "batch"], "--norm is an option of --task digits, not of --task tabular"),
        (["--task", "tabular", "--num_layer", "2"], "did you mean --num_layers?"),
        (["--task", "tabular", "--data_files", "{train: a.csv}", "--hidden_size", "0"], "--hidden_size must be > 0"),
        (["--task", "tabular", "--data_files", "{train: a.csv}", "--num_labels", "0"], "--num_labels must be > 0"),
    ],
)
def test_bad_options_are_one_line_usage_errors(argv, message):
    with pytest.raises(UsageError, match=message) as info:
        parse_config(argv)
    assert "\n" not in str(info.value)


def test_python_callers_get_the_same_checks():
    with pytest.raises(UsageError, match="did you mean num_layers"):
        resolve(TrainConfig(task="tabular", task_args={"num_layer": 2}))


def test_help_lists_its_options(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--task", "tabular", "--help"])
    shown = capsys.readouterr().out
    assert "options of --task tabular" in shown and "--num_layers" in shown and "hidden layers" in shown
    assert "--norm" not in shown


def test_csv_with_other_column_names(tmp_path):
    """Named feature columns (in another order than the file's), another label column, a text column that is not a
    feature. The CSV gives the same tensors as the same table in Parquet, and the model standardises them with the
    train split's statistics (its buffers: saved with it)."""
    table = pd.DataFrame({
        "length": [1.0, 2.5, 4.0, 5.5, 7.0, 8.5],
        "note": ["a", "b", "c", "d", "e", "f"],
        "width": [0.5, 0.25, 1.0, 2.0, 4.0, 8.0],
        "species": [0, 1, 2, 0, 1, 2],
    })  # fmt: skip
    options = {"label_column": "species", "features": ["width", "length"]}
    loaded = {}
    for fmt in ("csv", "parquet"):
        files = {split: str(tmp_path / f"{split}.{fmt}") for split in ("train", "eval")}
        for path in files.values():
            table.to_csv(path, index=False) if fmt == "csv" else table.to_parquet(path)
        config = resolve(TrainConfig(task="tabular", data_files=files, task_args=options))
        loaded[fmt] = [dataset.tensors for dataset in build_task(config).build_datasets()]
    (train_x, train_y), (eval_x, eval_y) = loaded["csv"]
    raw = torch.tensor(table[["width", "length"]].to_numpy().copy(), dtype=torch.float32)
    torch.testing.assert_close(eval_x, raw, rtol=0, atol=0)
    task = build_task(config)
    task.build_datasets()
    standardize = task.build_model()[0]
    torch.testing.assert_close(standardize(raw), (raw - raw.mean(dim=0)) / raw.std(dim=0), rtol=0, atol=1e-6)
    assert eval_y.tolist() == train_y.tolist() == [0, 1, 2, 0, 1, 2]
    for (csv_x, csv_y), (parquet_x, parquet_y) in zip(loaded["csv"], loaded["parquet"], strict=True):
        assert torch.equal(csv_x, parquet_x) and torch.equal(csv_y, parquet_y)


def test_the_guide_shows_the_tabular_command():
    assert "python train.py --task tabular --data_files" in GUIDE and "--hidden_size 64" in GUIDE


@pytest.mark.slow
def test_the_guides_command_on_a_table_with_its_columns(tmp_path):
    """docs/customize.md's `tabular` command on a table with the columns it names (integer species labels)."""
    (command,) = section_commands("Your data, by config", page="docs/customize.md")
    cwd = workspace(tmp_path)
    (cwd / "my").mkdir()
    generator = torch.Generator().manual_seed(0)
    for split, rows in (("train", 120), ("eval", 31)):
        species = torch.randint(0, 3, (rows,), generator=generator)
        table = {
            "sepal_length": (species + torch.rand(rows, generator=generator)).tolist(),
            "sepal_width": torch.rand(rows, generator=generator).tolist(),
            "species": species.tolist(),
        }
        pd.DataFrame(table).to_csv(cwd / "my" / f"{split}.csv", index=False)
    assert_ok(run_command([*as_written(command), *QUICK, "--per_device_train_batch_size", "8",
                           "--global_batch_size", "8", "--output_dir", "run"], cwd=cwd))  # fmt: skip
    assert last_row(read_metrics(cwd / "run"))["eval/num_samples"] == 31


@pytest.mark.slow
def test_digits_as_a_csv_with_an_mlp_and_the_guides_metric(tmp_path):
    files = digits_as_csv(tmp_path)
    metric_dir = tmp_path / "f1_macro"
    metric_dir.mkdir()
    (metric_dir / "f1_macro.py").write_text(
        docs_code_block("docs/customize.md", "# src/evaluate_metrics/f1_macro/f1_macro.py")
    )
    out = tmp_path / "run"
    result = run_main(
        "--task", "tabular", "--data_files", f"{{train: {files['train']}, eval: {files['eval']}}}",
        "--label_column", "digit", "--hidden_size", "64", "--max_steps", "120",
        "--metrics", f"[accuracy, {metric_dir}]", "--output_dir", str(out),
    )  # fmt: skip
    assert_ok(result)
    final = last_row(read_metrics(out))
    assert final["eval/accuracy"] > 0.9 and final["eval/num_samples"] == 359
    assert 0.85 < final["eval/f1_macro"] <= 1.0


@pytest.mark.slow
def test_named_features_and_a_bad_task_arg(tmp_path):
    files = digits_as_csv(tmp_path)
    data = ["--data_files", f"{{train: {files['train']}, eval: {files['eval']}}}", "--label_column", "digit"]
    out = tmp_path / "run"
    named = run_main("--task", "tabular", *data, "--features", "[p20, p28, p36, p44]",
                     "--max_steps", "10", "--output_dir", str(out))  # fmt: skip
    assert_ok(named)
    assert read_metrics(out)[0]["setup/parameters"] == 4 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    bad = run_main("--task", "tabular", *data, "--hidden", "8", "--output_dir", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "did you mean --hidden_size?" in bad.stderr.splitlines()[-1]


@pytest.mark.slow
def test_its_model_evaluates_alone_as_at_the_end_of_training(tmp_path):
    """The saved model carries its standardisation: evaluated alone, it gives the final eval's loss."""
    table = tmp_path / "table.csv"
    frame = pd.DataFrame({"a": [i % 7 * 1.5 for i in range(96)], "b": [i % 5 * 3.0 for i in range(96)]})
    frame["label"] = ((frame["a"] + frame["b"]) > 9).astype(int)
    frame.to_csv(table, index=False)
    args = ["--task", "tabular", "--data_files", f"{{train: {table}, eval: {table}}}", "--num_labels", "2"]
    out = tmp_path / "run"
    assert_ok(run_main(*args, "--max_steps", "6", "--output_dir", str(out)))
    final = [row for row in read_metrics(out) if "eval/loss" in row][-1]
    assert_ok(run_main(*args, "--do_train", "false", "--output_dir", str(out)))
    evaluated = json.loads((out / "eval_results.json").read_text())
    assert evaluated["eval/loss"] == pytest.approx(final["eval/loss"], rel=1e-6)


def test_without_named_features_the_id_column_is_not_one(tmp_path):
    """Every column but the label and the id (`--id_column`, copied into predictions.jsonl) is a feature."""
    table = pd.DataFrame({"id": ["r0", "r1", "r2", "r3"], "x": [1.0, 2.0, 3.0, 4.0], "label": [0, 1, 0, 1]})
    files = {split: str(tmp_path / f"{split}.csv") for split in ("train", "eval")}
    for path in files.values():
        table.to_csv(path, index=False)
    task = build_task(resolve(TrainConfig(task="tabular", data_files=files)))
    (train_x, _), _ = [dataset.tensors for dataset in task.build_datasets()]
    assert task.features == ["x"] and train_x.tolist() == [[1.0], [2.0], [3.0], [4.0]]


def test_a_test_split_leaves_the_train_statistics_and_classes_in_the_model(tmp_path):
    """Training with a test split to predict (no labels): the saved model standardises with the train split's mean
    and std (building a test split once reset them to 0 and 1), with the train split's classes."""
    from safetensors.torch import load_file

    rows = np.random.default_rng(0).normal(loc=3.0, scale=2.0, size=(300, 4))
    table = pd.DataFrame(rows, columns=["a", "b", "c", "d"]).assign(label=(rows[:, 0] > 3).astype(int))
    table.insert(0, "id", [f"r{i}" for i in range(len(table))])
    files = {"train": tmp_path / "train.csv", "eval": tmp_path / "eval.csv", "test": tmp_path / "test.csv"}
    table[:200].to_csv(files["train"], index=False)
    table[200:250].to_csv(files["eval"], index=False)
    table[250:].drop(columns=["label"]).to_csv(files["test"], index=False)
    data = "{" + ", ".join(f"{split}: {path}" for split, path in files.items()) + "}"
    out = tmp_path / "run"
    assert_ok(run_main("--task", "tabular", "--data_files", data, "--max_steps", "10", "--do_predict", "true",
                       "--output_dir", str(out)))  # fmt: skip
    weights = load_file(out / "model" / "model.safetensors")
    train = torch.tensor(table[:200][["a", "b", "c", "d"]].to_numpy(), dtype=torch.float32)
    torch.testing.assert_close(weights["0.mean"], train.mean(dim=0))
    torch.testing.assert_close(weights["0.std"], train.std(dim=0))
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == [f"r{i}" for i in range(250, 300)] and len(rows[0]["probabilities"]) == 2


def test_standardised_inputs_keep_their_dtype():
    """FSDP2's bf16 (fsdp.yaml) casts the inputs and weights, not the buffers: the standardised features stay bf16
    for the next layer (they became float32: a dtype error in its matmul)."""
    from src.features.tabular.tabular import Standardize

    standardize = Standardize(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0]))
    x = torch.tensor([[3.0, 6.0]], dtype=torch.bfloat16)
    assert standardize(x).dtype == torch.bfloat16 and standardize(x).tolist() == [[1.0, 1.0]]
    assert standardize(x.float()).dtype == torch.float32
