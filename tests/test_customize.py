"""docs/customize.md's swaps, performed: a table with the tabular task, a metric written from the guide's code."""

import re

import numpy as np
import pandas as pd

from tests.conftest import REPO, assert_ok, read_metrics, run_train

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


def test_guide_shows_the_tabular_command():
    assert "python train.py --task tabular --data_files" in GUIDE


def test_tabular_csv_with_an_mlp_and_a_metric_from_the_guide(tmp_path):
    files = digits_as_csv(tmp_path)
    metric_code = re.search(r"```python\n(.*?)```", GUIDE, flags=re.DOTALL).group(1)
    metric_dir = tmp_path / "f1_macro"
    metric_dir.mkdir()
    (metric_dir / "f1_macro.py").write_text(metric_code)
    out = tmp_path / "run"
    result = run_train(
        "--task", "tabular", "--data_files", f"{{train: {files['train']}, eval: {files['eval']}}}",
        "--label_column", "digit", "--hidden_size", "64", "--max_steps", "120",
        "--metrics", f"[accuracy, {metric_dir}]", "--output_dir", str(out),
    )  # fmt: skip
    assert_ok(result)
    final = read_metrics(out)[-1]
    assert final["eval/accuracy"] > 0.9 and final["eval/num_samples"] == 359
    assert 0.85 < final["eval/f1_macro"] <= 1.0


def test_tabular_with_named_features_and_a_bad_task_arg(tmp_path):
    files = digits_as_csv(tmp_path)
    data = ["--data_files", f"{{train: {files['train']}, eval: {files['eval']}}}", "--label_column", "digit"]
    out = tmp_path / "run"
    named = run_train("--task", "tabular", *data, "--features", "[p20, p28, p36, p44]",
                      "--max_steps", "10", "--output_dir", str(out))  # fmt: skip
    assert_ok(named)
    assert read_metrics(out)[0]["setup/parameters"] == 4 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    bad = run_train("--task", "tabular", *data, "--hidden", "8", "--output_dir", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "did you mean --hidden_size?" in bad.stderr.splitlines()[-1]
