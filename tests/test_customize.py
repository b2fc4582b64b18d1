"""docs/customize.md, performed: a metric, a task and the EMA example from its code (the tabular task's part:
tests/test_tabular.py).

The code blocks are taken from the guide verbatim, each found by its first line (`# <its path>`), so the guide can't
rot: what a reader copies is what these tests run.
"""

import ast
import inspect
import json
import re
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from src.cli import parse_config
from src.errors import UsageError
from tests.conftest import (
    QUICK,
    REPO,
    assert_ok,
    assert_processes,
    last_row,
    read_metrics,
    run_main,
    run_ranks,
    series,
)
from tests.helpers import assert_error_line, guide_task_commands

GUIDE = (REPO / "docs" / "customize.md").read_text()


def code_block(first_line: str, language: str = "python") -> str:
    """The guide's one ```language block whose first line starts with `first_line`."""
    blocks = re.findall(rf"```{language}\n(.*?)```", GUIDE, flags=re.DOTALL)
    found = [block for block in blocks if block.startswith(first_line)]
    assert len(found) == 1, f"docs/customize.md: {len(found)} ```{language} blocks start with {first_line!r}"
    return found[0]


def test_guide_answers_where_things_are():
    assert "--task_args" not in GUIDE  # gone: a task's options are flags
    for path in ("src/tasks/<name>.py", "src/models/", "src/evaluate_metrics/<name>/<name>.py", "`Options`"):
        assert path in GUIDE, path
    for path in ("src/models/digits_cnn.py", "src/tasks/base.py"):
        assert (REPO / path).is_file(), path


@pytest.mark.slow
def test_the_guides_metric_on_the_digits(tmp_path):
    """The guide's f1_macro module, as written, is a metric of a run beside accuracy."""
    metric_dir = tmp_path / "f1_macro"
    metric_dir.mkdir()
    (metric_dir / "f1_macro.py").write_text(code_block("# src/evaluate_metrics/f1_macro/f1_macro.py"))
    out = tmp_path / "run"
    result = run_main("--max_steps", "120", "--metrics", f"[accuracy, {metric_dir}]", "--output_dir", str(out))
    assert_ok(result)
    final = last_row(read_metrics(out))
    assert final["eval/accuracy"] > 0.9 and final["eval/num_samples"] == 359
    assert 0.85 < final["eval/f1_macro"] <= 1.0


def test_a_task_written_from_the_guide_trains_the_same_on_1_and_2_processes(request, tmp_path, monkeypatch, capsys):
    """The guide's task file, verbatim, where the guide puts it: its collate_fn pads variable-length samples, its
    typed option is a flag saved in config.yaml, and 1 and 2 processes train it identically, to well above chance
    (a bar below what the template's AdamW reaches: a forker may train with another optimiser).
    The runs are the guide's own two commands (tests/helpers.py: guide_task_commands, which tests/test_docs.py runs
    as written); the option's checks and help in this process, the file in a package of its own."""
    cwd = guide_task_commands(request)
    data = cwd / "data" / "sequences"
    assert [len((data / f"{split}.jsonl").read_text().splitlines()) for split in ("train", "eval")] == [640, 101]
    runs = {1: cwd / "run1", 2: cwd / "run2"}  # `python train.py ...`, then `accelerate launch ... ddp.yaml ...`
    for n, out in runs.items():
        assert_processes(out, n)
        assert yaml.safe_load((out / "config.yaml").read_text())["learning_rate"] == 1e-2  # GUIDE_TASK_RUN's
    one, two = (read_metrics(runs[n]) for n in (1, 2))
    losses = [series(rows, "train/loss") for rows in (one, two)]
    assert list(losses[0]) == list(range(1, 61)) == list(losses[1])
    torch.testing.assert_close(torch.tensor(list(losses[1].values())), torch.tensor(list(losses[0].values())),
                               atol=1e-5, rtol=0)  # fmt: skip
    final = [last_row(rows) for rows in (one, two)]
    assert final[0]["eval/num_samples"] == final[1]["eval/num_samples"] == 101
    assert final[0]["eval/accuracy"] == final[1]["eval/accuracy"] > 0.6  # 3 classes: chance is 1/3

    saved = yaml.safe_load((runs[2] / "config.yaml").read_text())
    assert saved["task"] == "src.tasks.sequences" and saved["embedding_dim"] == 16
    assert saved["tokens_column"] == "tokens" and "task_args" not in saved

    package = tmp_path / "guide_tasks"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sequences.py").write_text(code_block("# src/tasks/sequences.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    files = f"{{train: {data / 'train.jsonl'}, eval: {data / 'eval.jsonl'}}}"
    task = ["--task", "guide_tasks.sequences", "--data_files", files]
    try:
        with pytest.raises(UsageError, match=r"--embeding_dim 16; did you mean --embedding_dim\?"):
            parse_config([*task, "--embeding_dim", "16"])
        with pytest.raises(UsageError, match=r"--embedding_dim must be a whole number \(got x\)"):
            parse_config([*task, "--embedding_dim", "x"])
        with pytest.raises(SystemExit):
            parse_config([*task, "--help"])
        assert "--embedding_dim EMBEDDING_DIM" in capsys.readouterr().out
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "guide_tasks"]:
            del sys.modules[name]


# The EMA of scripts/examples/ema.py attached to train.py where docs/customize.md puts it, without editing the file:
# made when the model and optimiser are prepared, updated by a hook after each optimiser step. Run with it in this
# process (1 process), or in the script below (launched on 2).
ATTACH_EMA = """
import accelerate, torch
from scripts.examples.ema import EMA

made, models, optimizers = [], [], []
prepare = accelerate.Accelerator.prepare

def prepare_with_an_ema(self, *objects, **kwargs):
    prepared = prepare(self, *objects, **kwargs)
    models.extend(o for o in (prepared if len(objects) > 1 else [prepared]) if isinstance(o, torch.nn.Module))
    optimizers.extend(o for o in objects if isinstance(o, torch.optim.Optimizer))  # the torch optimizer itself
    if models and optimizers and not made:
        model = models[0]
        ema = EMA(self, model, decay=0.95)
        optimizers[0].register_step_post_hook(lambda *_: ema.update(model))  # after every optimiser step
        made.append(ema)
    return prepared
"""

# train.py with the EMA attached; at the end each process writes its EMA as a model folder,
# <output_dir>/ema<rank>/model.safetensors.
WITH_EMA = """
import os, sys
sys.path.insert(0, {repo!r})
{attach}
accelerate.Accelerator.prepare = prepare_with_an_ema
from safetensors.torch import save_file
import train
train.main(sys.argv[1:])
(ema,) = made
folder = os.path.join(sys.argv[sys.argv.index("--output_dir") + 1], "ema" + os.environ.get("RANK", "0"))
os.makedirs(folder)
save_file(ema.model.state_dict(), os.path.join(folder, "model.safetensors"))
"""


def test_the_guides_ema_calls_are_the_examples():
    """docs/customize.md's lines for train.py import scripts/examples/ema.py's EMA and call only what it has."""
    from scripts.examples.ema import EMA

    tree = ast.parse(code_block("# train.py: an EMA of the weights"))
    imported = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert [(node.module, [a.name for a in node.names]) for node in imported] == [("scripts.examples.ema", ["EMA"])]
    attributes = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute)]
    used = {node.attr for node in attributes if ast.unparse(node.value) == "ema"}
    assert used == {"update", "model"} and all(hasattr(EMA, name) for name in used)
    (made,) = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "EMA"]
    inspect.signature(EMA).bind(*made.args, **{keyword.arg: None for keyword in made.keywords})


def test_the_ema_refuses_sharded_weights():
    """Under FSDP or ZeRO-3 each process holds shards: one line, not deepcopy's assertion."""
    from types import SimpleNamespace

    from scripts.examples.ema import EMA

    for kind, stage in [("FSDP", None), ("DEEPSPEED", 3)]:  # FSDP: FSDP2 and FSDP1 alike
        plugin = SimpleNamespace(zero_stage=stage)
        sharded = SimpleNamespace(
            distributed_type=SimpleNamespace(value=kind), state=SimpleNamespace(deepspeed_plugin=plugin)
        )
        with pytest.raises(UsageError, match="needs whole weights on each process"):
            EMA(sharded, torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_the_guides_ema_is_the_same_on_1_and_2_processes_and_survives_a_resume(tmp_path):
    """The guide's EMA in train.py's loop: the averaged weights are the same on 1 and 2 processes, are not the final
    weights, evaluate as a model folder, and a run resumed from a mid-way checkpoint ends with the same average (the
    EMA is registered for checkpointing)."""
    import accelerate

    script = tmp_path / "train_with_ema.py"
    script.write_text(WITH_EMA.format(repo=str(REPO), attach=ATTACH_EMA))

    def run(processes: int, out, *extra: str) -> dict[str, torch.Tensor]:
        args = ["--learning_rate", "1e-3", "--max_steps", "40", "--save_steps", "20", "--logging_steps", "10",
                "--eval_steps", "1000", "--output_dir", str(out), *extra]  # fmt: skip
        if processes == 1:  # in this process: the same EMA, saved as the script saves it
            attached = {}
            exec(ATTACH_EMA, attached)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(accelerate.Accelerator, "prepare", attached["prepare_with_an_ema"])
                assert_ok(run_main(*args))
            (ema,) = attached["made"]
            (out / "ema0").mkdir()
            save_file(ema.model.state_dict(), out / "ema0" / "model.safetensors")
        else:
            assert_ok(run_ranks(script, args, processes))
        assert_processes(out, processes)
        averages = [load_file(out / f"ema{rank}" / "model.safetensors") for rank in range(processes)]
        for other in averages[1:]:  # each process's copy is the same
            assert all(torch.equal(other[name], averages[0][name]) for name in averages[0])
        return averages[0]

    one, two = run(1, tmp_path / "run1"), run(2, tmp_path / "run2")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=0)
    final = load_file(tmp_path / "run1" / "model" / "model.safetensors")
    assert max((one[name] - final[name]).abs().max().item() for name in one) > 1e-3  # the EMA is another model

    evaluated = run_main("--do_train", "false", "--model_name_or_path", str(tmp_path / "run1" / "ema0"),
                         "--output_dir", str(tmp_path / "ema_eval"))  # fmt: skip
    assert_ok(evaluated)
    ema_loss = json.loads((tmp_path / "ema_eval" / "eval_results.json").read_text())["eval/loss"]
    assert abs(ema_loss - last_row(read_metrics(tmp_path / "run1"))["eval/loss"]) > 1e-4

    resumed = run(1, tmp_path / "resumed", "--resume_from_checkpoint", str(tmp_path / "run1/checkpoints/step_20"))
    for name in one:
        torch.testing.assert_close(resumed[name], one[name], atol=1e-6, rtol=0)


IN_MEMORY_TASK = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from src.tasks.classification import ClassificationTask


class Sign(ClassificationTask):
    \"\"\"Data made in memory, no files: the sign of a number.\"\"\"

    def build_datasets(self):
        x = torch.linspace(-1, 1, 128).unsqueeze(1)
        return TensorDataset(x, (x[:, 0] > 0).long()), TensorDataset(x[::8], (x[::8, 0] > 0).long())

    def build_model(self):
        return nn.Linear(1, 2)


class SignEvaluated(Sign):
    def build_eval_dataset(self, split, labelled=True):
        x = torch.linspace(-1, 1, 16).unsqueeze(1)
        return TensorDataset(x, (x[:, 0] > 0).long()) if labelled else TensorDataset(x)
"""


@pytest.mark.slow
def test_a_task_with_its_own_data_needs_no_data_files_and_says_what_evaluation_needs(tmp_path, monkeypatch):
    """A task that makes its data trains and predicts without --data_files (rows without ids); evaluating one without
    build_eval_dataset() and without training is one error line naming that method, exit 2, before anything is
    written."""
    (tmp_path / "sign_task.py").write_text(IN_MEMORY_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))  # the runs: in this process
    try:
        trained = run_main("--task", "sign_task.SignEvaluated", *QUICK, "--do_predict", "true",
                           "--output_dir", str(tmp_path / "run"))  # fmt: skip
        assert_ok(trained)
        evaluated = run_main("--task", "sign_task.Sign", "--do_train", "false", "--model_name_or_path",
                             str(tmp_path / "run"), "--output_dir", str(tmp_path / "eval"))  # fmt: skip
    finally:
        sys.modules.pop("sign_task", None)
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and set(rows[0]) == {"prediction", "probabilities"}
    assert_error_line(evaluated, r"--task Sign has no build_eval_dataset\(split, labelled\).*docs/customize.md")
    assert not (tmp_path / "eval").exists()
