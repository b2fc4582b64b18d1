"""Print the commands of a page's section's first ```bash block, one per line (used by CI and the tests).

python3 scripts/readme_commands.py quickstart                          # the two Quickstart commands (README.md)
python3 scripts/readme_commands.py launch                              # the launch commands
python3 scripts/readme_commands.py --page docs/resume.md resume        # a section of a docs/ page
"""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)


def section_block(heading: str, page: str | Path = "README.md") -> re.Match:
    """The first ```bash block after the `## <heading>` (or `# <heading>`) line of `page`, a path relative to the
    repository root."""
    text = (REPO / page).read_text()
    start = re.search(rf"^##? {re.escape(heading)}.*$", text, flags=re.MULTILINE | re.IGNORECASE)
    if not start:
        raise SystemExit(f"{page} has no '## {heading}' section")
    block = BASH_BLOCK.search(text, start.end())
    if not block:
        raise SystemExit(f"{page}: no ```bash block after '## {heading}'")
    return block


def section_commands(heading: str, page: str | Path = "README.md") -> list[str]:
    """Lines of the first ```bash block after the `## <heading>` line (comments and blank lines dropped; a line
    that ends in a backslash continues on the next)."""
    joined = re.sub(r"\\\n\s*", " ", section_block(heading, page).group(1))
    lines = [line.split("  #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


if __name__ == "__main__":
    args = sys.argv[1:]
    page = "README.md"
    if args[:1] == ["--page"]:
        page, args = args[1], args[2:]
    print("\n".join(section_commands(" ".join(args) or "Quickstart", page)))
