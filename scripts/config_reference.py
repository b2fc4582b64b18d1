"""Write docs/config.md's reference from src/config.py, the installed features' and the built-in tasks' options (a
test runs --check).

python scripts/config_reference.py          # rewrite the table in docs/config.md
python scripts/config_reference.py --check  # exit 1 if docs/config.md is out of date
"""

import dataclasses
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
PAGE = REPO / "docs" / "config.md"


def field_sections() -> dict[str, str]:
    """TrainConfig field -> the `# --- section ---` comment above it in src/config.py."""
    lines = (REPO / "src" / "config.py").read_text().splitlines()
    sections, section = {}, ""
    for line in lines:
        if match := re.match(r"\s+# --- (.*) ---", line):
            section = match.group(1)
        elif match := re.match(r"    (\w+): ", line):
            sections.setdefault(match.group(1), section)
    return sections


def rows(cls, sections: dict[str, str] | None = None) -> list[str]:
    from src.config import field_help

    comments, result, section = field_help(cls), [], None
    for field in dataclasses.fields(cls):
        if field.name in ("task_args", "feature_args"):
            continue
        if sections and sections.get(field.name) != section:
            section = sections.get(field.name)
            result.append(f"| **{section}** | | | |")
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        kind = getattr(field.type, "__name__", str(field.type)) if isinstance(field.type, type) else str(field.type)
        kind = kind.replace("typing.", "").replace("|", "or")
        comment = comments.get(field.name, "").replace("|", "or")
        result.append(f"| `{field.name}` | {kind} | `{default!r}` | {comment} |")
    return result


def table() -> str:
    from src.config import TrainConfig
    from src.features import installed
    from src.tasks import BUILT_IN, task_class

    header = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    parts = ["Every run (`src/config.py: TrainConfig`):", "", *header, *rows(TrainConfig, field_sections())]
    for feature in installed():
        if feature.Options is not None:
            source = type(feature).__module__.replace(".", "/") + "/"
            parts += ["", f"The feature in `{source}` (`{feature.Options.__qualname__}`):", "", *header]
            parts += rows(feature.Options)
    for name in BUILT_IN:
        cls = task_class(name)
        source = cls.__module__.replace(".", "/") + ".py"
        parts += ["", f"`--task {name}` (`{source}: {cls.__qualname__}.Options`):", "", *header, *rows(cls.Options)]
    return "\n".join(parts)


def main() -> int:
    page = PAGE.read_text()
    name = PAGE.relative_to(REPO)
    if START not in page or END not in page:
        print(f"error: {name} has no {START} ... {END} markers", file=sys.stderr)
        return 2
    before, rest = page.split(START, 1)
    _, after = rest.split(END, 1)
    updated = f"{before}{START}\n{table()}\n{END}{after}"
    if "--check" not in sys.argv[1:]:
        PAGE.write_text(updated)
    elif updated != page:
        print(f"{name}'s config reference is out of date: run python scripts/config_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
