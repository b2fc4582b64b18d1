"""`--push_to_hub`: model/ uploaded to the Hugging Face Hub at the end of training (checked before it starts)."""

import logging
from dataclasses import dataclass
from pathlib import Path

from src import hub
from src.errors import UsageError
from src.features import Feature

logger = logging.getLogger(__name__)


@dataclass
class HubPushOptions:
    push_to_hub: bool = False  # upload model/ to the Hugging Face Hub at the end (checked before training starts)
    hub_model_id: str | None = None  # the Hub repository, user/name; None: the output_dir's folder name


class HubPush(Feature):
    Options = HubPushOptions

    def check(self, config) -> None:
        """Offline or without a token: said before training rather than after it."""
        if not self.options(config).push_to_hub:
            return
        from huggingface_hub import get_token

        if hub.offline():
            raise UsageError("--push_to_hub needs the Hugging Face Hub but HF_HUB_OFFLINE is set; unset one of them")
        if get_token() is None:
            raise UsageError("--push_to_hub needs a Hugging Face token: `hf auth login`, or set HF_TOKEN")

    def on_end(self, accelerator, config, model_dir: Path) -> None:
        """Main process: create the repository if needed and upload model/ (weights, config, tokenizer)."""
        options = self.options(config)
        if not (options.push_to_hub and accelerator.is_main_process):
            return
        from huggingface_hub import HfApi

        repo_id = options.hub_model_id or Path(config.output_dir).resolve().name
        api = HfApi()
        api.create_repo(repo_id, exist_ok=True)
        message = "Upload model trained with train.py"
        api.upload_folder(repo_id=repo_id, folder_path=str(model_dir), commit_message=message)
        logger.info("model pushed to https://huggingface.co/%s", repo_id)


FEATURE = HubPush()
