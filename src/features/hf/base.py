"""What the Hugging Face tasks share: loading a model, config and tokenizer (a local folder or the Hub, failing fast
offline), tokenising once on the main process first, and saving the result with `save_pretrained`.

`transformers` is optional: `pip install -r requirements/hf.txt` (`scripts/setup.sh --dev` installs it for the tests).
"""

from contextlib import contextmanager, nullcontext
from pathlib import Path

from src.data import check_columns, check_complete, load_splits
from src.errors import UsageError
from src.features.hf.adapters import (
    adapter_base,
    add_adapter,
    is_adapter_folder,
    load_adapter,
    save_adapter,
    save_merged,
)
from src.final_model import saved_model_dir
from src.hub import check_hub_repo
from src.tasks.base import Task
from src.tasks.classification import label_maps, saved_labels


class HuggingFaceTask(Task):
    """A transformers model and its tokenizer: what text_classification and language_modeling share. The model is
    `--model_name_or_path` (a run's field: a folder, a checkpoint or a Hub name); the Options have `tokenizer_name`,
    `config_overrides` and `dropout`, and those of src/features/hf/adapters.py (`--peft lora`)."""

    export_checkpoints = True  # every checkpoint's model/ loads with from_pretrained (or PEFT's loaders) too
    peft_task_type: str  # PEFT's TaskType for an adapter on this task's model, e.g. "CAUSAL_LM"
    adapter_path: str | None = None  # --model_name_or_path an adapter folder: the adapter, on its base model_path
    adapted = False  # the model has adapters: model/ holds them (or the merged model)

    def load_text_splits(self, columns: list[str], flags: str, names: list[str] | None = None) -> list:
        """The model source checked, the tokenizer loaded (self.tokenizer), then the splits `names` (default:
        train and eval), each checked for `columns`, none of them with a missing value."""
        self.load_tokenizer()
        names = names or [self.config.train_split, self.config.eval_split]
        splits = load_splits(self.config, names)
        for name in names:
            check_columns(splits[name], columns, flags, name)
            check_complete(splits[name], columns, name)
        return [splits[name] for name in names]

    def load_tokenizer(self) -> None:
        """The model source checked, then self.tokenizer loaded (also for a streamed train split)."""
        require_transformers()
        self.model_path = check_model_source(self.config.model_name_or_path)
        if is_adapter_folder(self.model_path):  # the tokenizer saved with the adapter; the weights of its base
            self.adapter_path = self.model_path
            self.model_path = check_model_source(adapter_base(self.adapter_path), "the adapter's base model")
        self.tokenizer = load_tokenizer(self.options.tokenizer_name or self.adapter_path or self.model_path)

    def load_model(self, path: str):
        """build_model() (from_pretrained of --model_name_or_path, or of an adapter's base), with the adapter
        saved in an adapter folder (trained further when training), or fresh ones with --peft lora."""
        # under an adapter, the base's report of a classifier head "newly initialized" is wrong: the adapter brings it
        with errors_only_from_transformers() if self.adapter_path else nullcontext():
            model = self.build_model()
        if self.adapter_path:
            self.adapted = True
            return load_adapter(model, self.adapter_path, trainable=self.config.do_train)
        if self.options.peft and self.config.do_train:
            self.adapted = True
            return add_adapter(model, self.options, self.peft_task_type)
        return model

    def model_config(self, **settings):
        labels = saved_labels(self.adapter_path) if self.adapter_path else None  # a classifier adapter's
        if labels is not None:
            settings = {**label_maps(labels), **settings}
        return load_config(self.model_path, self.options.config_overrides, self.options.dropout, **settings)

    def save_model(self, accelerator, model, directory: Path) -> None:
        """A plain model with save_pretrained; an adapter alone with its base's path; or the merged model."""
        if not self.adapted:
            save_pretrained(accelerator, model, self.tokenizer, directory)
            return
        if self.options.merge_adapter:
            save_merged(accelerator, model, directory, fresh_copy=lambda: self.load_model(self.model_path))
        else:
            save_adapter(accelerator, model, directory, base=self.model_path)
        if accelerator.is_main_process:
            self.tokenizer.save_pretrained(directory)


def check_dropout(dropout: float | None) -> None:
    """The `dropout` option of the Hugging Face tasks: None (the model's own) or a probability."""
    if dropout is not None and not 0 <= dropout < 1:
        raise UsageError(f"--dropout must lie in [0, 1) (got {dropout})")


def require_transformers():
    try:
        import transformers
    except ImportError as err:
        raise UsageError("the Hugging Face tasks need transformers: pip install -r requirements/hf.txt") from err
    transformers.utils.logging.disable_progress_bar()  # loading and saving bars: the log lines say it already
    return transformers


def check_model_source(name: str | None, flag: str = "--model_name_or_path") -> str:
    """A local folder, a cached Hub model, or a Hub model reachable now; otherwise one line saying what to do."""
    if not name:
        raise UsageError(f"set {flag} to a local model folder or a Hub name (e.g. bert-base-uncased)")
    if Path(name).is_dir():
        name = str(saved_model_dir(name))  # a run's output_dir or checkpoint: its exported model/
        if not (Path(name) / "config.json").is_file() and not is_adapter_folder(name):
            raise UsageError(
                f"{flag} {name} is a folder without config.json or adapter_config.json: not a saved transformers "
                "model or PEFT adapter"
            )
        return name
    if Path(name).exists() or name.startswith((".", "/")) or name.count("/") > 1:
        raise UsageError(f"{flag} {name}: no such model folder")
    check_hub_repo(name, "model", flag=flag, instead="use a local model folder (python scripts/make_tiny_model.py)")
    return name


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(check_model_source(name, "--tokenizer_name"))


def load_config(name: str, overrides: str | None, dropout: float | None, **settings):
    """AutoConfig with `settings` (e.g. num_labels), `config_overrides` ("n_layer=2,n_embd=64", as in run_clm) and
    every dropout probability set to `dropout` (None keeps the model's: > 0 makes 1 and N processes differ)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name, **settings)
    if overrides:
        apply_overrides(config, overrides)
    if dropout is not None:
        for key, value in config.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
                setattr(config, key, dropout)
    return config


def apply_overrides(config, overrides: str) -> None:
    """`config.update_from_string`, then the fields a config derives from others made consistent: `head_dim` (saved
    explicitly by Llama-style configs) follows a changed `hidden_size` or `num_attention_heads` when it was derived
    from them, and is refused when it can't be; the heads must split among the key/value heads."""
    head_dim, hidden, heads = (getattr(config, key, None) for key in ("head_dim", "hidden_size", "num_attention_heads"))
    try:
        config.update_from_string(overrides)
    except ValueError as err:
        raise UsageError(f"--config_overrides {overrides!r}: {err}") from err
    changed = {key.split("=")[0].strip() for key in overrides.split(",")}
    derived = None not in (head_dim, hidden) and heads and "head_dim" not in changed  # Llama-style: saved, not derived
    if derived and {"hidden_size", "num_attention_heads"} & changed:
        if head_dim != hidden // heads:
            raise UsageError(
                f"--config_overrides {overrides!r}: this config's head_dim {head_dim} is not "
                f"hidden_size / num_attention_heads; set head_dim too"
            )
        hidden, heads = config.hidden_size, config.num_attention_heads
        if hidden % heads:
            raise UsageError(
                f"--config_overrides {overrides!r}: hidden_size {hidden} is not divisible by "
                f"num_attention_heads {heads}"
            )
        config.head_dim = hidden // heads
    heads, kv_heads = (getattr(config, key, None) for key in ("num_attention_heads", "num_key_value_heads"))
    if heads and kv_heads and heads % kv_heads:
        raise UsageError(
            f"--config_overrides {overrides!r}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}; set num_key_value_heads too"
        )


@contextmanager
def errors_only_from_transformers():
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


@contextmanager
def main_process_first():
    """Tokenise on the main process first; the others then load its `datasets` cache instead of redoing it."""
    from accelerate import PartialState

    state = PartialState()
    if not state.is_main_process:
        require_transformers().logging.set_verbosity_error()  # one copy of transformers' warnings, not N
    with state.main_process_first():
        yield


def save_pretrained(accelerator, model, tokenizer, directory: Path) -> None:
    """Model (the full state dict, gathered under FSDP/DeepSpeed) and tokenizer, loadable with from_pretrained."""
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        directory,
        is_main_process=accelerator.is_main_process,
        state_dict=accelerator.get_state_dict(model),
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(directory)
