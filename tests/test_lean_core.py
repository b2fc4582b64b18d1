"""The core without any feature (every one of features.yaml removed at once): its own fast tier passes, so no core
test needs a feature. Its own file, so that pytest-xdist runs it beside tests/test_features.py's removals."""

import subprocess
import sys

import pytest

from tests.conftest import REPO, command_env


@pytest.mark.slow
def test_the_core_alone_passes_its_fast_tests():
    """Every feature removed at once: the lean core's own fast tier passes (no core test needs a feature)."""
    result = subprocess.run(
        [sys.executable, "scripts/remove_feature.py", "--check", "--all", "--tests", "fast"],
        cwd=REPO, env=command_env(), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
