"""Project hygiene: lint is clean, the README config reference matches the dataclass, Makefile commands exist."""

import re
import shutil

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


def test_new_project_renames_a_copy_of_the_template(tmp_path):
    copy = tmp_path / "mine"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "data", ".whl", "__pycache__"))
    assert_ok(run_python("scripts/new_project.py", "my-project", cwd=copy))
    assert 'name = "my-project"' in (copy / "pyproject.toml").read_text()
    assert 'project_name: str = "my-project"' in (copy / "src/config.py").read_text()
    assert (copy / "README.md").read_text().startswith("# my-project")
    again = run_python("scripts/new_project.py", "other", cwd=copy)  # nothing left to rename
    assert again.returncode == 2 and again.stderr.startswith("error: ")
    assert run_python("scripts/new_project.py", "no spaces", cwd=copy).returncode == 2
