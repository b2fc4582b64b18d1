"""The task contract: how --task finds a class, its typed options on the command line, its errors."""

import dataclasses
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from src.cli import parse_config, resolve
from src.config import TrainConfig, save_config
from src.errors import EXIT_TASK_FAILED, LaunchError, TaskFailed, UsageError, describe
from src.run_dir import run_files, trained_any_step
from src.tasks import BUILT_IN, build_task, task_class, task_name
from src.tasks.base import Task, task_errors
from src.tasks.digits import Digits
from tests.conftest import (
    QUICK,
    REPO,
    assert_ok,
    launch_command,
    read_metrics,
    run_command,
    run_main,
)
from tests.helpers import has_feature, needs, run_with_unreadable_samples


def digits_only(task: str) -> set[str]:
    """Digits options that the other task does not have itself (norm, model, input_column, ...)."""
    return {f.name for f in dataclasses.fields(Digits.Options)} - {
        f.name for f in dataclasses.fields(task_class(task).Options)
    }


@pytest.fixture
def task_module(tmp_path, monkeypatch):
    """Write a module into an importable folder: returns a function (module name, source) -> module name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        sys.modules.pop(name, None)
        return name

    return write


TWO_TASKS = """
from src.tasks.base import Task

class First(Task):
    pass

class Second(Task):
    pass
"""


TOY_TASK = """
from dataclasses import dataclass

from src.errors import UsageError
from src.tasks.base import Task

class Toy(Task):
    @dataclass
    class Options:
        hidden_size: int = 64
        num_layers: int = 2  # hidden layers

        def __post_init__(self):
            if self.hidden_size <= 0:
                raise UsageError(f"--hidden_size must be > 0 (got {self.hidden_size})")
"""


@pytest.fixture
def toy(task_module) -> str:
    """A second task beside the digits, with options of its own: `--task toy`."""
    return task_module("toy", TOY_TASK)


def test_task_names_resolve_to_classes(task_module, toy):
    assert task_class("digits") is Digits and task_class(toy).__name__ == "Toy"
    assert task_class(f"{toy}.Toy") is task_class(toy)
    module = task_module("two_tasks", TWO_TASKS)
    assert task_class(f"{module}.Second").__name__ == "Second"
    with pytest.raises(UsageError, match="exactly one Task subclass .*two_tasks.First, two_tasks.Second"):
        task_class(module)
    with pytest.raises(UsageError, match="unknown --task 'nope'; use one of digits"):
        task_class("nope")
    with pytest.raises(UsageError, match="unknown --task 'my_project/my_task.py'; did you mean my_project.my_task \\("):
        task_class("my_project/my_task.py")
    with pytest.raises(UsageError, match="unknown --task 'digts'; did you mean digits\\? use"):
        task_class("digts")
    with pytest.raises(UsageError, match="has no Task subclass 'Third'"):
        task_class(f"{module}.Third")
    needs = task_module("needs_a_package", "import no_such_package  # noqa: F401\n" + TOY_TASK)
    for name in (needs, f"{needs}.Toy"):  # the module, or its class: the package it lacks named, in one line
        with pytest.raises(UsageError, match=rf"^--task {re.escape(name)}: No module named 'no_such_package', which"):
            task_class(name)
    assert [task_name(n) for n in ("digits", "my_pkg.my_task", "my_pkg.my_task.MyTask")] == [
        "digits",
        "my_task",
        "my_task",
    ]


def test_a_mistyped_module_of_the_users_package_is_suggested(tmp_path, monkeypatch):
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "my_task.py").write_text(TOY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"unknown --task 'my_pkg\.my_taks'; did you mean my_pkg\.my_task\? use"):
        task_class("my_pkg.my_taks")
    sys.modules.pop("my_pkg", None)


def test_a_mistyped_task_names_the_users_task_in_src_tasks(tmp_path, monkeypatch):
    """A task of one's own in src/tasks/ (here a folder added to the package's path), asked for by its bare name or
    with a typo in its path: the error names its path."""
    import src.tasks

    (tmp_path / "my_table.py").write_text(TOY_TASK)
    monkeypatch.setattr(src.tasks, "__path__", [*src.tasks.__path__, str(tmp_path)])
    for mistyped in ("my_table", "src.tasks.my_tabel"):
        with pytest.raises(UsageError, match=rf"unknown --task '{mistyped}'; did you mean src\.tasks\.my_table\? use"):
            task_class(mistyped)
    try:
        assert task_class("src.tasks.my_table").__name__ == "Toy"  # the name suggested is the task
    finally:
        sys.modules.pop("src.tasks.my_table", None)
        vars(src.tasks).pop("my_table", None)


def test_task_options_are_flags_yaml_keys_and_saved_flat(tmp_path, toy):
    path = tmp_path / "c.yaml"
    path.write_text(f"task: {toy}\nnum_layers: 3\n")
    config = parse_config(["--config", str(path), "--hidden_size", "16", "--data_files", "{train: a.csv, eval: b.csv}"])
    assert config.task_args["num_layers"] == 3 and config.task_args["hidden_size"] == 16
    assert config.output_dir == "runs/toy"  # the default follows the task
    save_config(config, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["num_layers"] == 3 and "task_args" not in saved
    assert not digits_only(toy) & set(saved), "another task's config holds digits-only settings"
    assert parse_config(["--config", str(tmp_path / "config.yaml")]) == config  # the saved file runs the same


@pytest.mark.parametrize("task", ["toy", pytest.param("causal_lm", marks=needs("gpt"))])
def test_other_tasks_configs_hold_no_digits_settings(tmp_path, toy, task):
    config = resolve(TrainConfig(task=task, data_files={"train": "x.csv", "eval": "y.csv"}))
    save_config(config, tmp_path / "config.yaml")
    saved = set(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert "norm" in digits_only(task) and not digits_only(task) & saved


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--task", "toy", "--norm", "batch"], "--norm is an option of --task digits, not of --task toy"),
        (["--nrom", "batch"], "did you mean --norm?"),
        (["--task", "toy", "--num_layer", "2"], "did you mean --num_layers?"),
        (["--norm", "layer"], "norm"),
        (["--task", "toy", "--data_files", "{train: a.csv}", "--hidden_size", "0"], "--hidden_size must be > 0"),
    ],
)
def test_bad_task_options_are_one_line_usage_errors(toy, argv, message):
    with pytest.raises(UsageError, match=message) as info:
        parse_config(argv)
    assert "\n" not in str(info.value)


def test_python_callers_get_the_same_checks(toy):
    with pytest.raises(UsageError, match="did you mean num_layers"):
        resolve(TrainConfig(task=toy, task_args={"num_layer": 2}))
    assert build_task(resolve(TrainConfig(task_args={"norm": "none"}))).options.norm == "none"


def test_help_lists_the_tasks_options(capsys, toy):
    with pytest.raises(SystemExit):
        parse_config(["--task", toy, "--help"])
    shown = capsys.readouterr().out
    assert f"options of --task {toy}" in shown and "--num_layers" in shown and "hidden layers" in shown
    assert "--learning_rate" in shown and "--norm" not in shown


def test_options_named_like_a_run_field_are_refused(task_module, monkeypatch):
    """Each clashing field with its owner's name: the run's, or a feature's."""
    import dataclasses

    import src.cli

    feature_options = dataclasses.make_dataclass("SomeFeatureOptions", [("trace_steps", int, 0)])
    monkeypatch.setattr(src.cli, "option_classes", lambda: [feature_options])
    module = task_module("clashing", """
        from dataclasses import dataclass
        from src.tasks.base import Task

        class Clashing(Task):
            @dataclass
            class Options:
                learning_rate: float = 0.1
                trace_steps: int = 0
        """)  # fmt: skip
    with pytest.raises(UsageError) as refused:
        parse_config(["--task", module])
    assert str(refused.value) == ("Clashing.Options fields clash with fields of the same name: learning_rate "
                                  "(TrainConfig), trace_steps (SomeFeatureOptions); rename them")  # fmt: skip


def test_every_built_in_task_subclasses_the_contract():
    for name in BUILT_IN:
        cls = task_class(name)
        assert issubclass(cls, Task) and dataclasses.is_dataclass(cls.Options)
        for hook in ("build_datasets", "build_model", "loss", "eval_outputs"):
            assert getattr(cls, hook) is not getattr(Task, hook), f"{name} lacks {hook}"


# --- errors in a task's code ---


class Broken(Digits):
    def loss(self, model, batch):
        inputs, labels = batch
        return model(inputs.flatten(1)).sum()  # a shape bug inside the task: the CNN wants images


def test_an_error_in_a_task_hook_names_the_hook_and_the_batch():
    task = Broken(TrainConfig())
    model = task.build_model()
    batch = (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TaskFailed) as info, task_errors(Broken):
        task.loss(model, batch)
    message = str(info.value)
    assert message.startswith("Broken.loss() failed on a batch (tensor float32 [4, 1, 8, 8], tensor int64 [4]): ")
    assert "\n" not in message

    with pytest.raises(RuntimeError, match="out of memory"), task_errors(Broken):  # --auto_find_batch_size's signal
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(ZeroDivisionError), task_errors(Broken):  # not the task's code: left as it is
        _ = 1 / 0


def test_describe_names_the_structure():
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "labels": [1, 2]}
    assert describe(batch) == "{input_ids: tensor int64 [2, 5], labels: [int, int]}"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "fp16 mixed precision needs a GPU"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP version 1, which needs GPUs.*fsdp_version: 2"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"},
         r"offloads to the CPU \(fsdp_offload_params\)"),
    ],
)  # fmt: skip
def test_launch_this_machine_cannot_run_is_one_line(monkeypatch, env, message):
    from src.strategy import check_launch

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=message):
        check_launch(use_cpu=True, config=TrainConfig())


def test_what_the_cpu_can_run_passes_the_launch_check(monkeypatch):
    from src.strategy import check_launch

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    check_launch(use_cpu=True, config=TrainConfig())
    check_launch(use_cpu=False, config=TrainConfig(mixed_precision="fp16"))  # fp16 is refused on the CPU only


def test_fsdp_on_cpu_processes_with_a_torch_too_old_for_it_is_one_line(monkeypatch):
    from src import strategy

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setattr(strategy, "CPU_FSDP2_TORCH", "99.0")  # a torch older than FSDP2 on gloo needs
    with pytest.raises(LaunchError, match=r"FSDP2 on CPU processes needs torch >= 99.0 \(this is .*ddp.yaml"):
        strategy.check_launch(use_cpu=True, config=TrainConfig())
    strategy.check_launch(use_cpu=False, config=TrainConfig())  # on GPUs: Accelerate's own FSDP2, for any torch


def test_a_run_that_failed_before_its_first_step_blocks_nothing(tmp_path):
    out = tmp_path / "run"
    (out).mkdir()
    (out / "config.yaml").write_text("task: digits\n")
    (out / "metrics.jsonl").write_text('{"step": 0, "setup/world_size": 1}\n')
    assert not trained_any_step(out)
    (out / "metrics.jsonl").write_text('{"step": 0, "setup/world_size": 1}\n{"step": 10, "train/loss": 2.0}\n')
    assert trained_any_step(out)


def test_a_fresh_run_replaces_only_what_a_run_of_its_own_left(tmp_path):
    """Trackers' files (wandb/, mlflow.db, dvclive/, tensorboard's project folder of event files) count as a previous
    run's only beside its run files; a folder named like --project_name without event files is never one."""
    (tmp_path / "wandb").mkdir()
    (tmp_path / "digits").mkdir()  # e.g. a run of its own, --output_dir runs --project_name digits
    assert run_files(tmp_path, "digits") == []
    (tmp_path / "metrics.jsonl").write_text("")
    assert run_files(tmp_path, "digits") == ["metrics.jsonl", "wandb"]
    (tmp_path / "digits" / "events.out.tfevents.1.host").write_text("")
    assert run_files(tmp_path, "digits") == ["metrics.jsonl", "wandb", "digits"]


@pytest.mark.slow
def test_task_failure_exits_70_and_the_same_command_then_runs(tmp_path, monkeypatch):
    from src.tasks.digits import Digits

    out = tmp_path / "run"

    def loss(self, model, batch):
        inputs, labels = batch
        return model(inputs.flatten(1)).sum()

    with monkeypatch.context() as broken:
        broken.setattr(Digits, "loss", loss)
        failed = run_main(*QUICK, "--output_dir", str(out))
    assert failed.returncode == EXIT_TASK_FAILED, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Digits.loss() failed on a batch [tensor float32 [32, 1, 8, 8], tensor int64 [32]]")
    assert "Traceback" not in failed.stderr
    assert_ok(run_main(*QUICK, "--output_dir", str(out)))  # nothing left behind blocks the retry
    assert [row["step"] for row in read_metrics(out) if "train/loss" in row] == [2, 4, 6]


def cpu_cannot_run(tmp_path: Path, config: str) -> Path:
    """A shipped accelerate config changed to ask for what CPU processes can't do."""
    text = (REPO / "accelerate_configs" / config).read_text()
    changed = {
        "ddp.yaml": text.replace("mixed_precision: 'no'", "mixed_precision: fp16"),
        "fsdp.yaml": text.replace("fsdp_version: 2", "fsdp_version: 1"),
    }[config]
    assert changed != text
    path = tmp_path / config
    path.write_text(changed)
    return path


@pytest.mark.parametrize(
    "config, message",
    [("ddp.yaml", "fp16 mixed precision needs a GPU"), ("fsdp.yaml", "asks for FSDP version 1")],
)  # fmt: skip
def test_launch_script_refuses_what_this_machine_cannot_run_in_one_line(tmp_path, capsys, config, message):
    """scripts/launch.py's config check, in this process as its main() calls it before anything else (a whole
    `python scripts/launch.py` refusing a config with one line and nothing more: tests/test_errors.py)."""
    from scripts.launch import exit_if_unusable

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    path = cpu_cannot_run(tmp_path, config)
    with pytest.raises(SystemExit) as stopped:
        exit_if_unusable(["--config_file", str(path), "--num_processes", "2", "train.py", *QUICK])
    captured = capsys.readouterr()
    result = subprocess.CompletedProcess("scripts/launch.py", stopped.value.code, captured.out, captured.err)
    assert result.stdout == ""
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line, nothing else
    assert result.stderr.startswith(f"error: accelerate config {path}: ")
    assert message in result.stderr


@pytest.mark.slow
def test_plain_accelerate_launch_of_fsdp_v1_says_why_once(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    command = [*launch_command(2), *QUICK, "--output_dir", str(tmp_path / "run")]
    command[command.index("accelerate_configs/ddp.yaml")] = str(cpu_cannot_run(tmp_path, "fsdp.yaml"))
    result = run_command(command)
    assert result.returncode != 0
    assert result.stderr.count("error: the accelerate config asks for FSDP version 1, which needs GPUs") == 1
    assert "exitcode  : 2" in result.stderr  # the launcher's report: a process stopped with it
    assert not (tmp_path / "run").exists()


def test_a_task_failing_on_its_data_or_model_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    """An error in the task's own build_datasets or build_model (a column of strings it turns into floats): one line
    naming the method, exit 70, no run folder."""
    from src.tasks.digits import Digits

    def build_datasets(self):
        return torch.tensor(["a string where a number belongs"]), None

    def build_model(self):
        return torch.nn.Linear(64, self.options.num_lables)

    for method in (build_datasets, build_model):
        out = tmp_path / method.__name__
        with monkeypatch.context() as broken:
            broken.setattr(Digits, method.__name__, method)
            failed = run_main(*QUICK, "--output_dir", str(out))
        assert failed.returncode == EXIT_TASK_FAILED, failed.stderr[-2000:]
        last = failed.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: Digits.{method.__name__}() failed: "), last
        assert "Traceback" not in failed.stderr and not out.exists()


def test_a_sample_that_does_not_read_is_one_line(tmp_path, monkeypatch):
    """Data the training loop reads (a corrupt file, here past the first batch): one line, exit 70, no traceback."""
    failed = run_with_unreadable_samples(monkeypatch, tmp_path / "run", first_bad=32)
    assert failed.returncode == EXIT_TASK_FAILED, failed.stderr[-2000:]
    line = r"error: reading a batch failed: OSError: sample \d+: truncated file \(--debug true shows the traceback\)"
    assert re.fullmatch(line, failed.stderr.strip().splitlines()[-1]) and "Traceback" not in failed.stderr


def test_a_failing_method_under_torch_no_grad_is_named_as_itself(tmp_path, monkeypatch):
    """@torch.no_grad() wraps a method in torch's `decorate_context`: the line names the method, not the wrapper (nor
    is every no_grad function's error the task's)."""
    from src.tasks.digits import Digits

    @torch.no_grad()
    def eval_outputs(self, model, batch):
        raise ValueError("an eval bug")

    monkeypatch.setattr(Digits, "eval_outputs", eval_outputs)
    failed = run_main(*QUICK, "--eval_steps", "2", "--output_dir", str(tmp_path / "run"))
    assert failed.returncode == EXIT_TASK_FAILED, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Digits.eval_outputs() failed on a batch ") and "ValueError: an eval bug" in last
    assert not (tmp_path / "run").exists() or not has_feature("preflight")  # said before training: nothing written


def test_an_empty_eval_split_is_one_line_before_training(tmp_path, monkeypatch):
    """A task's empty eval split (it evaluated to NaN): one line before the first step, nothing written."""
    from src.tasks.digits import Digits

    build_datasets = Digits.build_datasets
    monkeypatch.setattr(
        Digits, "build_datasets", lambda self: (lambda t, e: (t, torch.utils.data.Subset(e, [])))(*build_datasets(self))
    )
    failed = run_main(*QUICK, "--output_dir", str(tmp_path / "run"))
    line = "error: the eval split has no samples; give it some, or train without evaluating: --do_eval false"
    assert failed.stderr.strip().splitlines()[-1] == line, failed.stderr[-2000:]
    assert failed.returncode == 2 and not (tmp_path / "run").exists()


def test_a_task_method_failing_anywhere_in_the_run_is_one_line(tmp_path, monkeypatch):
    """Where train.py (or a forker's edit to it) calls the task decides nothing: derived_metrics(), called by
    evaluate() on the gathered scores, outside any batch, fails in one line naming it, as a loss() in the loop does."""
    from src.tasks.digits import Digits

    def derived_metrics(self, scores):
        raise ValueError("a scoring bug")

    monkeypatch.setattr(Digits, "derived_metrics", derived_metrics)
    failed = run_main(*QUICK, "--output_dir", str(tmp_path / "run"))
    assert failed.returncode == EXIT_TASK_FAILED, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert (
        last == "error: Digits.derived_metrics() failed: ValueError: a scoring bug (--debug true shows the traceback)"
    )
