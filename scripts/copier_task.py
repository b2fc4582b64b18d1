"""copier's task after it copied this template's files (copier.yml: `_tasks`; run from the template's own checkout
in the new project's folder): name the project, take out what the pages say of the features left out, and print
the pip command that installs the kept features' own requirements (the Quickstart installs the core's only).

    python <template>/scripts/copier_task.py NAME DESCRIPTION KEPT   # KEPT: the chosen features, comma-separated
    python <template>/scripts/copier_task.py --conflicts             # after an update (copier.yml: `_migrations`)

copier left the files of the features not chosen out already (`_exclude`); scripts/remove_feature.py then drops
their features.yaml entries, their marked README/docs lines and their options' tables in docs/config.md, as it does
in a clone. The generator feature goes always: a generated project is not a template. It runs with copier's own
Python (which has PyYAML, copier's dependency) and needs nothing else.
"""

import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.remove_feature import manifest, remove, requirements_install, with_dependents  # noqa: E402

# `copier update` renders the project's old and new versions in temporary folders named so, running this task there
UPDATE_RENDER = re.compile(r"copier\.\w+\.(old|new)_copy\.")
RENAMED = ("pyproject.toml", "src/config.py", "README.md", "docs/config.md")  # where the template's name is
PROJECT_VERSION = "0.1.0"  # a project's own version to start from; the template's is `_commit` in .copier-answers.yml


def rename(root: Path, name: str, description: str) -> None:
    """The template's name -> `name` wherever it stands (the package, the tracker's project, the README's title,
    docs/config.md's default), pyproject.toml's description -> `description` and its version -> PROJECT_VERSION
    (copier renders the old and new versions with this task too: the template's releases leave that line alone, so
    a version of the project's own never conflicts with them)."""
    pyproject = (root / "pyproject.toml").read_text()
    old = re.search(r'^name = "([^"]+)"', pyproject, flags=re.M).group(1)
    for relative in RENAMED:
        path = root / relative
        if path.is_file():
            path.write_text(path.read_text().replace(old, name))
    pyproject = (root / "pyproject.toml").read_text()
    quoted = description.replace("\\", "\\\\").replace('"', '\\"')
    pyproject = re.sub(r'^description = ".*"$', f'description = "{quoted}"', pyproject, count=1, flags=re.M)
    pyproject = re.sub(r'^version = ".*"$', f'version = "{PROJECT_VERSION}"', pyproject, count=1, flags=re.M)
    (root / "pyproject.toml").write_text(pyproject)


def say_conflicts() -> None:
    """`copier update` exits 0 also where it left a conflict (both sides changed the same lines): name each file."""
    listed = subprocess.run(["git", "diff", "--name-only", "--diff-filter=U"], capture_output=True, text=True)
    for path in listed.stdout.split():
        print(
            f"conflict: {path} holds your lines and the template's between <<<<<<< and >>>>>>> markers; edit it to "
            "what it should be, then `git add` it (the project's pre-commit hook refuses a commit with markers)"
        )


def main() -> int:
    if sys.argv[1:] == ["--conflicts"]:
        say_conflicts()
        return 0
    name, description, kept = sys.argv[1], sys.argv[2], set(filter(None, sys.argv[3].split(",")))
    root = Path.cwd()
    left_out = with_dependents(["generator", *(feature for feature in manifest() if feature not in kept)])
    for feature in left_out:
        remove(feature, root)
    rename(root, name, description)
    install = requirements_install([feature for feature in manifest() if feature in kept], root)
    if install and not UPDATE_RENDER.match(root.name):  # said once: not for the versions `copier update` compares
        print(f"what the kept features need (after bash scripts/setup.sh): {install}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
