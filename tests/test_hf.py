"""Hugging Face models: text_classification and language_modeling on a tiny local BERT / GPT-2 (offline), the same
training on 1 and 2 processes with padded variable-length batches, and a model/ that from_pretrained loads."""

import json
import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import (
    QUICK,
    assert_ok,
    assert_processes,
    last_row,
    read_metrics,
    run_command,
    run_main,
    run_on,
    run_python,
    run_with_hook,
    series,
    signal_at,
)
from tests.helpers import (
    PROMPTS,
    as_written,
    assert_bash_blocks_run,
    assert_same_training,
    classification,
    copy_of_the_repo,
    language_modeling,
    lm_eval_loss,
    losses,
    needs_package,
    packed_from_scratch,
    padded_lm,
    padded_lm_one_process,
    predict_only,
    predictions,
    printed_by,
    write_prompts,
)

pytestmark = needs_package("transformers", "pip install -r requirements/hf.txt")


@pytest.fixture(scope="module")
def assets(hf_assets) -> dict[str, str]:
    return hf_assets


def train_on_1_and_2_processes(tmp_path_factory, name: str, args: dict[int, list[str]]) -> dict:
    """{processes: output_dir} of one run per process count, each checked to have run on that many."""
    runs = {}
    for processes, flags in args.items():
        runs[processes] = tmp_path_factory.mktemp(f"{name}{processes}") / "run"
        assert_ok(run_on(processes, *flags, "--output_dir", str(runs[processes])))
        assert_processes(runs[processes], processes)
    return runs


@pytest.fixture(scope="module")
def classified(assets, tmp_path_factory) -> dict:
    """1 process (8 x 4 accumulated) and 2 processes (8 x 2 each) at the same global batch of 32: padded batches."""
    args = classification(assets, "--max_steps", "12", "--global_batch_size", "32")
    return train_on_1_and_2_processes(
        tmp_path_factory,
        "tc",
        {1: [*args, "--per_device_train_batch_size", "8"], 2: [*args, "--per_device_train_batch_size", "8"]},
    )


@pytest.mark.slow
def test_text_classification_trains_the_same_on_1_and_2_processes(classified):
    final = assert_same_training(classified, steps=12)
    assert final[0]["eval/accuracy"] == final[1]["eval/accuracy"] and final[0]["eval/num_samples"] > 0


def predict_with_from_pretrained(model_dir: Path, eval_file: str) -> dict:
    """The saved classifier as a user loads it (from_pretrained, and a transformers pipeline): its accuracy on the
    eval file, the pipeline's and the model's label for the first text, and its label names."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in Path(eval_file).read_text().splitlines()]
    with torch.no_grad():
        predicted = [model.config.id2label[model(**tokenizer(r["text"], truncation=True, max_length=128,
                     return_tensors="pt")).logits.argmax(-1).item()] for r in rows]  # fmt: skip
    classify = pipeline("text-classification", model=str(model_dir))
    return {"accuracy": sum(p == r["label"] for p, r in zip(predicted, rows, strict=True)) / len(rows),
            "pipeline": classify(rows[0]["text"])[0]["label"], "first": predicted[0],
            "labels": sorted(model.config.label2id)}  # fmt: skip


@pytest.mark.slow
def test_saved_model_loads_with_from_pretrained_and_reproduces_the_eval_accuracy(classified, assets):
    model_dir = classified[2] / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in model_dir.iterdir()
    }
    loaded = predict_with_from_pretrained(model_dir, assets["eval"])
    assert loaded["accuracy"] == last_row(read_metrics(classified[2]))["eval/accuracy"]  # exactly what the run logged
    labels = sorted({json.loads(line)["label"] for line in Path(assets["eval"]).read_text().splitlines()})
    assert loaded["labels"] == labels and all(isinstance(label, str) for label in labels)  # string labels kept
    assert loaded["pipeline"] == loaded["first"]


@pytest.mark.slow
def test_eval_only_and_predictions_from_a_runs_model_folder(classified, assets, tmp_path):
    """--do_train false on a trained classifier (its run folder -> model/), on 2 processes: the run's accuracy
    exactly, without its train file, and one prediction per eval line, in order, by label name."""
    out = tmp_path / "eval"
    data = f"{{train: {tmp_path}/absent.jsonl, eval: {assets['eval']}}}"
    result = run_on(2, "--task", "text_classification", "--do_train", "false", "--do_predict", "true",
                    "--model_name_or_path", str(classified[2]), "--data_files", data,
                    "--output_dir", str(out))  # fmt: skip
    assert_ok(result)
    final = [row for row in read_metrics(classified[2]) if "eval/accuracy" in row][-1]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval/accuracy"] == final["eval/accuracy"]
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    texts = [json.loads(line) for line in Path(assets["eval"]).read_text().splitlines()]
    assert len(rows) == len(texts)
    correct = sum(row["prediction"] == text["label"] for row, text in zip(rows, texts, strict=True))
    assert correct / len(texts) == final["eval/accuracy"]  # string labels, in input order


@pytest.mark.slow
def test_eval_only_with_a_runs_own_config_evaluates_the_trained_model(classified, tmp_path):
    """`--config runs/x/config.yaml --do_train false`: the config names the model the run started from; what is
    evaluated is the run's trained model/, to the run's final accuracy (the base model's classifier head is
    untrained)."""
    run = tmp_path / "run"
    shutil.copytree(classified[1], run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "output_dir": str(run)}))
    result = run_main("--config", str(run / "config.yaml"), "--do_train", "false")
    assert_ok(result)
    assert f"using the model in {run / 'model'}; nothing is trained" in result.stderr
    final = [row for row in read_metrics(run) if "eval/accuracy" in row][-1]
    results = json.loads((run / "eval_results.json").read_text())
    assert results["eval/accuracy"] == final["eval/accuracy"]
    assert results["eval/loss"] == pytest.approx(final["eval/loss"], abs=1e-5)


@pytest.fixture(scope="module")
def modeled(request, assets, tmp_path_factory) -> dict:
    """Padded texts: 1 process with one batch of 16 vs 2 processes with 4 x 2 each. Per-micro-batch means would
    differ (each micro-batch has its own token count); the tokens of the global batch normalise both the same. The
    1-process run is the one tests/test_sharded.py compares FSDP2 and ZeRO with (trained once for both)."""
    one = padded_lm_one_process(request, assets)
    assert_processes(one, 1)
    return {1: one, **train_on_1_and_2_processes(tmp_path_factory, "lm", {2: padded_lm(assets, 4)})}


@pytest.mark.slow
def test_language_modeling_normalises_by_the_global_token_count(modeled):
    final = assert_same_training(modeled, steps=8)
    assert final[0]["eval/perplexity"] == pytest.approx(math.exp(final[0]["eval/loss"]))


PER_MICRO_BATCH_MEAN = """
from src.features.hf.language_modeling import LanguageModeling
def mean_loss(self, model, batch):
    losses, counted = self.token_losses(model, batch)
    return losses.sum() / counted.sum()
LanguageModeling.loss_reduction, LanguageModeling.loss = "mean", mean_loss
"""


@pytest.mark.slow
def test_per_micro_batch_means_would_train_differently(assets, modeled, tmp_path, monkeypatch):
    """The control for the test above: the same two runs with each micro-batch's own token mean drift apart. The 2
    processes get the patch through the wrapper script; the 1 process runs here, patched by the same code and put
    back after the test."""
    from src.features.hf.language_modeling import LanguageModeling

    runs = {processes: tmp_path / f"p{processes}" for processes in (1, 2)}

    def args(processes: int, per_device: str) -> list[str]:
        return language_modeling(assets, "--max_steps", "8", "--global_batch_size", "16",
                                 "--per_device_train_batch_size", per_device,
                                 "--output_dir", str(runs[processes]))  # fmt: skip

    assert_ok(run_with_hook(tmp_path, args(2, "4"), extra=PER_MICRO_BATCH_MEAN, processes=2))
    for name in ("loss_reduction", "loss"):  # monkeypatch puts these back after the test
        monkeypatch.setattr(LanguageModeling, name, getattr(LanguageModeling, name))
    exec(PER_MICRO_BATCH_MEAN, {})
    assert_ok(run_main(*args(1, "16")))
    for processes in (1, 2):
        assert_processes(runs[processes], processes)
    one, two = losses(runs[1]), losses(runs[2])
    assert (two - one).abs().max() > 1e-3, (one, two)
    torch.testing.assert_close(one, losses(modeled[1]), rtol=0, atol=1e-5)  # one batch of 16: mean is the mean


@pytest.mark.slow
def test_saved_language_model_reproduces_the_eval_loss(modeled, assets):
    loss = lm_eval_loss(modeled[2] / "model", assets["eval"])
    assert loss == pytest.approx(last_row(read_metrics(modeled[2]))["eval/loss"], rel=1e-5)


@pytest.mark.slow
def test_packed_language_model_from_scratch(assets, tmp_path):
    out = tmp_path / "run"
    args = packed_from_scratch(assets, 4, "--output_dir", str(out))
    assert_ok(run_main(*args))
    config = json.loads((out / "model" / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"]) == (1, 32)


@pytest.mark.slow
def test_resumed_text_classification_continues_bit_for_bit(assets, tmp_path):
    full, out = tmp_path / "full", tmp_path / "run"
    args = classification(assets, "--max_steps", "10", "--save_steps", "4", "--per_device_train_batch_size", "8",
                          "--global_batch_size", "16")  # fmt: skip
    assert_ok(run_main(*args, "--output_dir", str(full)))
    resume = [*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    killed = run_with_hook(tmp_path, resume, signal_at(6))
    assert killed.returncode != 0
    assert_ok(run_main(*resume))
    assert series(read_metrics(out), "train/loss") == series(read_metrics(full), "train/loss")  # bit for bit
    exported = out / "checkpoints" / "step_8" / "model"  # every checkpoint also in Hugging Face format
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exported.iterdir()}
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(exported)


@pytest.mark.slow
def test_text_pairs_are_one_input_with_two_separators(assets):
    """--text_pair_column: both texts in one input, [SEP] after each (here a line and its file:line id)."""
    from src.cli import parse_config
    from src.tasks import build_task

    config = parse_config(["--task", "text_classification", "--model_name_or_path", assets["bert"],
                           "--data_files", assets["data"], "--text_pair_column", "id"])  # fmt: skip
    task = build_task(config)
    train, _ = task.build_datasets()
    sample = train[0]["input_ids"]
    assert sample.count(task.tokenizer.sep_token_id) == 2 and sample[0] == task.tokenizer.cls_token_id
    batch = task.collate_fn()([train[0], train[1]])
    logits = task.build_model()(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert logits.shape == (2, 3)


@pytest.mark.slow
@pytest.mark.parametrize("blank", ["text", "label"])
def test_a_missing_text_or_label_is_one_line(assets, tmp_path, blank):
    """A blank cell in a CSV's text or label column: one line naming the column and split, before anything is
    tokenized (it was the tokenizer's traceback, or sorted()'s over the labels)."""
    from src.cli import parse_config
    from src.errors import UsageError
    from src.tasks import build_task

    rows = "text,label\ngood film,pos\nbad film,neg\n"
    (tmp_path / "eval.csv").write_text(rows)
    (tmp_path / "train.csv").write_text(rows + ("fine,\n" if blank == "label" else ",pos\n"))
    files = f"{{train: {tmp_path / 'train.csv'}, eval: {tmp_path / 'eval.csv'}}}"
    flags = ["--task", "text_classification", "--model_name_or_path", assets["bert"], "--data_files", files]
    with pytest.raises(UsageError, match=rf"^column '{blank}' has a missing value in the train split; fill them"):
        build_task(parse_config(flags)).build_datasets()


def test_offline_hub_model_fails_at_once_with_one_line(monkeypatch):
    from src.cli import parse_config
    from src.errors import UsageError
    from src.tasks import build_task

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = parse_config(["--task", "text_classification", "--model_name_or_path", "someone/not-cached-model",
                           "--data_files", "{train: t.jsonl, eval: e.jsonl}"])  # fmt: skip
    with pytest.raises(UsageError, match="model 'someone/not-cached-model' is not in the local cache and "
                                         "HF_HUB_OFFLINE is set; use a local model folder"):  # fmt: skip
        build_task(config).build_datasets()


@pytest.mark.parametrize("flags, message", [
    ([], "set --model_name_or_path to a local model folder or a Hub name"),
    (["--model_name_or_path", "no/such/folder"], "no such model folder"),
    (["--model_name_or_path", "src"], "a folder without config.json"),
])  # fmt: skip
def test_bad_model_source_is_one_line(flags, message):
    from src.cli import parse_config
    from src.errors import UsageError
    from src.tasks import build_task

    with pytest.raises(UsageError, match=message):
        build_task(parse_config(["--task", "language_modeling", "--data_files", "{train: t.jsonl, eval: e.jsonl}",
                                 *flags])).build_datasets()  # fmt: skip


WITHOUT_TRANSFORMERS = """
import importlib.abc, sys
class NotInstalled(importlib.abc.MetaPathFinder):  # as if transformers were not installed
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "transformers":
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, NotInstalled())
from src.errors import command_line
from train import main
for args in {runs!r}:  # each as its own command would run; the last one's exit status is the process's
    command_line(main)(args)
"""


@pytest.mark.slow
def test_transformers_is_optional(tmp_path):
    """Without transformers the digits example trains, and an HF task says how to install it in one line.
    (With transformers installed, `import evaluate` imports it: that is evaluate's doing, not a requirement.)"""
    digits = [*QUICK, "--output_dir", str(tmp_path / "run")]
    hf_task = ["--task", "text_classification", "--model_name_or_path", "x",
               "--data_files", "{train: a.json, eval: b.json}"]  # fmt: skip
    hf = run_python("-c", WITHOUT_TRANSFORMERS.format(runs=[digits, hf_task]))  # one process: the digits run first
    assert last_row(read_metrics(tmp_path / "run"))["eval/num_samples"] == 359
    assert hf.returncode == 2, hf.stderr[-3000:]
    assert hf.stderr.strip().splitlines()[-1] == (
        "error: the Hugging Face tasks need transformers: pip install -r requirements/hf.txt"
    )


def run_as_written(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A page's command as written, from `cwd`: `python train.py args` as run_main, `python -c code` executed in this
    process (its stdout captured), `accelerate launch` as processes of their own. An interpreter start for a 1-process
    command would add nothing a fresh process checks here: what the commands write and print is what is read."""
    words = shlex.split(command)
    if words[:2] == ["python", "train.py"]:
        return run_main(*words[2:], cwd=cwd)
    if words[:2] == ["python", "-c"] and len(words) == 3:
        return subprocess.CompletedProcess(words, 0, printed_by(command, cwd), "")
    assert words[:2] == ["accelerate", "launch"], command
    return run_command(as_written(command), cwd=cwd)


@pytest.mark.slow
def test_readme_hugging_face_commands_run_as_written(tmp_path, assets):
    """The page's offline path, verbatim, in a copy of the repo: train on 2 processes, classify with a pipeline
    from model/, train the language model; then its adapters section: LoRA on that language model, eval-only from
    the run's config.yaml, a pipeline from the adapter folder (the 1-process ones in this process: run_as_written).
    The first command, which makes the tiny models and data, is the hf_assets fixture's (tests/conftest.py: both
    scripts with their defaults): its folders are copied in."""
    from scripts.readme_commands import section_commands

    copy = copy_of_the_repo(tmp_path / "repo")
    for made in ("tiny", "text"):
        shutil.copytree(Path(assets["root"]) / made, copy / "data" / made)
    commands = section_commands("Hugging Face models", page="docs/hugging_face.md")
    assert len(commands) == 4 and commands[0] == "python scripts/make_tiny_model.py && python scripts/make_text_data.py"
    results = [run_as_written(c, copy) for c in commands[1:]]
    for result in results:
        assert_ok(result)
    assert "'label': 'comment'" in results[1].stdout  # the pipeline from model/ reads '# a comment' as one
    assert_processes(copy / "runs" / "text_classification", 2)
    classified = last_row(read_metrics(copy / "runs" / "text_classification"))
    modeled = last_row(read_metrics(copy / "runs" / "language_modeling"))
    assert classified["eval/accuracy"] > 0.9, classified
    assert modeled["eval/loss"] < 0.8 * math.log(2000), modeled  # well below a uniform guess over the vocabulary

    adapter_commands = section_commands("Adapters (LoRA)", page="docs/hugging_face.md")
    results = [run_as_written(c, copy) for c in adapter_commands]
    for result in results:
        assert_ok(result)
    adapted = copy / "runs" / "gpt2_lora"
    trained = read_metrics(adapted)
    assert trained[0]["setup/trainable_parameters"] < trained[0]["setup/parameters"] / 50  # the adapters only
    assert last_row(trained)["eval/loss"] < modeled["eval/loss"]  # better than the base model they adapt
    assert json.loads((adapted / "eval_results.json").read_text())["eval/loss"] == pytest.approx(
        last_row(trained)["eval/loss"], abs=1e-6
    )  # the eval-only command evaluated the adapter, not the base model
    # transformers' pipeline loaded the adapter folder (the text's repr is in double quotes where it holds a quote)
    assert re.search(r"'generated_text': ['\"]def ", results[2].stdout), results[2].stdout


@pytest.mark.slow
def test_gradient_checkpointing_and_bf16_with_a_transformers_model(assets, tmp_path):
    """transformers' own activation checkpointing recomputes and trains the same, without its deprecation warning
    (5.x renamed gradient_checkpointing_enable); bf16 autocast runs."""
    import warnings

    runs = {}
    for name, flags in {"plain": [], "checkpointed": ["--gradient_checkpointing", "true"],
                        "bf16": ["--mixed_precision", "bf16"]}.items():  # fmt: skip
        out = tmp_path / name
        args = language_modeling(assets, "--max_steps", "4", "--per_device_train_batch_size", "8",
                                 "--global_batch_size", "8", "--output_dir", str(out), *flags)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_ok(run_main(*args))
        assert [str(w.message) for w in caught if "checkpointing" in str(w.message)] == []
        runs[name] = out
    torch.testing.assert_close(losses(runs["checkpointed"]), losses(runs["plain"]), rtol=0, atol=1e-5)
    bf16 = read_metrics(runs["bf16"])
    assert bf16[0]["setup/mixed_precision"] == "bf16"
    assert all(math.isfinite(v) for v in series(bf16, "train/loss").values())
    assert not torch.equal(losses(runs["bf16"]), losses(runs["plain"]))  # autocast really changed the arithmetic


def test_language_model_labels_ignore_padding_not_the_end_of_text_token():
    """GPT-2 pads with its end-of-text token: the labels must keep its real occurrences and drop only the padding."""
    from src.features.hf.language_modeling import IGNORE, pad_and_label

    def pad(samples):  # what DataCollatorWithPadding returns, with pad id 0 = end of text
        return {"input_ids": torch.tensor([[5, 0, 7, 0], [8, 9, 0, 0]]),
                "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])}  # fmt: skip

    labels = pad_and_label(pad, [])["labels"]
    assert labels.tolist() == [[5, 0, 7, IGNORE], [8, 9, 0, IGNORE]]


@pytest.mark.slow
@pytest.mark.parametrize("packing, processes", [("true", (2, 1)), ("false", (1, 1))])
def test_predictions_after_training_are_predict_only_s_with_the_input_ids(assets, tmp_path, packing, processes):
    """--do_predict in a training run generates from the test split's prompts, one row per input row with its id,
    exactly as --do_train false does from the saved model, on any process count; packed or not. 7 prompts (a prime:
    uneven shards), greedy continuations of one model the same on 2 processes and 1 (tests/test_predict.py: the
    byte model on 1 and 3); a prompt longer than the context (its end is kept) generates too. The prompts and the
    generation don't read --packing (it only shapes what is trained), so the unpacked model predicts alone on 1
    process: on 2 it would run the packed one's code."""
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    train_file, eval_file = (Path(assets["eval"]).with_name(f"{split}.jsonl") for split in ("train", "eval"))
    data = f"{{train: {train_file}, eval: {eval_file}, test: {prompts}}}"
    trained, *predicting = processes
    out = tmp_path / "trained"
    args = language_modeling(assets, "--packing", packing, "--max_steps", "2", "--global_batch_size", "8",
                             "--per_device_train_batch_size", "4", "--max_new_tokens", "8")  # fmt: skip
    args[args.index("--data_files") + 1] = data
    assert_ok(run_on(trained, *args, "--do_predict", "true", "--output_dir", str(out)))
    rows = predictions(out)
    assert [row["id"] for row in rows] == [f"p{i}" for i in range(len(PROMPTS))]
    assert all(isinstance(row["generated"], str) for row in rows) and any(row["generated"] for row in rows)
    for count in predicting:
        alone = tmp_path / f"predict{count}"
        assert_ok(run_on(count, *predict_only(out / "model", prompts, alone)))
        assert predictions(alone) == rows


@pytest.mark.parametrize(
    "overrides, head_dim, message",
    [
        ("hidden_size=96", 24, None),  # head_dim follows hidden_size / num_attention_heads, as a new config derives it
        ("num_attention_heads=8,num_key_value_heads=8", 8, None),
        ("hidden_size=96,head_dim=32", 32, None),  # said explicitly: kept
        ("hidden_size=90", None, "hidden_size 90 is not divisible by num_attention_heads 4"),
        ("num_attention_heads=8", 8, None),  # 4 key/value heads: grouped-query attention
        ("num_key_value_heads=3", None, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ],
)
def test_config_overrides_keep_derived_fields_consistent(overrides, head_dim, message):
    from transformers import LlamaConfig

    from src.errors import UsageError
    from src.features.hf.base import apply_overrides

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1)
    assert config.head_dim == 16
    if message is None:
        apply_overrides(config, overrides)
        assert config.head_dim == head_dim
    else:
        with pytest.raises(UsageError, match=message):
            apply_overrides(config, overrides)
    explicit = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32)  # not derived: cannot be followed
    with pytest.raises(UsageError, match="head_dim 32 is not hidden_size / num_attention_heads; set head_dim too"):
        apply_overrides(explicit, "hidden_size=96")


def test_every_command_of_the_page_is_run():
    assert_bash_blocks_run("docs/hugging_face.md")
