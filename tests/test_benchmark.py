"""The benchmark script runs both sides and writes its JSON (speed is measured by the script, not asserted here)."""

import json
import statistics

from tests.conftest import assert_ok, run_python


def test_benchmark_writes_its_report(tmp_path):
    output = tmp_path / "b.json"
    result = run_python("scripts/benchmark.py", "--model", "linear", "--rounds", "2", "--steps", "40",
                        "--output", str(output))  # fmt: skip
    assert_ok(result)
    report = json.loads(output.read_text())
    assert len(report["round_ratios"]) == 2 and report["ratio"] == statistics.median(report["round_ratios"])
    assert min(report["round_ratios"]) > 0
    for side in ("raw", "template"):
        assert report[side]["samples_per_s"]["median"] > 0
        assert 0 < report[side]["seconds_to_first_step"]["median"] < 120
        assert report[side]["peak_memory_gb"] > 0
    assert report["settings"] == {"model": "linear", "rounds": 2, "steps": 40, "batch": 64, "processes": 1,
                                  "device": "cpu", "threads": 1}  # fmt: skip
    assert "ratio template/raw" in result.stdout
