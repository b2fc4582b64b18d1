"""Optional features (src/features/, features.yaml): each reaches the run through the Feature seam with its own
options, and each can be deleted leaving the rest working (scripts/remove_feature.py --check, run here for all)."""

import dataclasses
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, command_env

FEATURES = list(yaml.safe_load((REPO / "features.yaml").read_text()) or {})


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
    assert options_of(EchoOptions, config) == EchoOptions(echo_every=3)
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

    Features([Recording("a"), Recording("b")]).on_checkpoint(None, None, "step_2", None)
    assert calls == [("a", "step_2"), ("b", "step_2")]


def test_every_path_of_the_manifest_exists_or_is_optional():
    """features.yaml names real files: a renamed or moved file would silently stay behind on removal. (Paths an
    unsplit requirements file or docs page would take may be absent.)"""
    manifest = yaml.safe_load((REPO / "features.yaml").read_text()) or {}
    missing = [
        path
        for feature in manifest.values()
        for path in feature["paths"]
        if not (REPO / path).exists() and not path.startswith(("requirements/", "docs/"))
    ]
    assert missing == []


@pytest.mark.slow
@pytest.mark.parametrize("name", FEATURES)
def test_removing_a_feature_leaves_the_rest_working(name):
    result = subprocess.run(
        [sys.executable, "scripts/remove_feature.py", "--check", name],
        cwd=REPO, env=command_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
