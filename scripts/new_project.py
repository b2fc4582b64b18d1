"""Start your own project from this template: rename it everywhere the name appears, in one command.

    python scripts/new_project.py my-vision-project

Rewrites the project name in pyproject.toml, the wandb/tensorboard `project_name` default in src/config.py (and the
README's generated config table), and the README's title; then `git init` a fresh history if you like. The code
keeps its `src/` layout, so imports stay as they are.
"""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE_NAME = "accelerate-template"
FILES = ("pyproject.toml", "src/config.py", "README.md", "tests/test_tracking.py")


def rename(new_name: str, repo: Path = REPO) -> list[Path]:
    changed = []
    for relative in FILES:
        path = repo / relative
        text = path.read_text()
        updated = text.replace(TEMPLATE_NAME, new_name)
        if updated != text:
            path.write_text(updated)
            changed.append(path)
    return changed


def main() -> int:
    if len(sys.argv) != 2 or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", sys.argv[1]):
        print("error: give one project name of letters, digits, '-', '_' or '.', e.g. my-project", file=sys.stderr)
        return 2
    changed = rename(sys.argv[1])
    if not changed:
        print(f"error: {TEMPLATE_NAME!r} was not found: this checkout has been renamed already", file=sys.stderr)
        return 2
    for path in changed:
        print(f"renamed in {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
