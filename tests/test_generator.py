"""The repository as a copier template (copier.yml, scripts/copier_task.py, docs/your_own_project.md): projects made
from a tagged copy of it for several answer sets, each holding only its features and passing its own tests, and
`copier update` bringing a new template version into a project its user edited.

The generated projects are shared by the tests through module fixtures; each project runs the fast tests that its
answers touch (the lean core's whole fast tier runs in tests/test_lean_core.py, from the same removal)."""

import dataclasses
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts.readme_commands import section_commands
from scripts.remove_feature import MACHINERY, copy_of_repo, remove, with_dependents
from tests.conftest import REPO, assert_ok, command_env, manifest
from tests.helpers import assert_bash_blocks_run

MANIFEST = manifest()
CHOICES = [name for name in MANIFEST if name != "generator"]
GIT_ID = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
          "GIT_COMMITTER_EMAIL": "t@example.com"}  # fmt: skip


def env(**extra) -> dict:
    """The tests' environment, this interpreter's bin/ first on PATH (copier, pre-commit, pip), a git identity."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return command_env({**GIT_ID, "PATH": path, "PRE_COMMIT_HOME": None, **extra})


def sh(command: str, cwd: Path, timeout: float = 600, **extra) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env(**extra), capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
    assert_ok(result)
    return result


def version(root: Path) -> str:
    return re.search(r'^version = "(.*)"', (root / "pyproject.toml").read_text(), flags=re.M).group(1)


def tag(template: Path, version: str) -> None:
    sh(f"git add -A && git commit -qm {version} && git tag {version}", cwd=template)


def generate(template: Path, destination: Path, *data: str) -> Path:
    data_args = " ".join(f"--data '{one}'" for one in data)
    sh(f"copier copy -q --trust --defaults {data_args} {template} {destination}", cwd=destination.parent)
    return destination


def files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}


def expected_files(kept: list[str]) -> set[str]:
    """The repository's files less those of every feature not kept (and of the generator), plus copier's answers."""
    every = set(subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.split())  # fmt: skip
    every = {name for name in every if (REPO / name).is_file()}
    for name in with_dependents(["generator", *(c for c in CHOICES if c not in kept)]):
        for path in MANIFEST[name]["paths"]:
            every = {f for f in every if f != path and not (path.endswith("/") and f.startswith(path))}
    if not kept:  # no feature left: nothing to remove, so the removal script and its check go too
        every -= set(MACHINERY)
    return every | {".copier-answers.yml"}


def traces(name: str) -> list[str]:
    """What would show a feature is there: its paths (and the names of its pages and scripts), its flags, its
    --task names, its requirements' pins and the `words` features.yaml gives for it (DeepSpeed, SLURM, ...: what
    the prose calls it)."""
    found = set(MANIFEST[name].get("words", []))
    for path in MANIFEST[name]["paths"]:
        found.add(path)
        if path.startswith(("docs/", "scripts/")) and path.endswith((".md", ".py")):
            found.add(Path(path).name)
        if path.startswith("requirements/") and (REPO / path).is_file():
            found |= set(re.findall(r"^[\w.\[\]-]+==", (REPO / path).read_text(), flags=re.M))
    if (REPO / "src" / "features" / name).is_dir():
        feature = importlib.import_module(f"src.features.{name}").FEATURE
        if feature.Options is not None:
            found |= {f"--{field.name}" for field in dataclasses.fields(feature.Options)}
        found |= {f"--task {task}" for task in feature.tasks}
    return sorted(found)


# Where a trace counts: what a user reads and runs (the pages, configs, requirements, CI and setup). The code's
# comments that cite a feature's page as the source of a measured figure are listed in the report of issue 36.
READ = (
    "*.md",
    "*.yaml",
    "*.yml",
    "*.txt",
    "*.toml",
    "Makefile",
    ".ci/*",
    ".github/**/*",
    "configs/**/*.yaml",
    "accelerate_configs/*.yaml",
)


def traces_left(project: Path, kept: list[str]) -> list[str]:
    left_out = with_dependents(["generator", *(c for c in CHOICES if c not in kept)])
    read = sorted({p for pattern in READ for p in project.glob(pattern) if p.is_file()})
    read += sorted(project.glob("docs/*.md"))
    found = []
    for name in left_out:
        for trace in traces(name):
            pattern = re.compile(re.escape(trace) + r"(?![\w-])")
            for page in read:
                for number, line in enumerate(page.read_text().splitlines(), 1):
                    if pattern.search(line):
                        found.append(f"{name}: {trace!r} in {page.relative_to(project)}:{number}: {line.strip()[:100]}")
    return found


def fast_tests(project: Path, *test_files: str, timeout: float = 900) -> None:
    """The fast tier of `test_files` in the project (those it still has), with this interpreter."""
    present = [name for name in test_files if (project / name).is_file()]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", "-n", "0", *present],
        cwd=project, env=env(), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert_ok(result)
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A copy of this checkout as a template repository of its own, tagged v0.1.0 (copier takes the newest tag)."""
    root = copy_of_repo(tmp_path_factory.mktemp("template") / "accelerate-template")
    sh("git init -q -b main && git config core.hooksPath /dev/null", cwd=root)
    tag(root, "v0.1.0")
    return root


@pytest.fixture(scope="module")
def lean(template, tmp_path_factory) -> Path:
    return generate(template, tmp_path_factory.mktemp("lean") / "my-project")


def assert_questions_follow(copier_text: str, choices: list[str]) -> None:
    copier = yaml.safe_load(copier_text)
    offered = copier["features"]["choices"] or []
    assert [value for _, value in offered] == choices
    assert [label for label, _ in offered] == [f"{name}: {MANIFEST[name]['help']}" for name in choices]
    assert copier["features"]["default"] == []
    excluded = copier["_exclude"]
    for name in CHOICES:
        for path in MANIFEST[name]["paths"]:
            assert (f"{{% if '{name}' not in features %}}{path}{{% endif %}}" in excluded) == (name in choices), path
    assert {p for p in MANIFEST["generator"]["paths"] if "{{" not in p} <= set(excluded)
    refusals = re.findall(r"{% if '(\w+)' in features and '(\w+)' not in features %}", copier["features"]["validator"])
    assert sorted(refusals) == sorted(
        (name, required) for name in choices for required in MANIFEST[name].get("requires", [])
    )


def test_copier_questions_follow_the_manifest():
    """copier.yml offers each feature of features.yaml but the generator, its help as the choice's text, excludes
    each of its paths when it is not chosen and refuses one chosen without what it requires."""
    assert_questions_follow((REPO / "copier.yml").read_text(), CHOICES)


@pytest.mark.parametrize("name", CHOICES)
def test_a_removed_feature_leaves_the_questions(name):
    """scripts/remove_feature.py NAME in a repository that keeps the generator: copier.yml offers it (and what
    requires it) no more, and still follows the manifest that is left."""
    from scripts.remove_feature import strip_from_copier

    text, gone = (REPO / "copier.yml").read_text(), with_dependents([name])
    for one in gone:
        text = strip_from_copier(text, one)
    assert_questions_follow(text, [one for one in CHOICES if one not in gone])


@pytest.mark.slow
def test_a_feature_chosen_without_what_it_requires_is_refused_and_nothing_is_written(template, tmp_path):
    """copier's validator names the missing choice; copier stops (its own traceback, exit 1) before writing."""
    destination = tmp_path / "my-project"
    result = subprocess.run(["copier", "copy", "-q", "--trust", "--defaults", "--data", "features=[gpt]",
                             str(template), str(destination)], cwd=tmp_path, env=env(), capture_output=True,
                            text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].endswith("gpt requires text_data: choose text_data too.")
    assert not destination.exists()


def test_the_changelog_names_the_version_of_pyproject():
    """CHANGELOG.md's newest entry is the version pyproject.toml states (the one to tag vX.Y.Z)."""
    newest = re.search(r"^## (\d+\.\d+\.\d+)", (REPO / "CHANGELOG.md").read_text(), flags=re.M).group(1)
    assert f'version = "{newest}"' in (REPO / "pyproject.toml").read_text()


def test_every_command_of_the_page_is_run():
    assert_bash_blocks_run("docs/your_own_project.md")


@pytest.mark.slow
def test_the_default_project_is_the_lean_core_renamed(lean):
    """`copier copy --defaults`: the core's files only, named my-project everywhere, no trace of any feature, a git
    repository of its own, and its own tests of what the generator touched pass."""
    assert files(lean) == expected_files([])
    empty = [d for d in lean.rglob("*") if d.is_dir() and ".git" not in d.parts and not any(d.iterdir())]
    assert empty == []  # no folder whose files copier left out (requirements/tools/ was)
    assert 'name = "my-project"' in (lean / "pyproject.toml").read_text()
    assert 'description = "A training project on Hugging Face Accelerate' in (lean / "pyproject.toml").read_text()
    assert (lean / "README.md").read_text().startswith("# my-project\n")
    assert 'project_name: str = "my-project"' in (lean / "src/config.py").read_text()
    named = [
        f
        for f in files(lean) - {".copier-answers.yml"}
        if "accelerate-template" in (lean / f).read_text(errors="ignore")
    ]
    assert named == []  # (the answers file holds the template's path)
    assert traces_left(lean, []) == []
    assert (yaml.safe_load((lean / "features.yaml").read_text()) or {}) == {}
    staged = sh("git log --oneline | wc -l; git diff --cached --name-only | wc -l", cwd=lean).stdout.split()
    assert int(staged[1]) == len(
        files(lean)
    )  # a fresh repository: everything staged, nothing of the template's history
    fast_tests(lean, "tests/test_docs.py", "tests/test_project.py", "tests/test_config.py", "tests/test_features.py",
               "tests/test_layout.py", "tests/test_tracking.py", "tests/test_train.py")  # fmt: skip


MIXED = {
    "images_slurm": ["images", "slurm"],  # a lean image classifier on a cluster
    "hf_deepspeed_storage": ["text_data", "hf", "deepspeed", "object_storage"],
}


@pytest.mark.slow
@pytest.mark.parametrize("answers", MIXED)
def test_a_mixed_project_holds_its_features_and_passes_their_tests(answers, template, tmp_path):
    kept = MIXED[answers]
    project = generate(template, tmp_path / answers, f"features=[{', '.join(kept)}]")
    assert files(project) == expected_files(kept)
    assert set(yaml.safe_load((project / "features.yaml").read_text())) == set(kept)
    assert traces_left(project, kept) == []
    own = [path for name in kept for path in MANIFEST[name]["paths"] if re.match(r"tests/test_\w+\.py$", path)]
    fast_tests(project, "tests/test_docs.py", "tests/test_features.py", "tests/test_launch_configs.py", *own)


@pytest.mark.slow
def test_every_feature_gives_this_repository(template, tmp_path):
    """All features, the template's name and description: the repository itself, less the generator."""
    pyproject = (REPO / "pyproject.toml").read_text()
    name = re.search(r'^name = "(.*)"', pyproject, flags=re.M).group(1)
    description = re.search(r'^description = "(.*)"', pyproject, flags=re.M).group(1)
    project = generate(template, tmp_path / "all", f"project_name={name}", f"description={description}",
                       f"features=[{', '.join(CHOICES)}]")  # fmt: skip
    expected = copy_of_repo(tmp_path / "expected")
    remove("generator", expected)
    edit(expected / "pyproject.toml", f'version = "{version(REPO)}"', 'version = "0.1.0"')  # the project's own
    assert files(project) == files(expected) | {".copier-answers.yml"}
    differing = [f for f in files(expected) if (project / f).read_bytes() != (expected / f).read_bytes()]
    assert differing == []


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{path}: {old!r}"
    path.write_text(text.replace(old, new))


@pytest.mark.slow
def test_update_merges_a_new_version_into_a_users_edits(template, tmp_path):
    """The page's commands: start a project, edit train.py and a task, take a template version that changed another
    part of train.py (both kept), add a feature, then a conflict: listed, and refused by the commit hook."""
    start = section_commands("Start a project", page="docs/your_own_project.md")
    update = section_commands("Take the template's new versions", page="docs/your_own_project.md")
    add = section_commands("Add or remove a feature", page="docs/your_own_project.md")
    conflict = section_commands("A conflict", page="docs/your_own_project.md")
    run = {"TEMPLATE": str(template)}
    started = sh(" && ".join(start), cwd=tmp_path, **run)
    project = tmp_path / "my-project"
    assert {"images"} == set(yaml.safe_load((project / "features.yaml").read_text()))
    pip = "what the kept features need (after bash scripts/setup.sh): .venv/bin/pip install -r requirements/images.txt"
    assert pip in started.stdout + started.stderr  # the Quickstart's setup installs the core's requirements only
    train_py = project / "train.py"
    lines = train_py.read_text().splitlines(keepends=True)
    train_py.write_text("".join([*lines, "# my own note at the end\n"]))  # the user's edits
    assert version(project) == "0.1.0"  # the project's own version, which the user raises
    edit(project / "pyproject.toml", 'version = "0.1.0"', 'version = "1.0.0"')
    (project / "src/tasks/digits.py").write_text((project / "src/tasks/digits.py").read_text() + "# my task note\n")
    sh("git commit -qam 'my edits'", cwd=project)

    first = (template / "train.py").read_text().splitlines(keepends=True)[0]  # the template's change, at the top
    edit(template / "train.py", first, first + "# a template fix at the top\n")
    (template / "CHANGELOG.md").write_text((template / "CHANGELOG.md").read_text() + "\n## 0.1.1\n- a fix\n")
    edit(template / "pyproject.toml", f'version = "{version(template)}"', 'version = "0.1.1"')  # its release
    tag(template, "v0.1.1")
    updated = sh(" && ".join(update), cwd=project)
    assert "conflict: " not in updated.stdout + updated.stderr and version(project) == "1.0.0"  # each keeps its own
    text = train_py.read_text()
    assert "# a template fix at the top\n" in text and text.endswith("# my own note at the end\n")
    assert (project / "src/tasks/digits.py").read_text().endswith("# my task note\n")
    assert "_commit: v0.1.1" in (project / ".copier-answers.yml").read_text()
    assert not (project / "scripts/slurm").exists() and not (project / "CHANGELOG.md").exists()  # still left out

    added = sh(" && ".join(add), cwd=project)
    assert (added.stdout + added.stderr).count(pip) == 1  # not also for each version copier compares
    assert (project / "scripts/slurm").is_dir() and (project / "docs/slurm.md").is_file()
    assert "[docs/slurm.md](docs/slurm.md)" in (project / "README.md").read_text()
    assert traces_left(project, ["images", "slurm"]) == []
    fast_tests(project, "tests/test_train.py", "tests/test_tasks.py", "tests/test_slurm.py", "tests/test_docs.py")

    # Removing one: answered out, its files and lines go (the task removes what copier's render leaves).
    drop = "copier update --trust --defaults --data 'features=[images]'"
    sh(f"{drop} && git add -A && git commit -qm drop", cwd=project)
    assert not (project / "scripts/slurm").exists() and "slurm" not in (project / "README.md").read_text()

    # A conflict: the same line changed by both.
    edit(train_py, "# my own note at the end\n", "# my own note at the end, changed\n")
    sh("git commit -qam 'mine'", cwd=project)
    edit(template / "train.py", "# a template fix at the top\n", "# a template fix at the top, changed\n")
    edit(template / "train.py", text.splitlines(keepends=True)[-2], text.splitlines(keepends=True)[-2] + "# tpl\n")
    tag(template, "v0.1.2")
    updated = sh("copier update --trust --defaults", cwd=project)  # exits 0, the conflict marked in the file
    assert "conflict: train.py holds your lines and the template's" in updated.stdout + updated.stderr
    listed = sh(" && ".join(conflict), cwd=project).stdout.split()
    assert "train.py" in listed and "<<<<<<< before updating" in train_py.read_text()
    # (SKIP: ruff's hooks are not the point here, and pre-commit would install ruff from PyPI for them)
    refused = subprocess.run(["bash", "-c", "git add -A && git commit -qm merged"], cwd=project,
                             env=env(SKIP="ruff,ruff-format"), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert refused.returncode != 0 and "conflict markers" in refused.stdout + refused.stderr
    resolved = re.sub(r"^(<<<<<<<|=======|>>>>>>>).*\n", "", train_py.read_text(), flags=re.M)
    train_py.write_text(resolved)
    sh("git add -A && git commit -qm merged", cwd=project, SKIP="ruff,ruff-format")


def test_the_conflict_hook_matches_markers_only():
    """The pre-commit hook's pattern (shown able to fail): git's markers, not a Markdown rule or a longer line."""
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    (hook,) = [h for repo in config["repos"] for h in repo["hooks"] if h["id"] == "no-conflict-markers"]
    pattern = re.compile(hook["entry"])
    assert all(pattern.search(line) for line in ("<<<<<<< before updating", "=======", ">>>>>>> after updating"))
    assert not any(pattern.search(line) for line in ("========", "a <<<<<<< b", "<<<<<<<<"))
