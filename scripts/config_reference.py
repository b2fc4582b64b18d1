"""Write the README's config reference from src/config.py, so the two can't drift (a test runs --check).

python scripts/config_reference.py          # rewrite the table in README.md
python scripts/config_reference.py --check  # exit 1 if README.md is out of date
"""

import ast
import dataclasses
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def field_comments() -> dict[str, tuple[str, str]]:
    """name -> (section, the comment at the end of its line) from the dataclass source."""
    source = (REPO / "src" / "config.py").read_text()
    lines = source.splitlines()
    comments, section = {}, ""
    for line_number, line in enumerate(lines, start=1):
        if match := re.match(r"\s+# --- (.*) ---", line):
            section = match.group(1)
        comments[line_number] = section
    tree = ast.parse(source)
    config_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    result = {}
    for node in config_class.body:
        if isinstance(node, ast.AnnAssign):
            line = lines[node.lineno - 1]
            comment = line.split("  # ", 1)[1] if "  # " in line else ""
            result[node.target.id] = (comments[node.lineno], comment)
    return result


def table() -> str:
    from src.config import TrainConfig

    comments = field_comments()
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    section = None
    for field in dataclasses.fields(TrainConfig):
        field_section, comment = comments[field.name]
        if field_section != section:
            section = field_section
            rows.append(f"| **{section}** | | | |")
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        kind = getattr(field.type, "__name__", str(field.type)) if isinstance(field.type, type) else str(field.type)
        kind = kind.replace("typing.", "").replace("|", "or")
        rows.append(f"| `{field.name}` | {kind} | `{default!r}` | {comment.replace('|', 'or')} |")
    return "\n".join(rows)


def main() -> int:
    readme = (REPO / "README.md").read_text()
    if START not in readme or END not in readme:
        print(f"error: README.md has no {START} ... {END} markers", file=sys.stderr)
        return 2
    before, rest = readme.split(START, 1)
    _, after = rest.split(END, 1)
    updated = f"{before}{START}\n{table()}\n{END}{after}"
    if "--check" in sys.argv[1:]:
        if updated != readme:
            print(
                "README.md's config reference is out of date: run python scripts/config_reference.py", file=sys.stderr
            )
            return 1
        return 0
    (REPO / "README.md").write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
