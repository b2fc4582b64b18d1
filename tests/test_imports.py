"""A run imports what it uses and nothing else (src/imports.py, the light start measured in docs/benchmark.md)."""

import importlib
import importlib.util
import json
import sys

import numpy as np
import pandas as pd
import pytest

from src.imports import hidden
from tests.conftest import QUICK, assert_ok, run_python
from tests.helpers import has_feature


def test_hidden_makes_a_package_look_uninstalled_for_the_moment(tmp_path, monkeypatch):
    (tmp_path / "probed_package").mkdir()
    (tmp_path / "probed_package" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with hidden("probed_package"):
        assert importlib.util.find_spec("probed_package") is None  # what an availability probe asks
        with pytest.raises(ImportError):
            importlib.import_module("probed_package")
    assert "probed_package" not in sys.modules and importlib.util.find_spec("probed_package") is not None
    module = importlib.import_module("probed_package")
    with hidden("probed_package"):  # imported already: left as it is
        assert importlib.import_module("probed_package") is module
    del sys.modules["probed_package"]


NOT_USED = ["datasets", "evaluate", "pandas", "pyarrow.dataset", "transformers", "wandb"]
# Accelerate's unwrap_model imports deepspeed wherever it is installed (and deepspeed mlflow): fast_accelerator hides it
NOT_USED += ["deepspeed", "mlflow"] if has_feature("fast_accelerator") else []
PROBE = """
import json, sys
from train import main
for args in {runs!r}:  # one fresh process for all: a module is only ever added, so none of them imported any
    main(args)
print(json.dumps(sorted(name for name in {names!r} if name in sys.modules)))
"""


@pytest.mark.slow
def test_a_default_run_imports_only_what_it_uses(tmp_path):
    """The digits example in a fresh process, with its final eval, checkpoint and model save, then predictions from
    that model (ids read from Parquet) and, with the tabular feature, a tabular run: none of the libraries they don't
    use, though all are installed here (deepspeed, where the deepspeed feature's requirements are: Accelerate's unwrap
    would import it, mlflow with it)."""
    for name in ("datasets", "evaluate"):  # the core's requirements
        assert importlib.util.find_spec(name) is not None, f"{name} is not installed: the check would prove nothing"
    run, table = tmp_path / "run", tmp_path / "table.parquet"
    rng = np.random.default_rng(0)
    frame = {"a": rng.normal(size=64), "b": rng.normal(size=64), "label": rng.integers(0, 2, 64)}
    pd.DataFrame(frame).to_parquet(table)
    runs = [
        [*QUICK, "--output_dir", str(run)],
        ["--model_name_or_path", str(run), "--do_train", "false", "--do_predict", "true",
         "--output_dir", str(tmp_path / "predicted")],
    ]  # fmt: skip
    tabular = [*QUICK, "--task", "tabular", "--data_files", f"{{train: {table}, eval: {table}}}", "--output_dir",
               str(tmp_path / "tabular")]  # fmt: skip
    runs += [tabular] if has_feature("tabular") else []
    result = run_python("-c", PROBE.format(runs=runs, names=NOT_USED))
    assert_ok(result)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
    assert (run / "model" / "model.safetensors").is_file() and (tmp_path / "predicted" / "predictions.jsonl").is_file()
    assert (tmp_path / "tabular" / "model" / "model.safetensors").is_file() or not has_feature("tabular")
