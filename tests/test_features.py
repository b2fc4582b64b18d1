"""Optional features (src/features/, features.yaml): each reaches the run through the Feature seam with its own
options, and each can be deleted leaving the rest working (checked here for each)."""

import ast
import contextlib
import dataclasses
import functools
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, manifest
from tests.helpers import imported_names, needs

FEATURES = list(manifest())


@dataclasses.dataclass
class EchoOptions:
    echo_every: int = 0  # a made-up feature's option

    def __post_init__(self):
        from src.errors import UsageError

        if self.echo_every < 0:
            raise UsageError("--echo_every must be >= 0")


def test_a_features_options_join_the_command_line_typed_and_checked(monkeypatch, tmp_path):
    """An installed feature's Options: flags like any other, typed, in config.yaml's flat form, checked by the
    feature's own dataclass; not installed, the same flag is refused."""
    import src.cli
    from src.errors import UsageError
    from src.features import options_of

    monkeypatch.setattr(src.cli, "option_classes", lambda: [EchoOptions])
    config = src.cli.parse_config(["--echo_every", "3"])
    assert options_of(EchoOptions, config.feature_args) == EchoOptions(echo_every=3)
    assert config.to_dict()["echo_every"] == 3
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(config.to_dict()))
    assert src.cli.parse_config(["--config", str(saved)]) == config  # config.yaml runs the same again
    with pytest.raises(UsageError, match="--echo_every must be >= 0"):
        src.cli.parse_config(["--echo_every", "-1"])
    monkeypatch.setattr(src.cli, "option_classes", lambda: [])
    with pytest.raises(UsageError, match="echo_every"):
        src.cli.parse_config(["--echo_every", "3"])


def test_features_are_found_by_looking_and_called_in_turn():
    """Every package in src/features/ is a feature, each listed in features.yaml; `Features` calls each hook."""
    from src.features import Feature, Features, installed

    packages = sorted(p.name for p in (REPO / "src" / "features").iterdir() if (p / "__init__.py").is_file())
    assert [type(f).__module__.rsplit(".", 1)[1] for f in installed()] == packages
    assert set(packages) <= set(FEATURES), "a feature package missing from features.yaml"
    calls = []

    class Recording(Feature):
        def __init__(self, name):
            self.name = name

        def on_checkpoint(self, accelerator, config, checkpoint, state):
            calls.append((self.name, checkpoint))

        def adapt_model(self, model, accelerator):
            return [*model, self.name]

        def train_loader(self, task, config, pin_memory):
            return self.name if self.name == "b" else None

        def train_metrics(self, metrics, accelerator, task):
            return {**metrics, self.name: task}

    features = Features([Recording("a"), Recording("b")])
    features.on_checkpoint(None, None, "step_2", None)
    assert calls == [("a", "step_2"), ("b", "step_2")]
    assert features.adapt_model([], None) == ["a", "b"]  # chained: each feature given the previous one's model
    assert features.train_loader(None, None, False) == "b"  # the first answer that is not None
    assert features.train_metrics({"train/loss": 1.0}, None, "task") == {"train/loss": 1.0, "a": "task", "b": "task"}


def test_every_path_of_the_manifest_exists_or_is_optional():
    """features.yaml names real files: a renamed or moved file would silently stay behind on removal. (Paths an
    unsplit requirements file or docs page would take may be absent.)"""
    missing = [
        path
        for feature in manifest().values()
        for path in feature["paths"]
        if not (REPO / path).exists() and not path.startswith(("requirements/", "docs/"))
    ]
    assert missing == []


def module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # each file's, once for every feature's test below
def top_level_imports(path: Path) -> frozenset[str]:
    """The modules a file imports when it is imported: its module-level statements (a function's own imports run
    only when called, as a feature's optional use of another does)."""
    body = ast.parse(path.read_text()).body  # and what an `if` or `try` at the top holds
    return frozenset(
        imported_names(
            inner for node in body for inner in (ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node])
        )
    )


@pytest.mark.parametrize("name", FEATURES)
def test_removing_a_feature_leaves_nothing_that_needs_it(name):
    """What removing `name` leaves (checked here in place, in a second; `scripts/remove_feature.py --check NAME`
    runs the real thing in a copy, and tests/test_lean_core.py removes them all and trains and tests what is left):
    no remaining module imports its code when imported, and no remaining page links to its pages or names it (`hf` in
    backquotes; a name with an underscore, `object_storage`, as a word) once its marked lines are gone (the
    generator's pages, which name features as examples, apart)."""
    from scripts.remove_feature import feature_paths, strip_mentions, strip_options_tables, with_dependents

    names = with_dependents([name])  # a feature that requires this one goes with it
    removed = [path for one in names for path in feature_paths(one, REPO)]
    gone = [p for path in removed for p in ([path] if path.is_file() else sorted(path.rglob("*"))) if p.is_file()]
    gone_modules = {module_name(p.relative_to(REPO)) for p in gone if p.suffix == ".py"}
    remaining = [p for p in [REPO / "train.py", *REPO.glob("src/**/*.py"), *REPO.glob("scripts/**/*.py"),
                             *REPO.glob("tests/*.py")] if p not in gone]  # fmt: skip
    importing = {
        str(p.relative_to(REPO)): sorted(m for m in top_level_imports(p) if m in gone_modules)
        for p in remaining
        if top_level_imports(p) & gone_modules
    }
    assert importing == {}, f"without {name} these fail to import"
    gone_pages = {p.relative_to(REPO).as_posix() for p in gone if p.suffix == ".md"}
    links, named = [], []
    naming = [re.compile(rf"`{one}`" + (rf"|(?<![\w/-]){one}(?![\w/-])" if "_" in one else "")) for one in names]
    about_features = set(manifest().get("generator", {}).get("paths", []))
    for page in [REPO / "README.md", *REPO.glob("docs/*.md")]:
        if page.relative_to(REPO).as_posix() in gone_pages:
            continue
        text = page.read_text()
        for one in names:
            text = strip_mentions(strip_options_tables(text, one), one, left=[o for o in FEATURES if o not in names])
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            resolved = (page.parent / target).resolve()
            if resolved.is_relative_to(REPO) and resolved.relative_to(REPO).as_posix() in gone_pages:
                links.append(f"{page.relative_to(REPO)} -> {target}")
        if page.relative_to(REPO).as_posix() not in about_features:
            lines = [line for line in text.splitlines() if any(pattern.search(line) for pattern in naming)]
            named += [f"{page.relative_to(REPO)}: {line}" for line in lines]
    assert links == [], f"without {name} these links break (mark the line: [feature: {name}])"
    assert named == [], f"without {name} these lines name it (mark the line: [feature: {name}])"


@pytest.mark.parametrize("name", [name for name in FEATURES if (REPO / "src/features" / name).is_dir()])
def test_a_features_options_are_declared_in_its_own_package_only(name):
    """Its options (flags, config.yaml keys) go with it: no class outside its package declares a field of that name
    (TrainConfig's, another feature's), which `--check` would find left as a dead option."""
    from scripts.remove_feature import feature_options, fields_named

    options = feature_options(name)
    elsewhere = [where for where in fields_named(options, REPO) if not where.startswith(f"src/features/{name}/")]
    assert elsewhere == []


@pytest.mark.skipif(not FEATURES, reason="scripts/remove_feature.py went with the last feature")
def test_the_check_finds_an_option_left_declared_as_a_field(tmp_path):
    """`--check`'s look for a removed feature's options, shown able to fail: a field left in a class is named."""
    from scripts.remove_feature import fields_named

    (tmp_path / "src").mkdir()
    (tmp_path / "train.py").write_text("push_to_hub = True  # a variable, not a field\n")
    (tmp_path / "src/config.py").write_text("class TrainConfig:\n    seed: int = 1\n    push_to_hub: bool = False\n")
    (tmp_path / "src/broken.py").write_text("class Half(:\n")  # not Python: ruff's step says so, not this one
    assert fields_named(["push_to_hub", "hub_model_id"], tmp_path) == ["src/config.py: push_to_hub"]


def test_the_static_removal_check_sees_a_top_level_import(tmp_path):
    """The check above, shown able to fail: a core module importing a feature's module at its top is found."""
    (tmp_path / "core.py").write_text("import os\nfrom src.features.gpt.model import GPT\ndef f():\n    import x\n")
    assert "src.features.gpt.model" in top_level_imports(tmp_path / "core.py")
    assert "x" not in top_level_imports(tmp_path / "core.py")


@needs("gpt", "images")
def test_keep_removes_every_other_feature_but_what_the_kept_ones_require(tmp_path):
    """`remove_feature.py --keep gpt images` in a copy: gpt's requirement (text_data) stays, every other feature goes,
    files and manifest entries both."""
    from scripts.remove_feature import copy_of_repo

    project = copy_of_repo(tmp_path / "project")
    refused = subprocess.run([sys.executable, "scripts/remove_feature.py", "--keep"], cwd=project, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and refused.stderr.startswith("error: --keep takes the features to keep")
    bare = [sys.executable, "-S", "scripts/remove_feature.py", "--keep", "images"]  # -S: no site-packages, no PyYAML
    bare = subprocess.run(bare, cwd=project, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and bare.stderr.startswith("error: scripts/remove_feature.py reads features.yaml with ")
    script = [sys.executable, "scripts/remove_feature.py", "--keep", "gpt", "images"]
    result = subprocess.run(script, cwd=project, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # the images feature needs Pillow, which the Quickstart's training install leaves out; gpt has no file of its own
    assert result.stdout.endswith("what the kept features need: .venv/bin/pip install -r requirements/images.txt\n")
    assert set(yaml.safe_load((project / "features.yaml").read_text())) == {"gpt", "images", "text_data"}
    packages = {p.name for p in (project / "src" / "features").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages == {"gpt", "images"}
    assert (project / "scripts/prepare_text.py").is_file() and not (project / "scripts/ray_train.py").exists()
    assert not (project / "requirements/tools").exists()  # object_storage's file was all it held
    assert "## Clusters" not in (project / "docs/launching.md").read_text()  # its region names slurm, ray, ...
    install = (project / "docs/install.md").read_text()  # its table's region stays for images, marked for it alone
    assert "`requirements/images.txt`" in install and "<!-- feature: images -->" in install


@pytest.mark.skipif(not FEATURES, reason="scripts/remove_feature.py went with the last feature")
def test_a_marked_line_or_region_goes_with_the_last_feature_it_names():
    """A marker names one feature, several or `any` (every one); what it marks goes when none of them is left."""
    from scripts.remove_feature import strip_mentions

    region = "<!-- feature: x y -->\nc\n<!-- /feature -->\n"
    text = f"a\nb [feature: x]\n{region}d [feature: any]\ne\n"
    assert strip_mentions(text, "x", left=["y"]) == f"a\n{region.replace('x y', 'y')}d [feature: any]\ne\n"
    assert strip_mentions(text, "x", left=["z"]) == "a\nd [feature: any]\ne\n"
    assert strip_mentions(text, "x", left=[]) == "a\ne\n"


def test_every_marker_names_features_of_the_manifest():
    """A marker whose name is misspelt (or whose feature was renamed) would never be taken out."""
    pages = [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("accelerate_configs/*.yaml")]
    pages.append(REPO / "features.yaml")
    marked = {
        f"{page.relative_to(REPO)}: {name}"
        for page in pages
        for names in re.findall(r"(?:<!-- feature: ([\w ]+) -->|\[feature: ([\w ]+)\])$", page.read_text(), re.M)
        for name in " ".join(names).split()
    }
    assert {entry for entry in marked if entry.split(": ")[1] not in [*FEATURES, "any"]} == set()


@needs("profiler", "hub_push")
@pytest.mark.slow
def test_check_each_names_the_removal_that_breaks_the_rest(tmp_path):
    """`--check --each` (what CI runs for every feature): in a copy whose core imports the profiler, removing the
    profiler fails and is named, removing hub_push passes, and the exit code says so. Port 29500, the launcher's
    default, is taken meanwhile: checks run two at a time, so each 2-process launch must find a port of its own."""
    from scripts.remove_feature import copy_of_repo

    project = copy_of_repo(tmp_path / "project")
    refused = subprocess.run([sys.executable, "scripts/remove_feature.py", "--each"], cwd=project, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and refused.stderr.startswith("error: --each goes with --check")
    loaders = project / "src/loaders.py"
    loaders.write_text(loaders.read_text() + "\nfrom src.features import profiler  # noqa: E402, F401\n")
    script = [sys.executable, "scripts/remove_feature.py", "--check", "--each", "profiler", "hub_push"]
    with socket.socket() as default_port:
        with contextlib.suppress(OSError):  # in use already: as good
            default_port.bind(("", 29500))
            default_port.listen()
        result = subprocess.run(script, cwd=project, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "without profiler: FAILED" in result.stdout and "without hub_push: ok" in result.stdout
    assert "removing profiler breaks the rest" in result.stderr
