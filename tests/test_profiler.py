"""The profiler feature (src/features/profiler/): --profile_steps writes a torch.profiler trace of training steps."""

import json

import pytest

from tests.conftest import assert_ok, run_main


@pytest.mark.slow
def test_profile_steps_writes_a_trace_of_training_steps(tmp_path):
    out = tmp_path / "run"
    result = run_main("--config", "configs/default.yaml", "--config", "configs/debug/smoke.yaml",
                      "--output_dir", str(out), "--profile_steps", "2")  # fmt: skip
    assert_ok(result)
    trace = json.loads((out / "profile" / "trace_rank0.json").read_text())
    assert any("aten::" in event.get("name", "") for event in trace["traceEvents"])


def test_a_negative_profile_steps_is_one_line():
    from src.cli import parse_config
    from src.errors import UsageError

    with pytest.raises(UsageError, match="--profile_steps must be >= 0"):
        parse_config(["--profile_steps", "-1"])
