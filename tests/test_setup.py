"""scripts/setup.sh: what each Quickstart command installs, and the installed torch pinned for later installs
(docs/install.md's commands run in a venv it made, against a local index that holds another torch)."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from scripts.readme_commands import section_commands
from tests.conftest import REPO, requirements_not_as_pinned

TORCH = version("torch")


def wheel(folder: Path, name: str, release: str, *requires: str) -> None:
    """A minimal wheel: metadata only, which is all a dry run reads."""
    stem = f"{name.replace('-', '_')}-{release}"
    info = f"{stem}.dist-info"
    metadata = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {release}\n",
                        *(f"Requires-Dist: {r}\n" for r in requires)])  # fmt: skip
    folder.mkdir(exist_ok=True)
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")


def run(command: list, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PIP_NO_INDEX": "1", **env}  # nothing from the network: only what the test provides
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv made by `scripts/setup.sh --dev` that sees this interpreter's packages (a .pth file) and programs: its
    installs are all satisfied already, so the script runs offline, and writes the venv's pin."""
    venv = tmp_path_factory.mktemp("setup") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([venv / "bin/python", "-c", purelib], text=True).strip())
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "outer.pth").write_text("\n".join(paths) + "\n")
    if (
        Path(sys.prefix) / "tools"
    ).is_dir():  # and its programs (requirements/tools/), installed where the script looks
        (venv / "tools").symlink_to(Path(sys.prefix) / "tools")
    result = run(["bash", "scripts/setup.sh", "--dev"], VENV=str(venv))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ready: {venv} (torch {TORCH}" in result.stdout
    return venv


@pytest.mark.slow
def test_setup_pins_the_installed_torch_in_the_venvs_pip_config(venv):
    assert (venv / "constraints.txt").read_text() == f"torch=={TORCH}\n"
    config = run([venv / "bin/python", "-m", "pip", "config", "list"]).stdout
    assert f"install.constraint='{venv.resolve() / 'constraints.txt'}'" in config.splitlines()


BASE = TORCH.split("+")[0]  # what torchvision's releases require: 2.13.0+cpu satisfies torch==2.13.0
OTHER = "2.0.0"  # another torch: older, so that no cap on newer ones (a machine's pip constraint) can hide a swap


@pytest.fixture
def index(tmp_path) -> Path:
    """A local index as PyPI and PyTorch's CPU index look: torchvision releases, each requiring one torch release,
    the newest one another torch than the installed one."""
    assert OTHER != BASE
    for name, release, *requires in [
        ("torch", OTHER),
        ("torchvision", "0.1", f"torch=={BASE}"),
        ("torchvision", "0.2", f"torch=={OTHER}"),
        ("timm", "1.0", "torch", "torchvision"),
        ("needs-other-torch", "1.0", f"torch=={OTHER}"),
    ]:
        wheel(tmp_path / "pypi", name, release, *requires)
    wheel(tmp_path / "cpu", "torchvision", "0.1+cpu", f"torch=={BASE}")
    wheel(tmp_path / "cpu", "torchvision", "0.2+cpu", f"torch=={OTHER}")
    wheel(tmp_path / "cpu", "torch", f"{OTHER}+cpu")
    return tmp_path


def dry_run(venv: Path, command: str, index: Path) -> dict[str, str]:
    """`command` (`.venv/bin/pip install ...`) in `venv` with pip's --dry-run: what it would install. PyPI is the
    local index's pypi/, an --index-url its cpu/."""
    words = command.split()
    assert words[:2] == [".venv/bin/pip", "install"], command
    if "--index-url" in words:
        at = words.index("--index-url")
        assert words[at + 1] == "https://download.pytorch.org/whl/cpu", command
        words[at : at + 2] = ["--find-links", str(index / "cpu")]
    else:
        words += ["--find-links", str(index / "pypi")]
    report = index / "report.json"
    result = run([venv / "bin/python", "-m", "pip", *words[1:], "--dry-run", "--report", report])
    assert result.returncode == 0, result.stdout + result.stderr
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}


@pytest.mark.slow
def test_adding_torchvision_keeps_the_installed_torch(venv, index):
    """docs/install.md's command takes the torchvision made for the installed torch, not the newest torchvision with
    the torch it requires (what it takes without the pin)."""
    (command,) = section_commands("Adding torch packages", page="docs/install.md")
    assert dry_run(venv, command, index) == {"torchvision": "0.1", "timm": "1.0"}


@pytest.mark.slow
def test_torchvision_for_the_cpu_build_comes_from_the_cpu_index_and_keeps_torch(venv, index):
    torchvision, timm = section_commands("torchvision for the CPU build of torch", page="docs/install.md")
    assert dry_run(venv, torchvision, index) == {"torchvision": "0.1+cpu"}
    assert dry_run(venv, timm, index) == {"torchvision": "0.1", "timm": "1.0"}  # a dry run: no torchvision yet


@pytest.mark.slow
def test_a_package_that_needs_another_torch_stops_with_the_constraint_named(venv, index):
    command = [venv / "bin/python", "-m", "pip", "install", "needs-other-torch", "--dry-run"]
    result = run([*command, "--find-links", index / "pypi"])
    assert result.returncode == 1
    assert f"The user requested (constraint) torch=={TORCH}" in result.stdout + result.stderr


def test_the_tests_run_with_every_requirement_installed_as_pinned():
    """What `setup.sh --dev` installs is what the suite runs with: a feature whose file it skipped would have its
    tests skipped (importorskip), not failed. The suite's header names what is not (conftest.py)."""
    wrong = requirements_not_as_pinned()
    assert not wrong, f"{', '.join(wrong)}: bash scripts/setup.sh --dev installs them as pinned"


def test_an_unknown_option_is_one_error_line_and_makes_no_venv(tmp_path):
    result = run(["bash", "scripts/setup.sh", "--devv"], VENV=str(tmp_path / "venv"))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("error: unknown option '--devv'") and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "venv").exists()


def test_a_python_older_than_the_pinned_requirements_need_is_one_error_line_and_makes_no_venv(tmp_path):
    """pyarrow 26 and others are published for Python 3.11 on: an older one is refused before anything is made, not
    by pip's resolver after the venv and torch (`PYTHON`: the interpreter the venv is made with)."""
    old = tmp_path / "python3.10"  # answers as Python 3.10.13 does to setup.sh's two questions
    old.write_text('#!/bin/sh\ncase "$2" in *platform*) echo 3.10.13;; *) exit 1;; esac\n')
    old.chmod(0o755)
    result = run(["bash", "scripts/setup.sh"], VENV=str(tmp_path / "venv"), PYTHON=str(old))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"error: Python 3.11 or newer is needed and {old} is 3.10.13; run with one: PYTHON=python3.12 bash "
        "scripts/setup.sh\n"
    )
    assert not (tmp_path / "venv").exists()


def test_the_programs_the_tests_start_are_installed_as_pinned():
    """Each requirements/tools/NAME.txt is what .venv/tools/NAME holds (setup.sh keeps a copy of what it installed)."""
    for file in sorted((REPO / "requirements" / "tools").glob("*.txt")):
        installed = Path(sys.prefix) / "tools" / file.stem / "requirements.txt"
        assert installed.is_file() and installed.read_text() == file.read_text(), (
            f"{file.name}: bash scripts/setup.sh --dev"
        )
