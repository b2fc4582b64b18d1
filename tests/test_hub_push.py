"""--push_to_hub (src/features/hub_push/): refused before training when the Hub can't be reached or no token is set."""

import pytest

from tests.conftest import QUICK, run_main


def test_push_to_hub_needs_the_hub_and_a_token(monkeypatch):
    from src.cli import parse_config
    from src.errors import UsageError
    from src.features.hub_push import FEATURE

    FEATURE.check(parse_config([]))  # not asked: nothing checked
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UsageError, match="HF_HUB_OFFLINE is set"):
        FEATURE.check(parse_config(["--push_to_hub", "true"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "false")  # as huggingface_hub reads it: online ...
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")  # ... but for transformers' own setting, which it reads too
    with pytest.raises(UsageError, match="HF_HUB_OFFLINE is set"):
        FEATURE.check(parse_config(["--push_to_hub", "true"]))
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(UsageError, match="needs a Hugging Face token"):
        FEATURE.check(parse_config(["--push_to_hub", "true"]))


def test_push_to_hub_offline_is_refused_before_training(tmp_path):
    out = tmp_path / "run"
    result = run_main(*QUICK, "--output_dir", str(out), "--push_to_hub", "true", "--hub_model_id", "me/digits")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --push_to_hub needs the Hugging Face Hub but HF_HUB_OFFLINE is set; unset one of them"
    )
    assert not out.exists()
