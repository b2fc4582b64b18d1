"""The benchmark script runs every side for the same steps under each condition and reports what it measured (speed
is measured by the script, not asserted here); its hand-written sides stand alone and train the template's recipe."""

import json
import statistics

import pytest

from scripts import benchmark
from scripts.benchmark import RATIOS, SIDES, warmup_cosine
from src.config import TrainConfig
from src.optim import lr_factor
from tests.conftest import assert_ok, run_python
from tests.helpers import assert_bash_blocks_run


def test_the_hand_written_schedule_is_the_templates():
    for total, warmup in ((40, 20), (3000, 20), (600, 0)):
        assert [warmup_cosine(s, total, warmup) for s in range(total + 2)] == [
            lr_factor(s, total, warmup, "cosine") for s in range(total + 2)
        ]


def test_rounds_interleave_the_sides_and_are_summarized_by_their_median(tmp_path, monkeypatch, capsys):
    """3 rounds (no training: each side's run is a made-up result): every side runs once a round, in the round's
    order, and the report holds each side's median, min and max over the rounds and the median of the rounds'
    ratios (not their mean, nor the ratio of the medians)."""
    speeds = {"raw": [100, 300, 200], "raw_index": [110, 90, 400], "accelerate": [50, 70, 60], "template": [90, 10, 95]}
    order = []

    def fake_run(args, side, condition):
        order.append((condition, side))
        i = sum(1 for _, s in order if s == side) - 1
        return {"samples_per_s": speeds[side][i], "seconds_to_first_step": 1.0 + i, "wall_s": 2.0 + speeds[side][i],
                "peak_memory_gb": 0.1 * (i + 1), "imports": [side], "src_modules": [], "steps": 40}  # fmt: skip

    monkeypatch.setattr(benchmark, "run_side", fake_run)
    report = benchmark.main(["--rounds", "3", "--conditions", "tuned", "--output", str(tmp_path / "b.json")])
    assert order == [("tuned", side) for _ in range(3) for side in SIDES]
    measured = report["conditions"]["tuned"]
    assert measured["template"]["samples_per_s"] == {"median": 90, "min": 10, "max": 95}
    assert measured["raw_index"]["peak_memory_gb"] == pytest.approx(0.3)
    assert measured["round_ratios"]["template/raw"] == [90 / 100, 10 / 300, 95 / 200]
    assert measured["ratios"]["template/raw"] == 95 / 200  # the middle round's, not the mean's 0.47
    assert json.loads((tmp_path / "b.json").read_text())["conditions"]["tuned"]["ratios"] == measured["ratios"]
    assert f"tuned: template/raw {95 / 200:.3f}" in capsys.readouterr().out


@pytest.mark.slow
def test_benchmark_writes_its_report(tmp_path):
    """One condition of the two (each is the same code with other settings), 1 round of the 4 sides (several rounds
    and their medians: the test above)."""
    output = tmp_path / "b.json"
    result = run_python("scripts/benchmark.py", "--model", "linear", "--rounds", "1", "--steps", "40",
                        "--conditions", "tuned", "--output", str(output))  # fmt: skip
    assert_ok(result)
    report = json.loads(output.read_text())
    assert report["settings"] == {"model": "linear", "rounds": 1, "steps": 40, "batch": 64, "processes": 1,
                                  "device": "cpu", "conditions": ["tuned"],
                                  "max_grad_norm": 1.0}  # fmt: skip
    defaults = TrainConfig()
    assert (report["recipe"]["learning_rate"], report["recipe"]["warmup_steps"]) == (defaults.learning_rate,
                                                                                     defaults.warmup_steps)  # fmt: skip
    assert list(report["conditions"]) == ["tuned"]
    for condition, measured in report["conditions"].items():
        runs = {side: measured[side]["runs"] for side in SIDES}
        for side_runs in runs.values():
            assert len(side_runs) == 1
            for run in side_runs:
                assert run["steps"] == 40  # every side trained (and timed) every one of the --steps optimiser steps
                assert run["samples_per_s"] > 0 and run["peak_memory_gb"] > 0
                assert 0 < run["seconds_to_first_step"] < run["wall_s"]
        for side in ("raw", "raw_index", "accelerate"):  # standalone: nothing of the template, nor its libraries
            for run in runs[side]:
                assert not {"datasets", "evaluate", "jsonargparse", "train"} & set(run["imports"]), side
                assert ("accelerate" in run["imports"]) == (side == "accelerate")
                assert run["src_modules"] == [], side  # the linear model is built inline; the CNN's file is plain torch
        assert {"accelerate", "jsonargparse", "src", "train"} <= set(runs["template"][0]["imports"])
        for name, (top, bottom, key) in RATIOS.items():
            round_ratios = [a[key] / b[key] for a, b in zip(runs[top], runs[bottom], strict=True)]
            assert measured["round_ratios"][name] == round_ratios
            assert measured["ratios"][name] == statistics.median(round_ratios)
        for side, side_runs in runs.items():
            speeds = [run["samples_per_s"] for run in side_runs]
            assert measured[side]["samples_per_s"] == {"median": statistics.median(speeds), "min": min(speeds),
                                                       "max": max(speeds)}  # fmt: skip
            assert measured[side]["peak_memory_gb"] == max(run["peak_memory_gb"] for run in side_runs)
        assert f"{condition}: template/raw {measured['ratios']['template/raw']:.3f}" in result.stdout


def test_every_command_of_the_page_is_run():
    assert_bash_blocks_run("docs/benchmark.md")
