"""The run's configuration: one typed dataclass, read from YAML and overridden on the command line.

    python train.py --config configs/default.yaml --learning_rate 3e-4 --norm batch

Names follow Hugging Face `TrainingArguments` where one exists. Parsing, type checking and the YAML file are
jsonargparse's job; this module only declares the fields and checks that their values make sense together.
"""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from src.errors import UsageError

TRACKERS = ("wandb", "tensorboard")


@dataclass
class TrainConfig:
    # --- run ---
    output_dir: str = "runs/digits"  # config.yaml, metrics.jsonl, checkpoints/, model/ go here
    overwrite_output_dir: bool = False  # allow a fresh run to replace a previous run's files in output_dir
    seed: int = 42  # the same on every process: identical initial weights and data order
    run_name: str | None = None  # wandb run name
    project_name: str = "accelerate-template"  # wandb project / tensorboard folder
    run_tags: list[str] = field(default_factory=list)  # wandb tags
    run_group: str | None = None  # wandb group, e.g. one per sweep
    report_to: str | list[str] = "none"  # wandb, tensorboard, a list or "a,b", all, none; metrics.jsonl always
    debug: bool = False  # full tracebacks instead of one-line errors

    # --- what to train (src/tasks/) ---
    task: str = "digits"  # digits, causal_lm, or a module path like my_package.my_task
    task_args: dict = field(default_factory=dict)  # options the task checks itself (e.g. causal_lm's model size)

    # --- data (src/data.py) ---
    dataset_name: str | None = None  # a Hugging Face Hub dataset; None means the local data_files below
    dataset_config_name: str | None = None  # the Hub dataset's configuration, if it has several
    data_files: dict[str, str] | None = field(  # split -> a .parquet, .csv, .json or .jsonl file
        default_factory=lambda: {"train": "data/digits/train.parquet", "eval": "data/digits/eval.parquet"}
    )
    train_split: str = "train"  # split names in the data
    eval_split: str = "eval"
    input_column: str = "pixels"  # the model's input column (digits: 64 pixel values; causal_lm: text)
    label_column: str = "label"  # integer class labels
    dataloader_num_workers: int = 0  # worker processes per data loader
    dataloader_drop_last: bool = True  # full batches only: the same samples per step on 1 or N processes
    max_train_samples: int | None = None  # train on the first N samples only (debugging, overfitting one batch)
    max_eval_samples: int | None = None  # evaluate on the first N samples only

    # --- model (src/model.py) ---
    model: Literal["cnn", "linear"] = "cnn"  # linear: logistic regression on the pixels, a baseline
    norm: Literal["batch", "group", "none"] = "group"  # group: no cross-sample statistics, exact on N processes
    num_labels: int = 10  # classes; labels must lie in 0..num_labels-1

    # --- optimisation ---
    num_train_epochs: float = 10  # passes over the train split (fractions allowed)
    max_steps: int = -1  # > 0 overrides num_train_epochs; counted in optimiser steps
    per_device_train_batch_size: int = 32  # samples per process per forward pass
    per_device_eval_batch_size: int = 128
    gradient_accumulation_steps: int = 1  # used only when global_batch_size is None
    global_batch_size: int | None = 64  # if set: accumulation = global / (per-device batch x processes)
    learning_rate: float = 3e-3  # peak learning rate (AdamW)
    weight_decay: float = 0.01  # not applied to biases and normalisation weights
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "cosine"  # after warmup
    warmup_steps: int = 20  # linear warmup, in optimiser steps
    max_grad_norm: float = 1.0  # 0 disables clipping
    auto_find_batch_size: bool = False  # on out-of-memory: halve the per-device batch, keep global_batch_size
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None  # None: from the accelerate config / launcher
    gradient_checkpointing: bool = False  # trade compute for memory, for models that support it
    torch_compile: bool = False  # torch.compile the model (inductor)
    skip_nonfinite_batches: bool = False  # skip optimiser steps whose gradient is NaN/inf instead of stopping

    # --- logging and evaluation (in optimiser steps) ---
    logging_steps: int = 10  # one log line (and one host sync) every N optimiser steps
    eval_steps: int = 100  # also evaluated once at the end
    save_steps: int = 100  # a checkpoint every N optimiser steps, and one at the end; 0: only at the end
    save_total_limit: int | None = 2  # keep the newest N checkpoints; None keeps all
    resume_from_checkpoint: str | None = None  # "latest" (or a fresh start if there is none) or a checkpoint path
    early_stopping_patience: int | None = None  # stop after N evaluations without improvement
    early_stopping_metric: str = "eval/loss"  # any logged eval key
    early_stopping_mode: Literal["min", "max"] = "min"  # whether lower or higher is better
    profile_steps: int = 0  # > 0: record a torch.profiler trace of that many steps to output_dir/profile/
    metrics: list[str] | None = None  # evaluate metrics: src/evaluate_metrics/<name> or a path; None: the task's

    def __post_init__(self):
        self.report_to = normalize_report_to(self.report_to)
        problems = [
            f"--{name} must be > 0 (got {getattr(self, name)})"
            for name in (
                "per_device_train_batch_size",
                "per_device_eval_batch_size",
                "gradient_accumulation_steps",
                "learning_rate",
                "num_train_epochs",
                "logging_steps",
                "eval_steps",
                "num_labels",
            )
            if getattr(self, name) <= 0
        ]
        problems += [
            f"--{name} must be >= 0 (got {getattr(self, name)})"
            for name in (
                "weight_decay",
                "warmup_steps",
                "max_grad_norm",
                "dataloader_num_workers",
                "save_steps",
                "profile_steps",
            )  # fmt: skip
            if getattr(self, name) < 0
        ]
        for name in ("global_batch_size", "save_total_limit", "max_train_samples", "max_eval_samples",
                     "early_stopping_patience"):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                problems.append(f"--{name} must be > 0 or null (got {getattr(self, name)})")
        if self.max_steps == 0 or self.max_steps < -1:
            problems.append(f"--max_steps must be > 0, or -1 to train for num_train_epochs (got {self.max_steps})")
        if self.auto_find_batch_size and self.global_batch_size is None:
            problems.append("--auto_find_batch_size needs --global_batch_size, so the optimiser's batch stays the same")
        if self.dataset_name is None and not self.data_files:
            problems.append("no data: set --dataset_name (a Hub dataset) or --data_files (local files)")
        if problems:
            raise UsageError("; ".join(problems))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def normalize_report_to(value: str | list[str]) -> list[str]:
    """'wandb', 'wandb,tensorboard', ['wandb'], 'all' or 'none' -> a list of tracker names."""
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return list(TRACKERS)
    unknown = sorted(set(names) - set(TRACKERS))
    if unknown:
        raise UsageError(f"unknown --report_to {', '.join(unknown)}; use {', '.join(TRACKERS)}, all or none")
    return names


def resolve_global_batch(config: TrainConfig, num_processes: int) -> int:
    """Gradient accumulation steps so the optimiser sees `global_batch_size` samples on any process count."""
    if config.global_batch_size is None:
        return config.gradient_accumulation_steps
    per_step = config.per_device_train_batch_size * num_processes
    if config.global_batch_size % per_step:
        raise UsageError(
            f"--global_batch_size {config.global_batch_size} is not divisible by per-device batch "
            f"{config.per_device_train_batch_size} x {num_processes} processes = {per_step}; "
            f"pick a multiple of {per_step} or change --per_device_train_batch_size"
        )
    return config.global_batch_size // per_step


def parse_config(argv: list[str] | None) -> TrainConfig:
    """Defaults <- `--config file.yaml` <- `--field value` flags, type-checked; bad input raises UsageError."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        description="Train a model with Hugging Face Accelerate.", exit_on_error=False, allow_abbrev=False
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the fields below")
    parser.add_class_arguments(TrainConfig, as_group=False)
    try:
        namespace = parser.parse_args(argv)
    except Exception as err:  # jsonargparse reports every parse problem as some exception with a message
        raise UsageError(one_line(err) + "; see `python train.py --help`") from err
    namespace.pop("config", None)
    return TrainConfig(**namespace.as_dict())


def parse_task_args(args_class, config: TrainConfig):
    """`--task_args` checked against a task's own dataclass by the same parser as the rest of the config."""
    import difflib

    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(args_class, as_group=False)
    keys = [f.name for f in dataclasses.fields(args_class)]
    try:
        values = parser.parse_object(config.task_args or {}).as_dict()
    except Exception as err:
        unknown = [k for k in (config.task_args or {}) if k not in keys]
        close = difflib.get_close_matches(str(unknown[0]), keys, n=1) if unknown else []
        hint = f"; did you mean {close[0]}?" if close else ""
        raise UsageError(
            f"--task_args for --task {config.task}: {one_line(err)}{hint} (the keys are {', '.join(keys)})"
        ) from err
    return args_class(**values)


def one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def save_config(config: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
