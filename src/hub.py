"""The Hugging Face Hub: whether a dataset or model can be reached (a fast, clear answer offline), and --push_to_hub."""

import logging
import os
from pathlib import Path

from src.config import TrainConfig
from src.errors import UsageError

logger = logging.getLogger(__name__)


def check_hub_repo(name: str, kind: str, flag: str, instead: str) -> None:
    """A Hub dataset or model that isn't cached: one request with a 10 s timeout, not ~23 s of retries.
    `kind`: "dataset" or "model"; `instead`: what to do offline."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    if is_cached(name, kind):
        return
    if hub_offline():
        raise UsageError(f"{kind} {name!r} is not in the local cache and HF_HUB_OFFLINE is set; {instead}")
    try:
        getattr(HfApi(), f"{kind}_info")(name, timeout=10)
    except RepositoryNotFoundError as err:
        raise UsageError(f"no {kind} {name!r} on the Hugging Face Hub; check {flag}") from err
    except Exception as err:  # DNS, proxy, timeout, HTTP: all mean "can't use the Hub from here"
        raise UsageError(
            f"cannot reach the Hugging Face Hub for {kind} {name!r} ({type(err).__name__}); "
            f"{instead}, or a cached copy with HF_HUB_OFFLINE=1"
        ) from err


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub's own constant is read once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "")


def is_cached(name: str, kind: str = "dataset") -> bool:
    from huggingface_hub.constants import HF_HUB_CACHE

    return (Path(HF_HUB_CACHE) / f"{kind}s--{name.replace('/', '--')}").exists()


def check_hub_push(config: TrainConfig) -> None:
    """--push_to_hub: offline or without a token, say so before training rather than after it."""
    if not config.push_to_hub:
        return
    from huggingface_hub import get_token

    if hub_offline():
        raise UsageError("--push_to_hub needs the Hugging Face Hub but HF_HUB_OFFLINE is set; unset one of them")
    if get_token() is None:
        raise UsageError("--push_to_hub needs a Hugging Face token: `hf auth login`, or set HF_TOKEN")


def push_to_hub(accelerator, config: TrainConfig, model_dir: Path) -> None:
    """Main process: create the repository if needed and upload model/ (weights, config, tokenizer)."""
    if not (config.push_to_hub and accelerator.is_main_process):
        return
    from huggingface_hub import HfApi

    repo_id = config.hub_model_id or Path(config.output_dir).resolve().name
    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(model_dir), commit_message="Upload model trained with train.py")
    logger.info("model pushed to https://huggingface.co/%s", repo_id)
