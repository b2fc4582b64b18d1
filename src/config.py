"""TrainConfig, what every run has (the task adds its own options), and its checks; names follow `TrainingArguments`."""

import contextlib
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from src.errors import UsageError

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]

# What each number may be: TrainConfig refuses others with one line naming them all
POSITIVE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
POSITIVE += ("learning_rate", "num_train_epochs", "logging_steps", "eval_steps")
NON_NEGATIVE = ("weight_decay", "warmup_steps", "max_grad_norm", "dataloader_num_workers", "save_steps")
POSITIVE_OR_NONE = ("global_batch_size", "save_total_limit", "max_train_samples", "max_eval_samples")
POSITIVE_OR_NONE += ("max_predict_samples", "early_stopping_patience")
HINTS = {"eval_steps": " (--do_eval false: no evaluation)"}  # unlike --save_steps 0, which saves at the end only
ERRORS = ("error", "mse", "rmse", "mae", "mape", "wer", "cer")  # a metric name's last word: eval/rmse, eval/val_error
NEEDS_EVAL = ("metric_for_best_model", "load_best_model_at_end", "early_stopping_patience")  # evaluations in training


@dataclass
class TrainConfig:
    # --- run ---
    output_dir: str | None = None  # config.yaml, metrics.jsonl, checkpoints/, model/, .lock; None: runs/<task>
    overwrite_output_dir: bool = False  # allow a fresh run to replace a previous run's files in output_dir
    seed: int = 42  # the same on every process: identical initial weights and data order
    run_name: str | None = None  # wandb run name
    project_name: str = "accelerate-template"  # wandb project / tensorboard folder
    run_tags: list[str] = field(default_factory=list)  # wandb tags
    run_group: str | None = None  # wandb group, e.g. one per sweep
    report_to: str | list[str] = "none"  # wandb, tensorboard, mlflow or any Accelerate tracker, a list, all, none
    debug: bool = False  # full tracebacks instead of one-line errors
    do_train: bool = True  # false: evaluate and/or predict with a saved model (--model_name_or_path), nothing else
    do_eval: bool = True  # evaluate on the eval split (every eval_steps and at the end) and on the test split
    do_predict: bool = False  # write output_dir/predictions.jsonl for the test split (the eval split if none)

    # --- what to train (src/tasks/) ---
    task: str = "digits"  # digits, a task of a feature (features.yaml) or my_pkg.my_task
    task_args: dict = field(default_factory=dict)  # in Python: the task's options (on the command line: --option value)
    model_name_or_path: str | None = None  # weights to start from or evaluate: a run's model/, a checkpoint, Hub model
    feature_args: dict = field(default_factory=dict)  # in Python: the features' options (src/features/), by name

    # --- data (src/data.py) ---
    dataset_name: str | None = None  # a Hub dataset; None, imagefolder, parquet, ...: the local data_files below
    dataset_config_name: str | None = None  # the Hub dataset's configuration, if it has several
    data_files: dict[str, str] | None = None  # split -> .parquet/.csv/.json(l) file or folder; None: the task's
    train_split: str = "train"  # split names in the data
    eval_split: str = "eval"
    test_split: str = "test"  # evaluated at the end (test/ metrics) and predicted, when the data has it
    dataloader_num_workers: int = 0  # worker processes per data loader
    dataloader_drop_last: bool = True  # full batches only: the same samples per step on 1 or N processes
    max_train_samples: int | None = None  # train on the first N samples only (debugging, overfitting one batch)
    max_eval_samples: int | None = None  # evaluate on the first N samples only
    max_predict_samples: int | None = None  # test and predict on the first N samples only (test, else eval)
    id_column: str = "id"  # copied into each row of predictions.jsonl when the predicted split has it

    # --- optimisation ---
    num_train_epochs: float = 10  # passes over the train split (fractions allowed)
    max_steps: int = -1  # > 0 overrides num_train_epochs; counted in optimiser steps
    per_device_train_batch_size: int = 32  # samples per process per forward pass
    per_device_eval_batch_size: int = 128
    gradient_accumulation_steps: int = 1  # used with global_batch_size null; else the global batch sets it
    global_batch_size: int | None = 64  # if set: accumulation = global / (per-device batch x processes)
    learning_rate: float = 3e-3  # peak learning rate (AdamW)
    weight_decay: float = 0.01  # not applied to biases and normalisation weights
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "cosine"  # after warmup
    warmup_steps: int = 20  # linear warmup, in optimiser steps
    max_grad_norm: float = 1.0  # 0 disables clipping
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None  # None: from the accelerate config / launcher
    gradient_checkpointing: bool = False  # trade compute for memory, for models that support it
    torch_compile: bool = False  # torch.compile the model (inductor); checkpoints and model/ keep its plain keys
    torch_compile_mode: CompileMode | None = None  # torch.compile's mode, e.g. max-autotune (compiles); None: default
    tf32: bool | None = None  # TensorFloat-32 matmuls for float32 work on NVIDIA GPUs (Ampere+); None: torch's default
    skip_nonfinite_batches: bool = False  # skip optimiser steps whose gradient is NaN/inf instead of stopping

    # --- logging and evaluation (in optimiser steps) ---
    logging_steps: int = 10  # one log line (and one host sync) every N optimiser steps
    eval_steps: int = 100  # also evaluated once at the end
    save_steps: int = 100  # a checkpoint every N optimiser steps, and one at the end; 0: only at the end
    save_total_limit: int | None = 2  # keep the newest N checkpoints; None keeps all
    resume_from_checkpoint: str | None = None  # "latest" (or a fresh start if there is none) or a checkpoint path
    metric_for_best_model: str | None = None  # e.g. eval/accuracy: a new best is checkpointed and never rotated away
    greater_is_better: bool | None = None  # None: false for a loss, perplexity or error (rmse...)
    load_best_model_at_end: bool = False  # at the end, model/ holds the best checkpoint's weights
    early_stopping_patience: int | None = None  # stop after N evaluations without improvement
    early_stopping_metric: str = "eval/loss"  # any logged eval key (eval/ may be left out)
    early_stopping_mode: Literal["min", "max"] | None = None  # None: min for a loss, perplexity or error, else max
    metrics: list[str] | None = None  # accuracy (built in), src/evaluate_metrics/<name>, a path; None: the task's

    def __post_init__(self):
        self.report_to = normalize_report_to(self.report_to)
        values = {name: getattr(self, name) for name in (*POSITIVE, *NON_NEGATIVE, *POSITIVE_OR_NONE)}
        problems = [f"--{name} must be > 0 (got {values[name]}){HINTS.get(name, '')}" for name in POSITIVE
                    if values[name] <= 0]  # fmt: skip
        problems += [f"--{name} must be >= 0 (got {values[name]})" for name in NON_NEGATIVE if values[name] < 0]
        not_positive = [name for name in POSITIVE_OR_NONE if values[name] is not None and values[name] <= 0]
        problems += [f"--{name} must be > 0 or null (got {values[name]})" for name in not_positive]
        if self.max_steps == 0 or self.max_steps < -1:
            problems.append(f"--max_steps must be > 0, or -1 to train for num_train_epochs (got {self.max_steps})")
        if not self.project_name or Path(self.project_name).name != self.project_name or self.project_name == "..":
            problems.append(f"--project_name {self.project_name!r} must be a plain name (tensorboard's folder in "
                            "--output_dir, the wandb project), without / or ..")  # fmt: skip
        if not 0 <= self.seed < 2**32:
            problems.append(f"--seed must be >= 0 and < 2**32 (got {self.seed})")
        betas = {"--adam_beta1": self.adam_beta1, "--adam_beta2": self.adam_beta2}
        problems += [f"{flag} must be >= 0 and < 1 (got {beta})" for flag, beta in betas.items() if not 0 <= beta < 1]
        if self.output_dir and "://" in self.output_dir:
            problems.append(f"--output_dir {self.output_dir} is a URL; keep --output_dir a local folder")
        if not (self.do_train or self.do_eval or self.do_predict):
            problems.append("--do_train, --do_eval and --do_predict are all false: nothing to do")
        if self.torch_compile_mode is not None:  # a mode asks for compilation, as in transformers
            self.torch_compile = True
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "eval/loss"  # as in transformers
        if self.metric_for_best_model:  # "accuracy", as transformers names it, is eval/accuracy
            self.metric_for_best_model = as_eval_key(self.metric_for_best_model)
        if self.metric_for_best_model and self.greater_is_better is None:
            self.greater_is_better = not lower_is_better(self.metric_for_best_model)
        self.early_stopping_metric = as_eval_key(self.early_stopping_metric)
        if self.early_stopping_mode is None:
            self.early_stopping_mode = "min" if lower_is_better(self.early_stopping_metric) else "max"
        needs_eval = [name for name in NEEDS_EVAL if getattr(self, name)]
        if needs_eval and self.do_train and not self.do_eval:  # eval-only may reuse a best-model run's config.yaml
            problems.append(f"--{needs_eval[0]} needs evaluations during training: set --do_eval true")
        if problems:
            raise UsageError("; ".join(problems))

    def to_dict(self) -> dict:
        """Flat, as on the command line and in config.yaml: the task's and features' options beside the run's fields."""
        values = dataclasses.asdict(self)
        run = {k: v for k, v in values.items() if k not in ("task_args", "feature_args")}
        return {**run, **values["feature_args"], **values["task_args"]}


def as_eval_key(metric: str) -> str:
    return metric if metric.startswith("eval/") else f"eval/{metric}"


def lower_is_better(metric: str) -> bool:
    """What a metric's name says: a loss (as transformers reads it), a perplexity or an error is lower when better."""
    return metric.endswith(("loss", "perplexity")) or re.split(r"[/_.-]", metric)[-1].lower() in ERRORS


def normalize_report_to(value: str | list[str]) -> list[str]:
    """'wandb', 'wandb,mlflow', ['wandb'], 'all' (those installed, as Accelerate picks them) or 'none' -> a list of
    Accelerate tracker names. A tracker whose package is missing is an error now: Accelerate would drop it silently."""
    from accelerate import tracking
    from accelerate.utils import LoggerType

    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    if names in ([], ["none"]):
        return []
    installed = [str(t) for t in tracking.get_available_trackers()]
    if "all" in names:
        return [name for name in LoggerType.list() if name in installed]
    known = [name for name in LoggerType.list() if name != "all"]
    for name in names:
        if name not in known:
            hint = f"did you mean {close[0]}? " if (close := difflib.get_close_matches(name, known, n=1)) else ""
            raise UsageError(f"unknown --report_to {name}; {hint}use {', '.join(known)}, all or none")
        if name not in installed:
            raise UsageError(f"--report_to {name} needs its package: pip install {name}")
    return list(dict.fromkeys(names))


def resolve_global_batch(config: TrainConfig, num_processes: int) -> int:
    """Gradient accumulation steps so the optimiser sees `global_batch_size` samples on any process count."""
    if config.global_batch_size is None:
        return config.gradient_accumulation_steps
    per_step = config.per_device_train_batch_size * num_processes
    if config.global_batch_size % per_step:
        share, uneven = divmod(config.global_batch_size, num_processes)  # uneven: no per-device batch can divide it
        sizes = [] if uneven else range(config.per_device_train_batch_size, 0, -1)
        fits = [size for size in sizes if share % size == 0]
        raise UsageError(
            f"--global_batch_size {config.global_batch_size} is not divisible by per-device batch "
            f"{config.per_device_train_batch_size} x {num_processes} processes = {per_step}; set --global_batch_size "
            f"to a multiple of {per_step}" + (f", or --per_device_train_batch_size {fits[0]}" if fits else "")
        )
    steps = config.global_batch_size // per_step
    if config.gradient_accumulation_steps not in (1, steps):  # given, and not what the global batch makes
        raise UsageError(
            f"--gradient_accumulation_steps {config.gradient_accumulation_steps} does not apply: --global_batch_size "
            f"{config.global_batch_size} sets it ({steps} here, with {config.per_device_train_batch_size} x "
            f"{num_processes} processes); set --global_batch_size "
            f"{per_step * config.gradient_accumulation_steps} instead, or --global_batch_size null to keep it"
        )
    return steps


@functools.cache  # inspect.getsource parses the class's whole file: ~10 ms a class, at every parse of a command line
def field_help(cls) -> dict[str, str]:
    """name -> the comment ending the field's line in the source (its --help text), base dataclasses' too."""
    comments = {}
    for base in [c for c in reversed(cls.__mro__) if dataclasses.is_dataclass(c)]:
        with contextlib.suppress(OSError, TypeError):  # no source, e.g. made by make_dataclass
            source = textwrap.dedent(inspect.getsource(base))  # its own fields: the lines indented 4 spaces
            comments |= dict(re.findall(r"^    (\w+): .*?  # (.*)$", source, flags=re.MULTILINE))
    return comments


# How one launch treats output_dir, not what the run is: left out of config.yaml, so that `--config <run>/config.yaml
# --output_dir elsewhere` never replaces or continues another run unasked
LAUNCH_ONLY = ("overwrite_output_dir", "resume_from_checkpoint")


def save_config(config: TrainConfig, path: Path) -> None:
    """Flat like the command line: `--config path` runs the same again (in a folder of its own)."""
    values = {name: value for name, value in config.to_dict().items() if name not in LAUNCH_ONLY}
    path.write_text(yaml.safe_dump(values, sort_keys=False))
