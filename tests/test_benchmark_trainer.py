"""scripts/benchmark_trainer.py runs both sides for the same steps and reports what it measured (speed is measured by
the script, not asserted here): the template's side through train.main, Trainer's without any of the template."""

import json
import os
import statistics

import pytest

from tests.conftest import command_env


@pytest.mark.slow
def test_benchmark_trainer_writes_its_report(tmp_path, hf_assets, monkeypatch, capsys):
    """The script's main in this process (its parent's part: the model, the rounds, the report), in the environment
    a command gets (tests/conftest.py: command_env); each side's run is the script's own child process, as always."""
    from scripts import benchmark_trainer

    env = command_env()
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    output = tmp_path / "t.json"
    benchmark_trainer.main(["--rounds", "1", "--steps", "8", "--batch", "4", "--data_root", hf_assets["root"],
                            "--output", str(output)])  # fmt: skip
    stdout = capsys.readouterr().out
    report = json.loads(output.read_text())
    assert report["settings"] == {"rounds": 1, "steps": 8, "batch": 4}
    runs = report["runs"]
    for side in ("template", "trainer"):
        assert [run["steps"] for run in runs[side]] == [8]  # every optimiser step trained and timed
        assert all(run["samples_per_s"] > 0 for run in runs[side])
    assert all("src.features.hf.text_classification" in run["src_modules"] for run in runs["template"])
    assert all(run["src_modules"] == [] and "transformers" in run["imports"] for run in runs["trainer"])
    ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs["template"], runs["trainer"], strict=True)]
    assert report["round_ratios"] == ratios and report["template/trainer"] == statistics.median(ratios)
    assert f"template/trainer samples/s: median {statistics.median(ratios):.3f}" in stdout
