"""Tasks, selected by `--task`: see `task_class`. The contract: `Task` in src/tasks/base.py."""

import dataclasses
import difflib
import importlib
import inspect
import pkgutil
from pathlib import Path

from jsonargparse import ArgumentParser

from src.errors import UsageError, one_line
from src.features import feature_tasks, installed
from src.tasks.base import Task, task_errors  # noqa: F401  (task_errors: part of the contract train.py uses)

BUILT_IN = {"digits": "src.tasks.digits.Digits", **feature_tasks()}


def task_class(name: str) -> type[Task]:
    """The Task subclass `--task` names: a built-in, a module with exactly one Task subclass, or module.Class."""
    path = BUILT_IN.get(name, name)
    module_path, _, class_name = path.rpartition(".")
    module = import_module(path) or import_module(module_path)
    in_a_package = module is not None and module.__name__ != path and hasattr(module, "__path__")
    if module is None or (in_a_package and not hasattr(module, class_name)):  # in a package: neither module nor class
        raise UsageError(f"unknown --task {name!r}; {did_you_mean(name)}use one of {', '.join(BUILT_IN)} or an "
                         "importable module path")  # fmt: skip
    if module.__name__ != path:  # module.Class
        found = getattr(module, class_name, None)
        if not (inspect.isclass(found) and issubclass(found, Task)):
            raise UsageError(f"--task {name}: {module.__name__} has no Task subclass {class_name!r}")
        return found
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)]
    defined = [c for c in classes if issubclass(c, Task) and c.__module__ == module.__name__]
    if len(defined) != 1:
        names = ", ".join(f"{path}.{c.__name__}" for c in defined) or "none"
        raise UsageError(
            f"--task {name}: the module must define exactly one Task subclass (found {names}); "
            "name the class, e.g. --task my_package.my_task.MyTask"
        )
    return defined[0]


def did_you_mean(name: str) -> str:
    """'did you mean X? ' for a --task close to a built-in name or a module in src/tasks/ (path or name), or a file's
    path (its module's dotted path), else ''."""
    if (name.endswith(".py") or "/" in name) and not Path(name).is_absolute():
        return f"did you mean {'.'.join(Path(name).with_suffix('').parts)} (a module, not a file)? "
    shared = ("base", "classification", "digits")  # the contract, a base class, a built-in
    modules = [f"src.tasks.{m.name}" for m in pkgutil.iter_modules(__path__) if m.name not in shared]
    by_name = {path.rpartition(".")[2]: path for path in modules}
    close = difflib.get_close_matches(name, [*BUILT_IN, *modules], n=1) or [
        by_name[found] for found in difflib.get_close_matches(name.rpartition(".")[2], by_name, n=1)
    ]
    package = name.rpartition(".")[0]  # my_pkg.my_taks: a module of the user's package my_pkg
    if not close and package and hasattr(parent := import_module(package), "__path__"):
        close = difflib.get_close_matches(name, [f"{package}.{m.name}" for m in pkgutil.iter_modules(parent.__path__)])
    return f"did you mean {close[0]}? " if close else ""


def import_module(path: str):
    """The module, or None if `path` itself does not exist (an error inside an existing module propagates, but a
    package it imports that is not installed is one line)."""
    try:
        return importlib.import_module(path) if path else None
    except ModuleNotFoundError as err:
        if not err.name:
            raise
        if not (path + ".").startswith(err.name + "."):  # neither `path` nor a package above it: what it imports
            message = f"--task {path}: {one_line(err)}, which its module imports; pip install it, or fix the import"
            raise UsageError(message) from err
    return None


def task_name(name: str) -> str:
    """A short name for run folders: digits, my_task (from my_package.my_task or my_package.my_task.MyTask)."""
    if name in BUILT_IN:
        return name
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1][:1].isupper() else parts[-1]


def build_task(config) -> Task:
    cls = task_class(config.task)
    if cls.loss_reduction not in ("mean", "sum"):
        raise UsageError(f"{cls.__name__}.loss_reduction must be 'mean' or 'sum' (got {cls.loss_reduction!r})")
    return cls(config, parse_task_options(cls, config.task_args))


def starting_model(task: Task, config, accelerator):
    """A run's starting model: `--model_name_or_path`'s weights or new ones, adapted by the features (e.g. LoRA)."""
    model = task.load_model(config.model_name_or_path) if config.model_name_or_path else task.build_model()
    return installed().adapt_model(model, accelerator)


def parse_task_options(task_cls, values: dict):
    """A task's options from a dict (Python callers, or the parsed command line), checked by the same parser."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(task_cls.Options, as_group=False)
    keys = [f.name for f in dataclasses.fields(task_cls.Options)]
    try:
        parsed = parser.parse_object(values or {}).as_dict()
    except Exception as err:
        unknown = [k for k in (values or {}) if k not in keys]
        close = difflib.get_close_matches(str(unknown[0]), keys, n=1) if unknown else []
        hint = f"; did you mean {close[0]}?" if close else ""
        raise UsageError(
            f"options of --task {task_cls.__name__}: {one_line(err)}{hint} (they are {', '.join(keys) or 'none'})"
        ) from err
    return task_cls.Options(**parsed)
