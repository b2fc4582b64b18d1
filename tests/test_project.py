"""Project hygiene: lint is clean, the README config reference matches the dataclass, Makefile commands exist."""

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, assert_ok, run_command, run_python
from tests.helpers import copy_of_the_repo


def test_ruff_lint_and_format_are_clean():
    assert_ok(run_python("-m", "ruff", "check", "."))
    assert_ok(run_python("-m", "ruff", "format", "--check", "."))


def test_readme_config_reference_is_up_to_date():
    assert_ok(run_python("scripts/config_reference.py", "--check"))


def make(*args: str) -> subprocess.CompletedProcess:
    """`make` in the repo with this interpreter as $(PY) (the Makefile's default is .venv/bin/python)."""
    return run_command(["make", "--no-print-directory", f"PY={sys.executable}", *args])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_targets_run_real_commands():
    """Every target's recipe (`make -n`, which prints without running) calls an interpreter, module or script that
    exists; `make lint` really runs ruff (whether the code is clean is test_ruff_lint_and_format_are_clean's job)."""
    makefile = (REPO / "Makefile").read_text()
    targets = re.findall(r"^([a-z][\w-]*):", makefile, flags=re.MULTILINE)
    phony = re.search(r"^\.PHONY:(.*)$", makefile, flags=re.MULTILINE).group(1).split()
    assert targets and set(targets) <= set(phony)  # none is mistaken for a file of that name
    for target in targets:
        dry_run = make("-n", target)
        assert_ok(dry_run)
        commands = [part for line in dry_run.stdout.splitlines() for part in line.split("&&")]
        assert commands, f"make {target} runs nothing"
        for command in commands:
            words = shlex.split(command)
            if words[0] == "bash":
                assert (REPO / words[1]).is_file(), command
            elif words[1] == "-m":
                assert words[0] == sys.executable and importlib.util.find_spec(words[2]) is not None, command
            else:
                assert words[0] == sys.executable and (REPO / words[1]).is_file(), command
    lint = make("lint")
    ruff_summary = re.search(r"^(All checks passed!|Found \d+ errors?)", lint.stdout, flags=re.MULTILINE)
    assert ruff_summary, lint.stdout + lint.stderr


def test_new_project_renames_a_copy_of_the_template(tmp_path):
    from scripts.new_project import current_name

    copy = copy_of_the_repo(tmp_path / "mine")
    old = current_name(copy)
    new = f"{old}-fork"  # derived from the current name: this test passes in a renamed project too
    assert_ok(run_python("scripts/new_project.py", new, cwd=copy))
    assert f'name = "{new}"' in (copy / "pyproject.toml").read_text()
    assert f'project_name: str = "{new}"' in (copy / "src/config.py").read_text()
    assert (copy / "README.md").read_text().startswith(f"# {new}")
    assert f"# {old}\n" not in (copy / "README.md").read_text()
    assert_ok(run_python("scripts/new_project.py", "other", cwd=copy))  # a renamed project renames again
    assert current_name(copy) == "other"
    assert run_python("scripts/new_project.py", "other", cwd=copy).returncode == 2  # already its name
    assert run_python("scripts/new_project.py", "no spaces", cwd=copy).returncode == 2


@pytest.mark.slow
def test_a_renamed_project_passes_its_own_fast_tests(tmp_path):
    """The fork's own suite: rename a copy, then run the fast tests of what the rename touches (the config and its
    reference, the README and docs, lint, the tracker's project name, the module map)."""
    copy = copy_of_the_repo(tmp_path / "mine")
    assert_ok(run_python("scripts/new_project.py", "my-project", cwd=copy))
    touched = [f"tests/test_{name}.py" for name in ("config", "docs", "project", "tracking", "layout")]
    pytest_args = ["-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", *touched]
    result = run_python(*pytest_args, cwd=copy, timeout=900)
    assert_ok(result)
    assert " passed" in result.stdout and "failed" not in result.stdout
