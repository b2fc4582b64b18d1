"""Features: optional parts, one package each in src/features/, whose `FEATURE` overrides the `Feature` hooks it needs
and whose `Options` add flags (docs/customize.md). The core never imports one: deleting its package removes it."""

import dataclasses
import functools
import importlib
import pkgutil
from pathlib import Path


class Feature:
    """A feature's hooks into a run, in the order they are called; `config` is the run's TrainConfig."""

    Options: type | None = None  # a dataclass of the feature's flags; None: it has none
    tasks: dict[str, str] = {}  # --task names it adds -> "module.Class" (imported only when chosen)

    def options(self, config):  # this feature's options, typed
        return options_of(self.Options, config.feature_args)

    def wrap_train(self, train):
        """`train(config)` as the feature runs it (e.g. again with a smaller batch after running out of memory)."""
        return train

    def check(self, config) -> None:
        """Before training reads or writes anything, on every process: bad input raises UsageError (exit 2)."""

    def before_process_group(self) -> None:
        """In every process as it starts building its Accelerator (eval-only too), before the process group forms."""

    def check_launch(self, use_cpu: bool, config) -> None:
        """Before the process group forms: raise LaunchError for what's unavailable (config None: scripts/launch.py)."""

    def accelerator_options(self, use_cpu: bool, config) -> dict | None:
        """The Accelerator's arguments for a strategy the feature runs (`cpu` included), or None: not its strategy."""
        return None

    def accelerator_class(self, use_cpu: bool) -> type | None:
        """A subclass of src/accelerator.py's Accelerator that the run builds instead (e.g. cheaper calls), or None."""
        return None

    def train_loader(self, task, config, pin_memory: bool):
        """A train DataLoader of the feature's own (e.g. a stream) in place of the in-memory one, or None."""
        return None

    def adapt_model(self, model, accelerator):
        """The model before `accelerator.prepare`, as the feature needs it (e.g. DeepSpeed's inputs cast)."""
        return model

    def before_resume(self, accelerator, config) -> None:
        """Before the run looks for a checkpoint to resume from (e.g. fetch a newer one from elsewhere)."""

    def on_start(self, accelerator, config, resumed: bool) -> None:
        """The output directory is ready (a fresh start cleared it); training is about to start."""

    def before_training(self, accelerator, config, task, model, train_loader, eval_loader, metric) -> None:
        """After `prepare`, before the first step, on every process (`model` uncompiled): e.g. one batch tried."""

    def train_batches(self, accelerator, loader, config, collate_fn):
        """The prepared train loader's batches from a cheaper source (`epoch(epoch, skip)`, as src/batches.py's
        LoaderBatches), or None."""
        return None

    def on_step(self, accelerator, config, step: int) -> None:
        """After each optimiser step, on every process (keep it cheap: it runs at every step)."""

    def train_metrics(self, metrics: dict, accelerator, task) -> dict:
        """A log step's `train/` metrics as logged, on every process: e.g. with throughput's tokens/s added."""
        return metrics

    def on_preemption(self) -> None:
        """On every process, once all agreed to save a preemption checkpoint at this step, before it is saved."""

    def on_checkpoint(self, accelerator, config, checkpoint: Path, state) -> None:
        """On every process, after `checkpoint` was saved; `state` is its TrainerState."""

    def on_end(self, accelerator, config, model_dir: Path) -> None:
        """After model/, the test split and the predictions are written, on every process."""


def each(hook):
    """`Features.<hook>`: the hook of every feature in turn (with Feature's signature and docstring: `wraps`)."""

    @functools.wraps(hook)
    def call(self, *args):
        for feature in self:
            getattr(feature, hook.__name__)(*args)

    return call


def first(hook):
    """`Features.<hook>`: the first feature's answer that is not None, else None."""

    @functools.wraps(hook)
    def call(self, *args):
        answers = (getattr(feature, hook.__name__)(*args) for feature in self)
        return next((answer for answer in answers if answer is not None), None)

    return call


def chain(hook):
    """`Features.<hook>`: its first argument through every feature's hook in turn, each given the previous answer."""

    @functools.wraps(hook)
    def call(self, value, *args):
        for feature in self:
            value = getattr(feature, hook.__name__)(value, *args)
        return value

    return call


class Features(tuple):
    """Every installed feature as one: each hook in turn, chained, or the first answer that is not None."""

    before_process_group = each(Feature.before_process_group)
    check_launch = each(Feature.check_launch)
    check = each(Feature.check)
    before_resume = each(Feature.before_resume)
    on_start = each(Feature.on_start)
    before_training = each(Feature.before_training)
    on_step = each(Feature.on_step)
    on_preemption = each(Feature.on_preemption)
    on_checkpoint = each(Feature.on_checkpoint)
    on_end = each(Feature.on_end)
    accelerator_options = first(Feature.accelerator_options)
    accelerator_class = first(Feature.accelerator_class)
    train_loader = first(Feature.train_loader)
    train_batches = first(Feature.train_batches)
    wrap_train = chain(Feature.wrap_train)
    adapt_model = chain(Feature.adapt_model)
    train_metrics = chain(Feature.train_metrics)


def options_of(options_class: type, values: dict):
    """A feature's `Options` (its checks run) from `values`: every feature's options, flat as in `feature_args`."""
    names = {field.name for field in dataclasses.fields(options_class)}
    return options_class(**{name: value for name, value in values.items() if name in names})


@functools.cache
def installed() -> Features:
    """The features whose packages are here, by name: each package's `FEATURE`."""
    return Features(importlib.import_module(f"{__name__}.{name}").FEATURE for name in installed_names())


def installed_names() -> list[str]:
    return sorted(module.name for module in pkgutil.iter_modules(__path__) if module.ispkg)


def feature_tasks() -> dict[str, str]:
    return {name: path for feature in installed() for name, path in feature.tasks.items()}


def option_classes() -> list[type]:
    """The installed features' Options dataclasses: fields the command line adds to TrainConfig's."""
    return [feature.Options for feature in installed() if feature.Options is not None]
