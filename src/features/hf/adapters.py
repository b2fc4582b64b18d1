"""LoRA adapters with PEFT for the Hugging Face tasks: `--peft lora` trains low-rank adapters, the base model frozen.

    python train.py --task language_modeling --model_name_or_path gpt2 --peft lora --lora_r 16
    python train.py --task text_classification --model_name_or_path bert-base-uncased --peft lora --merge_adapter true

`model/` holds the adapter (`adapter_config.json`, `adapter_model.safetensors`, the tokenizer) with its base model
as an absolute path or a Hub name, so PEFT's loaders (`AutoPeftModelFor...`) and `--model_name_or_path` find it from
any directory; `--merge_adapter true` saves the merged model instead, which `from_pretrained` and `pipeline` load.
Under FSDP2 and DeepSpeed the adapter is gathered from every shard (`accelerator.get_state_dict`) before saving.
`peft` is optional (requirements/hf.txt) and imported only when an adapter is used.
"""

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from src.errors import UsageError, one_line

ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class AdapterOptions:
    """The options every Hugging Face task has (names as in TRL's ModelConfig)."""

    peft: Literal["lora"] | None = None  # "lora": train LoRA adapters, the base model frozen; None: every weight
    lora_r: int = 8  # the adapters' rank
    lora_alpha: int = 16  # the adapters' scale is lora_alpha / lora_r
    lora_dropout: float = 0.0  # dropout on the adapters' input (> 0 makes 1 and N processes differ)
    lora_target_modules: list[str] | None = None  # e.g. [q_proj,v_proj]; None: PEFT's default for the architecture
    merge_adapter: bool = False  # model/ holds the base model with the adapter merged in, not the adapter alone

    def check_adapter_options(self) -> None:
        if self.lora_r <= 0 or self.lora_alpha <= 0:
            raise UsageError(f"--lora_r and --lora_alpha must be > 0 (got {self.lora_r}, {self.lora_alpha})")
        if not 0 <= self.lora_dropout < 1:
            raise UsageError(f"--lora_dropout must lie in [0, 1) (got {self.lora_dropout})")
        if self.merge_adapter and self.peft is None:
            raise UsageError("--merge_adapter true needs an adapter: add --peft lora")


def is_adapter_folder(path: str) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(folder: str) -> str:
    """The base model an adapter folder was trained on (adapter_config.json's base_model_name_or_path)."""
    return json.loads((Path(folder) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]


def require_peft():
    try:
        import peft
    except ImportError as err:
        raise UsageError("--peft lora needs PEFT: pip install -r requirements/hf.txt") from err
    return peft


def add_adapter(model, options: AdapterOptions, task_type: str):
    """`model` (a transformers model) with fresh LoRA adapters, only they (and a classifier's new head) trainable."""
    peft = require_peft()
    config = peft.LoraConfig(
        task_type=task_type,
        r=options.lora_r,
        lora_alpha=options.lora_alpha,
        lora_dropout=options.lora_dropout,
        target_modules=options.lora_target_modules,
        # GPT-2's projections are transformers' Conv1D, weights stored transposed: PEFT would warn and set it itself
        fan_in_fan_out=any(type(module).__name__ == "Conv1D" for module in model.modules()),
    )
    try:
        with quiet_peft():
            return peft.get_peft_model(model, config)
    except ValueError as err:  # an unknown module name, or an architecture PEFT has no default for
        raise UsageError(
            f"--peft lora on {type(model).__name__}: {one_line(err)} (set --lora_target_modules to names of its "
            f"Linear / Conv / Embedding modules: {', '.join(adaptable_names(model))})"
        ) from err


ADAPTABLE = ("Linear", "Conv1D", "Conv1d", "Conv2d", "Embedding")  # layer types PEFT's LoRA adapts (Conv1D: GPT-2's)


def adaptable_names(model) -> list[str]:
    """The last names of the model's modules that LoRA can adapt, as --lora_target_modules takes them (c_attn, ...)."""
    return sorted(
        {name.rpartition(".")[2] for name, module in model.named_modules() if type(module).__name__ in ADAPTABLE}
    )


def load_adapter(model, folder: str, trainable: bool):
    """The adapter saved in `folder` on `model`, its base; trained further when `trainable`."""
    peft = require_peft()
    with quiet_peft():
        return peft.PeftModel.from_pretrained(model, folder, is_trainable=trainable)


@contextlib.contextmanager
def quiet_peft():
    """PEFT's check of gradient checkpointing asks transformers 5 for its deprecated name: a FutureWarning that
    nothing in a run can change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def save_adapter(accelerator, model, directory: Path, base: str) -> None:
    """The adapter's weights alone, gathered from every process's shards, with `base` (absolute for a local folder)
    as its base model."""
    unwrapped = accelerator.unwrap_model(model)
    for config in unwrapped.peft_config.values():
        config.base_model_name_or_path = str(Path(base).resolve()) if Path(base).is_dir() else base
    unwrapped.save_pretrained(
        directory, is_main_process=accelerator.is_main_process, state_dict=accelerator.get_state_dict(model)
    )


def save_merged(accelerator, model, directory: Path, fresh_copy) -> None:
    """The base model with the adapter merged in, as a plain transformers model. The gathered weights are loaded
    into `fresh_copy()` (the same adapted model, built on the main process only) and merged there, so the model that
    trains is left as it is, whatever the strategy."""
    state = accelerator.get_state_dict(model)  # every process takes part; the full state dict on the main one
    if accelerator.is_main_process:
        copy = fresh_copy()
        copy.load_state_dict({key: value.cpu() for key, value in state.items()})
        copy.merge_and_unload().save_pretrained(directory)
    accelerator.wait_for_everyone()
