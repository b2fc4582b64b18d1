"""Project hygiene: lint is clean, the README config reference matches the dataclass, Makefile commands exist."""

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, assert_ok, run_command, run_python


def test_no_undefined_name_or_syntax_error():
    """What ruff finds wrong without running the code (flake8's build-stopping set: syntax errors, undefined names,
    `is` with a literal, `return` outside a function), e.g. a typo in an error path no test reaches. Style is not a
    test's business: a forker's edit to train.py in another style passes the suite; `make lint` (CI's last step and
    the pre-commit hook) checks it."""
    result = run_python("-m", "ruff", "check", "--select", "E9,F63,F7,F82", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_readme_config_reference_is_up_to_date():
    assert_ok(run_python("scripts/config_reference.py", "--check"))


def make(*args: str) -> subprocess.CompletedProcess:
    """`make` in the repo with this interpreter as $(PY) (the Makefile's default is .venv/bin/python)."""
    return run_command(["make", "--no-print-directory", f"PY={sys.executable}", *args])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_targets_run_real_commands():
    """Every target's recipe (`make -n`, which prints without running) calls an interpreter, module or script that
    exists; `make lint` really runs ruff (whether the code is clean is CI's last step: .ci/run)."""
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


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_lint_that_fails_names_make_format(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path)
    (tmp_path / "messy.py").write_text("x = [1,2]\n")  # lint passes, the format check does not
    lint = run_command(["make", "--no-print-directory", f"PY={sys.executable}", "lint"], cwd=tmp_path)
    assert lint.returncode != 0 and lint.stderr.startswith("make format fixes most of it\n"), lint.stderr
