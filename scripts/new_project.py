"""Start your own project from this template: rename it everywhere the name appears, in one command.

    python scripts/new_project.py my-vision-project

Rewrites the project name (read from pyproject.toml, so a renamed project can be renamed again) in pyproject.toml,
the wandb/tensorboard `project_name` default in src/config.py (and the generated config table in docs/config.md), and
the README's title; then `git init` a fresh history if you like. The code keeps its `src/` layout, so imports stay as
they are, and the test suite passes in the renamed project (it reads the name, it does not hard-code it).
"""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ("pyproject.toml", "src/config.py", "README.md", "docs/config.md")


def current_name(repo: Path = REPO) -> str:
    return re.search(r'^name = "([^"]+)"', (repo / "pyproject.toml").read_text(), flags=re.MULTILINE).group(1)


def rename(new_name: str, repo: Path = REPO) -> list[Path]:
    old_name, changed = current_name(repo), []
    for relative in FILES:
        path = repo / relative
        text = path.read_text()
        updated = text.replace(old_name, new_name)
        if updated != text:
            path.write_text(updated)
            changed.append(path)
    return changed


def main() -> int:
    if len(sys.argv) != 2 or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", sys.argv[1]):
        print("error: give one project name of letters, digits, '-', '_' or '.', e.g. my-project", file=sys.stderr)
        return 2
    if sys.argv[1] == current_name():
        print(f"error: the project is already called {sys.argv[1]!r}", file=sys.stderr)
        return 2
    for path in rename(sys.argv[1]):
        print(f"renamed in {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
