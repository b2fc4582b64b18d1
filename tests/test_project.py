"""Project hygiene: lint is clean, the README config reference matches the dataclass, Makefile commands exist."""

import re

from tests.conftest import REPO, assert_ok, run_python


def test_ruff_lint_and_format_are_clean():
    assert_ok(run_python("-m", "ruff", "check", "."))
    assert_ok(run_python("-m", "ruff", "format", "--check", "."))


def test_readme_config_reference_is_up_to_date():
    assert_ok(run_python("scripts/config_reference.py", "--check"))


def test_makefile_targets_run_real_commands():
    makefile = (REPO / "Makefile").read_text()
    for script in re.findall(r"(scripts/\S+\.(?:py|sh))", makefile):
        assert (REPO / script).exists(), script
    assert "$(PY) -m pytest" in makefile and "bash scripts/setup.sh" in makefile
