"""Print the commands of a README section's first ```bash block, one per line (used by CI and the tests).

python3 scripts/readme_commands.py quickstart        # the two Quickstart commands
python3 scripts/readme_commands.py launch            # the launch commands
"""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section_commands(heading: str, readme: Path = README) -> list[str]:
    """Lines of the first ```bash block after the `## <heading>` line (comments and blank lines dropped)."""
    text = readme.read_text()
    start = re.search(rf"^## {re.escape(heading)}.*$", text, flags=re.MULTILINE | re.IGNORECASE)
    if not start:
        raise SystemExit(f"README has no '## {heading}' section")
    block = re.search(r"```bash\n(.*?)```", text[start.end() :], flags=re.DOTALL)
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


if __name__ == "__main__":
    print("\n".join(section_commands(" ".join(sys.argv[1:]) or "Quickstart")))
