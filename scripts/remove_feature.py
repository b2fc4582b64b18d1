"""Remove an optional feature (features.yaml lists each one's files), or prove in a copy that removing it is safe.

python scripts/remove_feature.py NAME            # delete NAME's files from this checkout
python scripts/remove_feature.py --keep NAME     # delete every feature but NAME and those it requires
python scripts/remove_feature.py --check NAME    # in a copy without them: the remaining tests collect, the
                                                 # core's quick tests (a short run) and ruff's error checks pass,
                                                 # none of their options is left, and where code under src/ went,
                                                 # a 2-process launch trains
python scripts/remove_feature.py --check --each  # that check for every feature in turn, 2 at a time, without the
                                                 # 2-process launch (CI runs it)
python scripts/remove_feature.py --list          # the features and what each is for
"""

import argparse
import ast
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    import yaml
except ModuleNotFoundError:  # a Python without the project's packages (python3, not .venv's)
    print("error: scripts/remove_feature.py reads features.yaml with PyYAML, which this Python lacks: run it with "
          ".venv/bin/python (bash scripts/setup.sh makes .venv)", file=sys.stderr)  # fmt: skip
    sys.exit(2)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: scripts/ is on the path, not the repository

from scripts.launch import free_port  # noqa: E402

SHORT_RUN = ["--max_steps", "4", "--logging_steps", "2", "--eval_steps", "4", "--max_eval_samples", "64"]
# The core's quick tests, run in every copy (`pytest -k`: the modules' files): the command line and config (with a short
# run of train.py's main in the test process: tests/test_config.py), the tasks
CORE_QUICK_TESTS = "test_config.py or test_tasks.py"


def manifest() -> dict:
    # {}: every feature removed; libyaml's loader where PyYAML has it (the fast tests ask for it 89 times: 2 ms, not 31)
    return yaml.load((REPO / "features.yaml").read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}


def refuse(message: str):
    """Bad input: one line, exit 2, nothing removed."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def with_dependents(names: list[str]) -> list[str]:
    """`names` and every feature that requires one of them (transitively): what removing them removes."""
    return closure(names, lambda features, name: [other for other in features if name in requirements(features, other)])


def with_requirements(names: list[str]) -> list[str]:
    """`names` and every feature they require (transitively): what keeping them keeps."""
    return closure(names, requirements)


def requirements(features: dict, name: str) -> list[str]:
    return features[name].get("requires", [])


def closure(names: list[str], linked) -> list[str]:
    """`names` and, transitively, the features `linked(features, name)` gives for each; an unknown name refused."""
    features, found = manifest(), list(names)
    for name in found:
        if name not in features:
            refuse(f"no feature {name!r} in features.yaml; one of: {', '.join(features)}")
        found += [other for other in linked(features, name) if other not in found]
    return found


def feature_paths(name: str, root: Path) -> list[Path]:
    features = manifest()
    if name not in features:
        refuse(f"no feature {name!r} in features.yaml; one of: {', '.join(features)}")
    return [root / path for path in features[name]["paths"] if (root / path).exists()]


# What removes and checks features: it goes with the last feature (nothing is left to remove), as what the pages say
# of features in general does (the lines and regions marked `any`).
MACHINERY = ("scripts/remove_feature.py", "tests/test_lean_core.py")


def remove(name: str, root: Path) -> list[Path]:
    """Delete the feature's files and its features.yaml entry, then what other pages (README, docs/, the accelerate
    configs' comments) say of it: marked lines and regions (`strip_mentions`), and its options' tables in
    docs/config.md (as scripts/config_reference.py would write them without it; read as text, so that a copier task
    can run this without torch). The last feature takes MACHINERY along."""
    removed = feature_paths(name, root)
    for path in removed:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in (root / listed for listed in manifest()[name]["paths"]):  # removed, or left out by copier
        with contextlib.suppress(OSError):  # a folder it leaves empty goes too (requirements/tools/), else it stays
            path.parent.rmdir()
    manifest_file = root / "features.yaml"  # its entry goes too: the text, so that the comments stay
    manifest_file.write_text(
        re.sub(rf"^{re.escape(name)}:\n(?:[ #].*\n|\n)*", "", manifest_file.read_text(), flags=re.M)
    )
    left = list(yaml.safe_load(manifest_file.read_text()) or {})
    edit_pages(root, lambda text: strip_mentions(strip_options_tables(text, name), name, left))
    if (copier := root / "copier.yml").is_file():  # the generator's questions offer it no more
        copier.write_text(strip_from_copier(copier.read_text(), name))
    if not left:
        machinery = [root / path for path in MACHINERY if (root / path).is_file()]
        for path in machinery:
            path.unlink()
        removed += machinery
    return removed


def strip_from_copier(text: str, name: str) -> str:
    """copier.yml without the feature: its choice, its paths' exclusions, the validator's clauses naming it."""
    text = re.sub(rf"^  - \"{{% if '{name}' not in features %}}.*\n", "", text, flags=re.M)
    text = re.sub(rf"^    - \['{name}: .*', {name}\]\n", "", text, flags=re.M)
    clause = r"{% if '\w+' in features and '\w+' not in features %}[^{]*{% endif %}"
    return re.sub(clause, lambda found: "" if f"'{name}'" in found.group(0) else found.group(0), text)


def edit_pages(root: Path, edit) -> None:
    """`edit` applied to the text of README.md, docs/*.md, the accelerate configs (whose comments may name a
    feature's script) and features.yaml's comments."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted(root.glob("accelerate_configs/*.yaml"))]
    for page in [*pages, root / "features.yaml"]:
        if page.is_file():
            text = page.read_text()
            if (edited := edit(text)) != text:
                page.write_text(edited)


def remove_all(names: list[str], root: Path) -> list[Path]:
    return [path for name in names for path in remove(name, root)]


def strip_mentions(text: str, name: str, left=()) -> str:
    """The text without what it says of feature `name`: each line ending in `[feature: NAMES]` (shown: it tells the
    reader which feature a line is about) or `<!-- feature: NAMES -->`, and each region from a line
    `<!-- feature: NAMES -->` to the next line `<!-- /feature -->`, markers included. NAMES is one feature or several
    (`<!-- feature: slurm ray -->`, `any`: every one): what they mark goes with the last of them (`left`: the features
    that stay); until then their markers name the others."""
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        marked = re.search(r"(?:<!-- feature: ([\w ]+) -->|\[feature: ([\w ]+)\])$", stripped)
        names = (marked.group(1) or marked.group(2)).split() if marked else []
        goes = bool(names) and goes_with(name, names, left)
        if skipping:
            skipping = stripped != "<!-- /feature -->"
        elif goes and stripped.startswith("<!-- feature:"):
            skipping = True
        elif not goes:
            if name in names:  # it stays for the other features it names
                others = " ".join(other for other in names if other != name)
                marker = f"<!-- feature: {others} -->" if marked.group(1) else f"[feature: {others}]"
                head, _, tail = line.rpartition(marked.group(0))
                line = head + marker + tail
            kept.append(line)
    return "".join(kept)


def goes_with(name: str, names: list[str], left) -> bool:
    """Whether text marked with `names` goes when feature `name` does and the features `left` stay."""
    if names == ["any"]:
        return not left
    return name in names and not set(names) & set(left)


def strip_options_tables(text: str, name: str) -> str:
    """docs/config.md's reference without the tables of feature `name`'s options and tasks: each blank-line-separated
    block whose heading names `src/features/NAME/`, with its table."""
    return re.sub(rf"\n\n[^\n]*`src/features/{re.escape(name)}/[^\n]*\n\n(?:\|[^\n]*\n)*\|[^\n]*", "", text)


def copy_of_repo(destination: Path) -> Path:
    """The tracked and not-ignored files of this checkout, as a clone would have them (and uncommitted edits); outside
    a git checkout, its files but the virtual environment, runs and caches."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if listed.returncode != 0:  # not a git checkout (e.g. a generated project before `git init`)
        skipped = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", ".*_cache", "wandb")
        shutil.copytree(REPO, destination, ignore=skipped, dirs_exist_ok=True)
        return destination
    for name in filter(None, listed.stdout.split("\0")):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def copy_bytecode(root: Path) -> None:
    """The bytecode this checkout's runs compiled, into its copy `root`, so that the copy's processes don't compile it
    all again (~1 CPU-s each): a .pyc holds its source's time and size (copy2 kept both), so a file changed since, or
    gone, is compiled afresh or never read."""
    for folder in {path.parent.relative_to(root) for path in root.glob("**/*.py")}:
        if (REPO / folder / "__pycache__").is_dir():
            shutil.copytree(REPO / folder / "__pycache__", root / folder / "__pycache__", dirs_exist_ok=True)


def feature_options(name: str) -> list[str]:
    """The options (`--NAME` flags, config.yaml keys) a feature with code in src/features/ adds: its Options' fields."""
    if not (REPO / "src" / "features" / name).is_dir():
        return []
    import dataclasses
    import importlib

    sys.path.insert(0, str(REPO))
    options = importlib.import_module(f"src.features.{name}").FEATURE.Options
    return [field.name for field in dataclasses.fields(options)] if options else []


def check(names: list[str], tests: str, launch: bool = True) -> int:
    """Remove `names` in a copy, then run what must still work there; 0 when all of it does. `tests`: none, or the
    remaining suite's fast tier or all of it too; `launch`: a 2-process launch too, where code under src/ went."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # what the copy's processes import is compiled once, not by each
    options = [option for name in names for option in feature_options(name)]
    name = "+".join(names)
    with tempfile.TemporaryDirectory(prefix="without_") as folder:
        root = copy_of_repo(Path(folder))
        removed = remove_all(names, root)
        copy_bytecode(root)
        print(f"without {name}: removed {', '.join(str(p.relative_to(root)) for p in removed)}", flush=True)
        if left := fields_named(options, root):
            print(f"without {name}: its options are left: {', '.join(left)}", file=sys.stderr)
            return 1
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml"]
        steps = {}
        if tests == "none":  # (a test run below collects every remaining module itself, slow ones included)
            quick = ["-n", "0", "-m", "not slow", "-k", CORE_QUICK_TESTS]
            steps["the remaining tests collect, the core's quick tests (a short run too) pass"] = [*pytest, *quick]
        # what a removal can break, as tests/test_project.py checks: syntax errors, undefined names (style is CI's lint,
        # over the repository: a forker's long line in train.py fails no test)
        steps["ruff"] = [sys.executable, "-m", "ruff", "check", "--select", "E9,F63,F7,F82", "."]
        # Code under src/ went: a 2-process run too. (Files elsewhere, scripts and configs, are imported by no run:
        # tests/test_layout.py proves the core imports no feature.)
        if launch and any(path.is_relative_to(root / "src") for path in removed):
            port = ["--main_process_port", str(free_port())]  # not 29500: other checks may run beside this one
            steps["a 2-process launch"] = [*launcher, *port, "--num_processes", "2", "train.py", *SHORT_RUN,
                                           "--output_dir", str(root / "runs/two")]  # fmt: skip
        if tests != "none":
            # the fast tier in one process (tests/test_lean_core.py runs it inside the suite, whose workers keep the
            # cores busy): pytest-xdist's workers would each import and collect it all again, ~18 CPU-s (2026-12-05)
            selection = ["-n", "0", "-m", "not slow"] if tests == "fast" else []
            steps[f"the remaining tests ({tests})"] = [*pytest, *selection]
        for what, command in steps.items():
            result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
            if result.returncode != 0:
                print(f"without {name}: {what} failed (exit {result.returncode})\n"
                      f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}", file=sys.stderr)  # fmt: skip
                return 1
            print(f"without {name}: {what}: ok", flush=True)
    return 0


def fields_named(names: list[str], root: Path) -> list[str]:
    """Where a class under `root`'s src/ or train.py still declares a field of `names` (e.g. a removed feature's
    option left in TrainConfig, a dead flag and config.yaml key): "path: name" each."""
    found = []
    for path in [root / "train.py", *sorted(root.glob("src/**/*.py"))]:
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:  # the check's ruff step names it
            continue
        classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
        declared = [item.target.id for node in classes for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]  # fmt: skip
        found += [f"{path.relative_to(root)}: {field}" for field in declared if field in names]
    return found


def check_each(names: list[str], jobs: int, launch: bool) -> int:
    """`check` without each of `names` in turn (with the features that require it), `jobs` at a time, each in a
    process of its own; 0 when every one passes. One line each, in `names`' order; a failure's output follows it."""
    import concurrent.futures

    def one(name: str) -> tuple[str, int, str, float]:
        start = time.perf_counter()
        command = [sys.executable, __file__, "--check", "--launch" if launch else "--no-launch", name]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        return name, result.returncode, result.stdout + result.stderr, time.perf_counter() - start

    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for name, code, output, seconds in pool.map(one, names):
            print(f"without {name}: {'ok' if code == 0 else 'FAILED'} ({seconds:.0f} s)", flush=True)
            if code != 0:
                failed.append(name)
                print(output, file=sys.stderr, flush=True)
    if failed:
        print(f"removing {', '.join(failed)} breaks the rest: see above", file=sys.stderr)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help="features of features.yaml")
    parser.add_argument("--all", action="store_true", help="every feature")
    parser.add_argument("--keep", action="store_true", help="every feature but NAMEs and what they require")
    parser.add_argument("--check", action="store_true", help="prove in a copy that removing them is safe")
    parser.add_argument("--tests", choices=["none", "fast", "all"], default="none", help="--check: run these too")
    parser.add_argument("--each", action="store_true", help="--check: each feature (or NAME) alone, in turn")
    parser.add_argument("--launch", action=argparse.BooleanOptionalAction,
                        help="--check: a 2-process launch too, where code under src/ went (default: yes; with --each, "
                             "no: each removal's quick tests run train.py's main already)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="--each: checks at a time")
    parser.add_argument("--list", action="store_true", help="list the features")
    args = parser.parse_args()
    if args.keep and (args.all or not args.names):
        refuse("--keep takes the features to keep (`--keep images`), not --all or none; --all removes every feature")
    if args.each and not args.check:
        refuse("--each goes with --check: `--check --each` checks the removal of each feature in turn")
    if args.each:
        with_dependents(args.names)  # an unknown name refused
        return check_each(args.names or list(manifest()), max(1, args.jobs), bool(args.launch))
    if args.keep:
        kept = with_requirements(args.names)
        names = [name for name in manifest() if name not in kept]
    else:
        names = list(manifest()) if args.all else with_dependents(args.names)
    if args.list or not names:
        for name, feature in manifest().items():
            print(f"{name:16} {feature['help']}")
        return 0
    if args.check:
        return check(names, args.tests, args.launch is not False)
    for path in remove_all(names, REPO):
        print(f"removed {path.relative_to(REPO)}")
    if args.keep and (install := requirements_install(kept, REPO)):
        print(f"what the kept features need: {install}")
    return 0


def requirements_install(features: list[str], root: Path) -> str | None:
    """The pip command installing `features`' own requirements files (the Quickstart's training install has the
    core's only); None where they have none."""
    files = [path.relative_to(root) for name in features for path in feature_paths(name, root) if is_requirements(path)]
    return f".venv/bin/pip install {' '.join(f'-r {file}' for file in files)}" if files else None


def is_requirements(path: Path) -> bool:
    """A feature's own requirements file, requirements/NAME.txt (requirements/tools/ holds what its tests start)."""
    return path.parent.name == "requirements" and path.suffix == ".txt"


if __name__ == "__main__":
    sys.exit(main())
