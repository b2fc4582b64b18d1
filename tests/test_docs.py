"""The README and docs/ pages: every ```bash block is run by a test, links resolve, the README stays a front door.

Each page's commands are found by section (`scripts/readme_commands.py: section_commands(heading, page)`). A
feature's page is checked by the feature's own test module (`assert_bash_blocks_run("docs/<page>.md")`, which
tests/helpers.py has), so deleting a feature's page and tests together leaves this file green; the core's pages are
checked here, and every page must be checked somewhere. The commands of the core's sections are run here, as written
(training runs shortened).
"""

import re
import sys

import pytest

from scripts.readme_commands import section_commands
from tests.conftest import QUICK, REPO, assert_ok, assert_processes, read_metrics, run_command
from tests.helpers import (
    as_written,
    assert_bash_blocks_run,
    guide_task_commands,
    pages_claimed_by,
    workspace,
)

PAGES = ["README.md", *sorted(str(path.relative_to(REPO)) for path in (REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)

# The core's pages; each feature's page is checked by its own test module.
CORE = (
    "config",
    "customize",
    "errors",
    "how_it_works",
    "install",
    "launching",
    "predict",
    "resume",
    "testing",
    "tracking",
)
CORE_PAGES = ["README.md", *(f"docs/{name}.md" for name in CORE)]


@pytest.mark.parametrize("page", CORE_PAGES)
def test_every_bash_block_of_a_core_page_is_run_by_a_test(page):
    assert_bash_blocks_run(page)


def test_every_page_is_checked_by_a_test_module():
    """Each page is a core page or some test module's assert_bash_blocks_run("<page>"): a new page can't go
    unchecked, and a page deleted with its feature's test module takes its claim along."""
    claimed = set(CORE_PAGES)
    for path in (REPO / "tests").glob("test_*.py"):
        claimed |= pages_claimed_by(path)
    assert [page for page in PAGES if page not in claimed] == []


def test_the_page_check_fails_on_a_block_no_test_runs(tmp_path, monkeypatch):
    """assert_bash_blocks_run, shown able to fail: a page with a second ```bash block that no section_commands call
    returns."""
    import tests.helpers

    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("# Page\n\n## Run\n\n```bash\necho run\n```\n\n## Not run\n\n```bash\necho no\n```\n")
    monkeypatch.setattr(tests.helpers, "REPO", tmp_path)
    monkeypatch.setattr("scripts.readme_commands.REPO", tmp_path)
    monkeypatch.setattr(tests.helpers, "sections_run_by_tests", lambda: {("docs/page.md", "Run")})
    with pytest.raises(AssertionError, match=r"docs/page.md:11: no test runs this"):
        assert_bash_blocks_run("docs/page.md")
    page.write_text(page.read_text().split("## Not run")[0])
    assert_bash_blocks_run("docs/page.md")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(match) for match in re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    """Every relative markdown link (and image) points to a file that exists, and its #anchor to a heading there."""
    path = REPO / page
    text = FENCE.sub("", path.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{page}: link to {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page}: link to {target}: no such heading"


def test_readme_is_a_front_door_with_a_map_of_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    docs_map = readme.split("\n## Documentation", 1)[1]
    for page in PAGES[1:]:
        assert f"]({page})" in docs_map, f"README's documentation map does not list {page}"


# --- the commands of the sections no other test file runs ---


@pytest.mark.slow
def test_resume_command_starts_then_resumes(tmp_path):
    """docs/resume.md's command, twice: the first start trains, the second resumes from its checkpoint."""
    (command,) = section_commands("Resume", page="docs/resume.md")
    cwd = workspace(tmp_path)
    first = run_command([*as_written(command), *QUICK], cwd=cwd)
    assert_ok(first)
    second = run_command([*as_written(command), "--max_steps", "8", "--logging_steps", "2"], cwd=cwd)
    assert_ok(second)
    steps = [row["step"] for row in read_metrics(cwd / "runs" / "exp1") if "train/loss" in row]
    assert steps == [2, 4, 6, 8]  # each step once: the second start went on from step 6


@pytest.mark.slow
def test_guide_task_commands(request):
    """docs/customize.md's commands for the task written from scratch, with the guide's two files where it puts them
    (tests/helpers.py: guide_task_commands, run once for this test and tests/test_customize.py's comparison of the
    two training commands' runs)."""
    commands = section_commands("Your task", page="docs/customize.md")
    assert [c.split()[1] for c in commands] == ["make_sequences.py", "train.py", "launch"]
    cwd = guide_task_commands(request)  # each command exited 0
    for i, command in enumerate(commands):
        if "train.py" in command:
            assert_processes(cwd / f"run{i}", 2 if "launch" in command else 1)


@pytest.mark.slow
def test_launching_from_python_runs_as_written(tmp_path):
    """docs/launching.md's `From Python:` block, as written but for its 100 steps (10 here: what is checked is that
    each call form trains and saves), in a folder with its own runs/: both runs train."""
    page = (REPO / "docs" / "launching.md").read_text()
    block = re.search(r"From Python:\n\n```python\n(.*?)```", page, re.S).group(1)
    for steps in ('"--max_steps", "{}"', "max_steps={}"):
        assert block.count(steps.format(100)) == 1, steps
        block = block.replace(steps.format(100), steps.format(10))
    result = run_command([sys.executable, "-c", block], cwd=workspace(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("flags", "config"):
        assert (tmp_path / "runs" / name / "model" / "model.safetensors").is_file(), name
