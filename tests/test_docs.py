"""The README and docs/ pages: every ```bash block is run by a test, links resolve, the README stays a front door.

Each page's commands are found by section (`scripts/readme_commands.py: section_commands(heading, page)`); the
commands of the sections no other test file runs are run here, as written (training runs shortened).
"""

import re
import shlex
import shutil
import sys

import pandas as pd
import pytest
import torch

from scripts.readme_commands import BASH_BLOCK, section_block, section_commands
from tests.conftest import QUICK, REPO, assert_ok, assert_processes, free_port, read_metrics, run_command
from tests.test_launch_configs import slurm  # noqa: F401  (the fake SLURM fixture)

PAGES = ["README.md", *sorted(str(path.relative_to(REPO)) for path in (REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)


def sections_run_by_tests() -> set[tuple[str, str]]:
    """(page, heading) of every section_commands(...) call in tests/ and of the Quickstart, which .ci/run runs."""
    call = re.compile(r'section_commands\(\s*"([^"]+)"(?:\s*,\s*page\s*=\s*"([^"]+)")?\s*\)')
    found = set()
    for path in (REPO / "tests").glob("*.py"):
        found |= {(page or "README.md", heading) for heading, page in call.findall(path.read_text())}
    if "readme_commands.py quickstart" in (REPO / ".ci" / "run").read_text():
        found.add(("README.md", "Quickstart"))
    return found


def test_every_bash_block_is_run_by_a_test():
    """A ```bash block counts as run when it is the block some test's section_commands(heading, page) returns."""
    run = {}
    for page, heading in sections_run_by_tests():
        assert (REPO / page).is_file(), f"a test reads {page}, which does not exist"
        run.setdefault(page, set()).add(section_block(heading, page).start())
    for page in PAGES:
        text = (REPO / page).read_text()
        for block in BASH_BLOCK.finditer(text):
            line = text[: block.start()].count("\n") + 1
            assert block.start() in run.get(page, set()), f"{page}:{line}: no test runs this ```bash block"


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


def workspace(tmp_path, *names: str):
    """A folder that links to the repository's code and digits, so commands run in it write their runs/ and data/
    there."""
    for name in names or ("train.py", "src", "configs", "accelerate_configs", "scripts"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits").symlink_to(REPO / "data" / "digits")
    return tmp_path


def as_written(command: str) -> list[str]:
    """The command's words, `python` and `accelerate launch` run from this interpreter."""
    words = shlex.split(command)
    if words[:2] == ["accelerate", "launch"]:
        return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *words[2:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return words


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
def test_plot_command_draws_a_1_and_a_2_process_run(tmp_path):
    (command,) = section_commands("Plots", page="docs/tracking.md")
    cwd = workspace(tmp_path)
    ddp = "accelerate launch --config_file accelerate_configs/ddp.yaml train.py"
    for name, processes, launch in (("digits", 1, "python train.py"), ("digits_ddp", 2, ddp)):
        assert_ok(run_command([*as_written(launch), *QUICK, "--output_dir", f"runs/{name}"], cwd=cwd))
        assert_processes(cwd / "runs" / name, processes)
    assert_ok(run_command(as_written(command), cwd=cwd))
    assert (cwd / "curves.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_gpt_recipe_commands(tmp_path):
    """docs/lm.md: prepare the stdlib text, train configs/lm.yaml (shortened); the GPU command where a GPU exists."""
    commands = section_commands("A GPT on real text", page="docs/lm.md")
    assert [c.split()[1] for c in commands] == ["scripts/prepare_text.py", "train.py", "launch"]
    cwd = workspace(tmp_path)
    for i, command in enumerate(commands):
        if "single_gpu" in command and not torch.cuda.is_available():
            continue
        shorten = ["--max_steps", "4", "--logging_steps", "2", "--max_eval_tokens", "8192", "--output_dir", f"r{i}"]
        assert_ok(run_command(as_written(command) + (shorten if "train.py" in command else []), cwd=cwd, timeout=600))
    assert (cwd / "data" / "stdlib" / "train.parquet").is_file()
    assert [row["step"] for row in read_metrics(cwd / "r1") if "train/loss" in row] == [2, 4]


def test_slurm_commands_run_under_a_fake_slurm(slurm):  # noqa: F811
    """docs/launching.md's sbatch commands: each script runs (under fake srun/scontrol/launchers) on every node and
    passes the command's arguments on to train.py."""
    commands = section_commands("SLURM clusters", page="docs/launching.md")
    assert len(commands) == 3
    for command in commands:
        words = shlex.split(command)
        script = next(i for i, word in enumerate(words) if word.endswith(".sbatch"))
        assert words[0] == "sbatch" and all(word.startswith("--") for word in words[1:script]), command
        args = words[script + 1 :]
        nodes = int(next((w.split("=")[1] for w in words[1:script] if w.startswith("--nodes=")), 1))
        env = {"SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": f"gpu-node-[1-{nodes}]", "SLURM_GPUS_ON_NODE": "2",
               "SLURM_CPUS_PER_TASK": "4"}  # fmt: skip
        result = slurm.run(REPO / words[script], *args, **env)
        assert result.returncode == 0, (command, result.stderr)
        resume = ["--resume_from_checkpoint", "latest", "--output_dir", str(slurm.output_dir)]
        for node in range(nodes):
            launched = slurm.launched(node)
            assert "train.py" in launched and launched[-len(args) - 4 :] == [*args, *resume], (command, launched)


def guide_block(first_line: str, language: str = "python") -> str:
    guide = (REPO / "docs" / "customize.md").read_text()
    (block,) = [b for b in re.findall(rf"```{language}\n(.*?)```", guide, flags=re.DOTALL) if b.startswith(first_line)]
    return block


@pytest.mark.slow
def test_guide_tabular_command(tmp_path):
    """docs/customize.md's `tabular` command on a table with the columns it names (integer species labels)."""
    (command,) = section_commands("Your data, by config", page="docs/customize.md")
    cwd = workspace(tmp_path)
    (cwd / "my").mkdir()
    generator = torch.Generator().manual_seed(0)
    for split, rows in (("train", 120), ("eval", 31)):
        species = torch.randint(0, 3, (rows,), generator=generator)
        table = {
            "sepal_length": (species + torch.rand(rows, generator=generator)).tolist(),
            "sepal_width": torch.rand(rows, generator=generator).tolist(),
            "species": species.tolist(),
        }
        pd.DataFrame(table).to_csv(cwd / "my" / f"{split}.csv", index=False)
    assert_ok(run_command([*as_written(command), *QUICK, "--per_device_train_batch_size", "8",
                           "--global_batch_size", "8", "--output_dir", "run"], cwd=cwd))  # fmt: skip
    assert read_metrics(cwd / "run")[-1]["eval/num_samples"] == 31


@pytest.mark.slow
def test_guide_task_commands(tmp_path):
    """docs/customize.md's commands for the task written from scratch, with the guide's two files where it puts them
    (in a copy of train.py and src/, so the repository's own src/ stays as it is)."""
    commands = section_commands("Your task", page="docs/customize.md")
    assert [c.split()[1] for c in commands] == ["make_sequences.py", "train.py", "launch"]
    cwd = workspace(tmp_path, "configs", "accelerate_configs", "scripts")
    shutil.copy(REPO / "train.py", cwd)  # a copy: python puts a linked script's real folder first on sys.path
    shutil.copytree(REPO / "src", cwd / "src", ignore=shutil.ignore_patterns("__pycache__"))
    (cwd / "src" / "tasks" / "sequences.py").write_text(guide_block("# src/tasks/sequences.py"))
    (cwd / "make_sequences.py").write_text(guide_block("# make_sequences.py"))
    for i, command in enumerate(commands):
        extra = [*QUICK, "--output_dir", f"run{i}"] if "train.py" in command else []
        assert_ok(run_command(as_written(command) + extra, cwd=cwd, timeout=600))
        if extra:
            assert_processes(cwd / f"run{i}", 2 if "launch" in command else 1)


@pytest.mark.slow
def test_launching_from_python_runs_as_written(tmp_path):
    """docs/launching.md's `From Python:` block, as written, in a folder with its own runs/: both runs train."""
    page = (REPO / "docs" / "launching.md").read_text()
    block = re.search(r"From Python:\n\n```python\n(.*?)```", page, re.S).group(1)
    result = run_command([sys.executable, "-c", block], cwd=workspace(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("flags", "config"):
        assert (tmp_path / "runs" / name / "model" / "model.safetensors").is_file(), name
