"""The benchmark script runs both sides for the same steps and reports what it measured (speed is measured by the
script, not asserted here)."""

import json
import statistics

import pytest

from tests.conftest import assert_ok, run_python


@pytest.mark.slow
def test_benchmark_writes_its_report(tmp_path):
    output = tmp_path / "b.json"
    result = run_python("scripts/benchmark.py", "--model", "linear", "--rounds", "2", "--steps", "40",
                        "--output", str(output))  # fmt: skip
    assert_ok(result)
    report = json.loads(output.read_text())
    assert report["settings"] == {"model": "linear", "rounds": 2, "steps": 40, "batch": 64, "processes": 1,
                                  "device": "cpu", "threads": 1}  # fmt: skip
    raw, template = report["raw"]["runs"], report["template"]["runs"]
    assert len(raw) == len(template) == 2
    for run in raw + template:
        assert run["steps"] == 40  # both sides trained (and timed) every one of the --steps optimiser steps
        assert run["samples_per_s"] > 0 and run["seconds_to_first_step"] > 0 and run["peak_memory_gb"] > 0
    round_ratios = [b["samples_per_s"] / a["samples_per_s"] for a, b in zip(raw, template, strict=True)]
    assert report["round_ratios"] == round_ratios
    assert report["ratio"] == statistics.median(round_ratios)
    for side, runs in (("raw", raw), ("template", template)):
        speeds = [run["samples_per_s"] for run in runs]
        assert report[side]["samples_per_s"] == {"median": statistics.median(speeds), "min": min(speeds),
                                                 "max": max(speeds)}  # fmt: skip
        assert report[side]["peak_memory_gb"] == max(run["peak_memory_gb"] for run in runs)
    assert f"ratio template/raw: {report['ratio']:.3f}" in result.stdout
