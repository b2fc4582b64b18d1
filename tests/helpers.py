"""What several test modules share, as plain functions and constants (fixtures live in tests/conftest.py).

A test module imports from here or from conftest, never from another test module: deleting a feature's test file
then takes nothing from the tests that stay (tests/test_layout.py checks it).
"""

import ast
import importlib.util
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch

from scripts.readme_commands import BASH_BLOCK, section_block, section_commands
from src.errors import EXIT_USAGE
from tests.conftest import QUICK, REPO, free_port, last_row, logged_losses, manifest, read_metrics, run_main, series

# --- imports, read from the source ---


def imported_names(nodes) -> set[str]:
    """What the import statements among `nodes` (AST nodes) name: `import a.b` -> a.b; `from a import b` -> a, a.b."""
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


# --- features (features.yaml) ---


def has_feature(name: str) -> bool:
    """Whether this project still has the optional feature `name`: its first file in features.yaml is here."""
    feature = manifest().get(name)
    return feature is not None and (REPO / feature["paths"][0]).exists()


def needs(*names: str):
    """A test of one part that also uses other features: skipped where the project has removed one of them."""
    missing = [name for name in names if not has_feature(name)]
    what = f"the {missing[0]} feature is" if len(missing) == 1 else f"the {' and '.join(missing)} features are"
    return pytest.mark.skipif(bool(missing), reason=f"{what} not in this project")


# --- results of a run ---


class Unreadable(torch.utils.data.Dataset):
    """A dataset whose samples from index `bad` on don't read (as a truncated file does): an OSError."""

    def __init__(self, inner, bad: int):
        self.inner, self.bad = inner, bad

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        if index >= self.bad:
            raise OSError(f"sample {index}: truncated file")
        return self.inner[index]


def run_with_unreadable_samples(monkeypatch, output_dir: Path, first_bad: int, split: str = "train"):
    """A short digits run (`main` in this process) whose train or eval samples from index `first_bad` on don't read."""
    from src.tasks.digits import Digits

    build_datasets = Digits.build_datasets

    def unreadable(self):
        train, evals = build_datasets(self)
        return (Unreadable(train, first_bad), evals) if split == "train" else (train, Unreadable(evals, first_bad))

    monkeypatch.setattr(Digits, "build_datasets", unreadable)
    return run_main(*QUICK, "--output_dir", str(output_dir))


def assert_error_line(result, pattern: str, exit_code: int = EXIT_USAGE) -> None:
    """The run failed as bad input does: exit code `exit_code`, a last stderr line `error: ...` matching `pattern`,
    no traceback."""
    assert result.returncode == exit_code, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-2000:]
    assert re.search(pattern, last), last
    assert "Traceback" not in result.stderr


def train_losses(output_dir):
    """(step -> train/loss, each step once; step -> eval/accuracy)."""
    return logged_losses(output_dir), series(read_metrics(output_dir), "eval/accuracy")


# --- the docs' commands and code, as a reader runs them ---


def workspace(tmp_path, *names: str):
    """A folder that links to the repository's code and digits, so commands run in it write their runs/ and data/
    there."""
    for name in names or ("train.py", "src", "configs", "accelerate_configs", "scripts"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits").symlink_to(REPO / "data" / "digits")
    return tmp_path


def copy_of_the_repo(destination):
    """The repository's files in `destination` (no .venv, .git, runs or data but the digits)."""
    ignore = shutil.ignore_patterns(".venv", ".git", "runs", "data", "__pycache__", ".pytest_cache", ".ruff_cache")
    shutil.copytree(REPO, destination, ignore=ignore)
    shutil.copytree(REPO / "data" / "digits", destination / "data" / "digits")
    return destination


def as_written(command: str) -> list[str]:
    """The command's words, `python` and `accelerate launch` run from this interpreter."""
    words = shlex.split(command)
    if words[:2] == ["accelerate", "launch"]:
        return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *words[2:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return words


def printed_by(command: str, cwd: Path) -> str:
    """What a docs command `python -c "<code>"` prints, its code run in this process in `cwd`: no interpreter and
    torch import of its own."""
    import contextlib
    import io
    import os

    words = as_written(command)
    assert words[1] == "-c", command
    printed, here = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(printed):
            exec(words[2], {"__name__": "__main__"})
    finally:
        os.chdir(here)
    return printed.getvalue()


def docs_code_block(page: str, first_line: str, language: str = "python") -> str:
    """`page`'s one ```language block whose first line starts with `first_line`."""
    blocks = re.findall(rf"```{language}\n(.*?)```", (REPO / page).read_text(), flags=re.DOTALL)
    found = [block for block in blocks if block.startswith(first_line)]
    assert len(found) == 1, f"{page}: {len(found)} ```{language} blocks start with {first_line!r}"
    return found[0]


# docs/customize.md's task written from scratch: its commands' training runs, long enough for 1 and 2 processes to
# be compared (tests/test_customize.py) as well as run as written (tests/test_docs.py)
GUIDE_TASK_RUN = ["--learning_rate", "1e-2", "--max_steps", "60", "--logging_steps", "1", "--eval_steps", "1000"]


def guide_task_commands(request) -> Path:
    """docs/customize.md's commands for the task written from scratch, as written, in a folder with the guide's two
    files where it puts them (a copy of train.py and src/, so the repository's own src/ stays as it is), the training
    commands with GUIDE_TASK_RUN and --output_dir run<i>: run once per test run (built_once), each checked to exit 0.
    The folder."""
    from tests.conftest import assert_ok, built_once, run_command

    with built_once(request, "guide_task") as (cwd, missing):
        if missing:
            shutil.rmtree(cwd, ignore_errors=True)  # what a failed build left
            cwd.mkdir()
            workspace(cwd, "configs", "accelerate_configs", "scripts")
            shutil.copy(REPO / "train.py", cwd)  # a copy: python puts a linked script's real folder first on sys.path
            shutil.copytree(REPO / "src", cwd / "src", ignore=shutil.ignore_patterns("__pycache__"))
            (cwd / "src" / "tasks" / "sequences.py").write_text(
                docs_code_block("docs/customize.md", "# src/tasks/sequences.py")
            )
            (cwd / "make_sequences.py").write_text(docs_code_block("docs/customize.md", "# make_sequences.py"))
            for i, command in enumerate(section_commands("Your task", page="docs/customize.md")):
                extra = [*GUIDE_TASK_RUN, "--output_dir", f"run{i}"] if "train.py" in command else []
                assert_ok(run_command(as_written(command) + extra, cwd=cwd, timeout=600))
    return cwd


# A page's commands are run where a test calls section_commands("<heading>", page="<page>") (or, for the README's
# Quickstart, by .ci/run). Each page is checked by the test module of its feature (docs/streaming.md by
# tests/test_streaming.py, ...), the core's pages by tests/test_docs.py, so a feature deleted with its page and its
# tests takes its check along.
SECTION_CALL = re.compile(r'section_commands\(\s*"([^"]+)"(?:\s*,\s*page\s*=\s*"([^"]+)")?\s*\)')
PAGE_CHECK = re.compile(r'assert_bash_blocks_run\(\s*"([^"]+)"\s*\)')  # how a test module claims a page


def sections_run_by_tests() -> set[tuple[str, str]]:
    """(page, heading) of every section_commands(...) call in tests/ and of the Quickstart, which .ci/run runs."""
    found = set()
    for path in (REPO / "tests").glob("*.py"):
        found |= {(page or "README.md", heading) for heading, page in SECTION_CALL.findall(path.read_text())}
    if "readme_commands.py quickstart" in (REPO / ".ci" / "run").read_text():
        found.add(("README.md", "Quickstart"))
    return found


def assert_bash_blocks_run(page: str) -> None:
    """Every ```bash block of `page` (a path from the repository root) is the block that some test's
    section_commands(heading, page) returns."""
    assert (REPO / page).is_file(), f"{page} does not exist"
    run = {section_block(heading, page).start() for name, heading in sections_run_by_tests() if name == page}
    text = (REPO / page).read_text()
    for block in BASH_BLOCK.finditer(text):
        line = text[: block.start()].count("\n") + 1
        assert block.start() in run, f"{page}:{line}: no test runs this ```bash block"


def pages_claimed_by(path: Path) -> set[str]:
    """The docs pages whose commands the test module at `path` checks (its assert_bash_blocks_run calls)."""
    return set(PAGE_CHECK.findall(path.read_text()))


# --- sharded strategies (tests/test_sharded.py, test_adapters.py, test_readme.py) ---

# accelerate_configs/<name>.yaml -> what the run logs as setup/strategy; a config deleted with its feature drops out
ALL_STRATEGIES = {"fsdp": "FSDP2", "deepspeed_zero2": "DeepSpeed ZeRO-2", "deepspeed_zero3": "DeepSpeed ZeRO-3"}
STRATEGIES = {name: s for name, s in ALL_STRATEGIES.items() if (REPO / "accelerate_configs" / f"{name}.yaml").is_file()}


def needs_package(package: str, install: str):
    """Skip where `package` is not installed, found without importing it: importorskip("peft") would import
    transformers at collection (~3 s), in every pytest run and each copy that the removal checks collect."""
    missing = importlib.util.find_spec(package) is None
    return pytest.mark.skipif(missing, reason=f"{package} is not installed: {install}")


def strategy_params(without: tuple[str, ...] = ()):
    """The sharding configs as test parameters, DeepSpeed's skipped where it is not installed; `without` leaves some
    out (e.g. ZeRO-2 where whole parameters make it DDP's case)."""
    no_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="pip install deepspeed")
    return [
        pytest.param(config, marks=[no_deepspeed] if "deepspeed" in config else [])
        for config in STRATEGIES
        if config not in without
    ]


def readme_command(config: str) -> str:
    """The README's launch line of a strategy (tests/test_readme.py leaves these to tests/test_sharded.py's runs)."""
    return f"accelerate launch --config_file accelerate_configs/{config}.yaml train.py"


# --- the Hugging Face tasks on the tiny local models (tests/test_hf.py, test_adapters.py, test_sharded.py) ---


def classification(assets, *args) -> list[str]:
    return ["--task", "text_classification", "--model_name_or_path", assets["bert"], "--data_files", assets["data"],
            "--dropout", "0", "--learning_rate", "1e-3", "--logging_steps", "1", "--eval_steps", "1000",
            *args]  # fmt: skip


def language_modeling(assets, *args) -> list[str]:
    return ["--task", "language_modeling", "--model_name_or_path", assets["gpt2"], "--data_files", assets["data"],
            "--dropout", "0", "--learning_rate", "1e-3", "--logging_steps", "1", "--eval_steps", "1000",
            "--packing", "false", "--block_size", "64", *args]  # fmt: skip


def packed_from_scratch(assets, steps: int, *args) -> list[str]:
    """A one-layer GPT-2 trained from scratch on packed blocks of 64 tokens, 8 a step."""
    return language_modeling(assets, "--packing", "true", "--from_scratch", "true", "--config_overrides",
                             "n_layer=1,n_embd=32,n_head=2", "--max_steps", str(steps), "--per_device_train_batch_size",
                             "4", "--global_batch_size", "8", *args)  # fmt: skip


# 7 prompts (a prime: uneven shards on 2 and 3 processes), the last longer than the model's context (its end is kept)
PROMPTS = ["def", "import os", "# a comment", "return x", "class A:", "x = 1", "for i in " * 40]


def write_prompts(path: Path) -> Path:
    """PROMPTS as a JSON Lines file with ids p0, p1, ...: a language model's test split."""
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": text}) + "\n" for i, text in enumerate(PROMPTS)))
    return path


def predict_only(model_dir, prompts, output_dir) -> list[str]:
    """--do_train false: the language model at `model_dir` generates 8 tokens after each of the `prompts`."""
    return ["--task", "language_modeling", "--do_train", "false", "--do_eval", "false", "--do_predict", "true",
            "--model_name_or_path", str(model_dir), "--block_size", "64", "--max_new_tokens", "8",
            "--data_files", f"{{test: {prompts}}}", "--output_dir", str(output_dir)]  # fmt: skip


def predictions(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "predictions.jsonl").read_text().splitlines()]


def losses(output_dir) -> torch.Tensor:
    return torch.tensor(list(series(read_metrics(output_dir), "train/loss").values()))


def assert_same_training(runs: dict, steps: int) -> list[dict]:
    """Per-step train loss and final eval loss equal (1e-5) on 1 and 2 processes; returns the final eval rows."""
    one, two = (losses(runs[n]) for n in (1, 2))
    assert len(one) == steps
    torch.testing.assert_close(two, one, rtol=0, atol=1e-5)
    final = [last_row(read_metrics(runs[n])) for n in (1, 2)]
    assert final[1]["eval/loss"] == pytest.approx(final[0]["eval/loss"], abs=1e-5)
    return final


def lm_eval_loss(model_dir, eval_file, peft: bool = False) -> float:
    """A saved causal LM's mean token loss on the eval file, loaded as a user loads it: from_pretrained, or an adapter
    folder by PEFT's own loader (`peft`). In this process: a load needs nothing a fresh one would have."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if peft:
        from peft import AutoPeftModelForCausalLM as AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    total = count = 0.0
    with torch.no_grad():
        for row in (json.loads(line) for line in Path(eval_file).read_text().splitlines()):
            ids = tokenizer(row["text"], truncation=True, max_length=64, return_tensors="pt")["input_ids"]
            if ids.shape[1] > 1:
                logits = model(input_ids=ids).logits[0, :-1].float()
                total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
                count += ids.shape[1] - 1
    return total / count


# --- accelerate launch, resolved without launching ---


# --- the tiny GPT-2's 1-process reference, trained once per test run (tests/test_hf.py, test_sharded.py) ---


def padded_lm(assets, per_device: int) -> list[str]:
    """The tiny GPT-2, 8 steps of 16 padded texts (per_device x accumulation x processes), float32 (the sharded
    configs say bf16): the same training on any process count and strategy."""
    return language_modeling(assets, "--max_steps", "8", "--global_batch_size", "16",
                             "--per_device_train_batch_size", str(per_device), "--mixed_precision", "no")  # fmt: skip


def padded_lm_one_process(request, assets) -> Path:
    """padded_lm on 1 process, one batch of 16 a step: the run that 2 processes under DDP (tests/test_hf.py), FSDP2
    and ZeRO (tests/test_sharded.py) are compared with, trained once for all of them (built_once)."""
    from tests.conftest import assert_ok, built_once, run_main

    with built_once(request, "padded_lm_one_process") as (folder, missing):
        if missing:
            assert_ok(run_main(*padded_lm(assets, 16), "--output_dir", str(folder / "run")))
    return folder / "run"


def assert_gathers_as_collated(dataset, gathering=None):
    """One gather per batch (`gathering.gather`, by default the dataset's own: the index_batches feature's contract)
    gives what the DataLoader's default_collate stacks, contiguous."""
    from torch.utils.data import default_collate

    indices = torch.tensor([5, 0, 17, 5, 31])
    expected = default_collate([dataset[i] for i in indices.tolist()])
    got = (gathering or dataset).gather(indices)
    assert all(torch.equal(g, e) and g.is_contiguous() for g, e in zip(got, expected, strict=True))
