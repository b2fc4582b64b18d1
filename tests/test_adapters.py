"""LoRA adapters (`--peft lora`, src/features/hf/adapters.py) on the tiny GPT-2 and BERT: the same training on 1 and 2
processes and under FSDP2 and ZeRO-2/3, only the adapter trained and saved (gathered from every shard), model/ reloaded
by PEFT's and transformers' own loaders to the logged eval metrics, eval-only, predict and the best model on adapter
runs, a merged model, and one line for each bad option."""

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import QUICK, assert_ok, assert_processes, last_row, read_metrics, run_main, run_on, run_python
from tests.helpers import (
    STRATEGIES,
    assert_error_line,
    assert_same_training,
    classification,
    language_modeling,
    lm_eval_loss,
    needs_package,
    strategy_params,
)

pytestmark = [pytest.mark.slow, needs_package("peft", "pip install -r requirements/hf.txt")]

LORA = ["--peft", "lora", "--learning_rate", "3e-2", "--warmup_steps", "0"]  # fast enough to move off the base


def lora_lm(assets, per_device: int, *args) -> list[str]:
    return language_modeling(assets, *LORA, "--max_steps", "8", "--global_batch_size", "16",
                             "--per_device_train_batch_size", str(per_device), "--mixed_precision", "no",
                             *args)  # fmt: skip


def adapter_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "model" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def lm_runs(hf_assets, tmp_path_factory) -> dict[int, Path]:
    """1 process (16 per step), saving the merged model; 2 processes (4 x 2 accumulated each), saving the adapter."""
    runs = {n: tmp_path_factory.mktemp(f"lora{n}") / "run" for n in (1, 2)}
    assert_ok(run_main(*lora_lm(hf_assets, 16, "--merge_adapter", "true"), "--output_dir", str(runs[1])))
    assert_ok(run_on(2, *lora_lm(hf_assets, 4), "--output_dir", str(runs[2])))
    assert_processes(runs[2], 2)
    return runs


def test_only_the_adapter_trains_the_same_on_1_and_2_processes(lm_runs, hf_assets):
    assert_same_training(lm_runs, steps=8)
    setup = read_metrics(lm_runs[2])[0]
    assert setup["setup/trainable_parameters"] == 4096  # rank 8 on c_attn (64 -> 192) in 2 blocks: 2 x 8 x 256
    assert setup["setup/parameters"] > 50 * setup["setup/trainable_parameters"]
    model = lm_runs[2] / "model"
    assert not (model / "model.safetensors").exists() and not (model / "config.json").exists()  # the adapter alone
    saved = json.loads((model / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(Path(hf_assets["gpt2"]).resolve())  # loads from any directory
    assert sorted(adapter_weights(lm_runs[2])) == [
        f"base_model.model.transformer.h.{i}.attn.c_attn.lora_{ab}.weight" for i in (0, 1) for ab in "AB"
    ]


@pytest.mark.parametrize("loader", ["peft", "transformers"])
def test_peft_and_transformers_reload_the_adapter_to_the_logged_eval_loss(lm_runs, hf_assets, loader):
    loss = lm_eval_loss(lm_runs[2] / "model", hf_assets["eval"], peft=loader == "peft")
    assert loss == pytest.approx(last_row(read_metrics(lm_runs[2]))["eval/loss"], rel=1e-5)


def test_the_merged_model_loads_with_from_pretrained_to_the_eval_loss(lm_runs, hf_assets):
    model = lm_runs[1] / "model"
    assert (model / "config.json").is_file() and not (model / "adapter_config.json").exists()
    assert lm_eval_loss(model, hf_assets["eval"]) == pytest.approx(
        last_row(read_metrics(lm_runs[1]))["eval/loss"], rel=1e-5
    )


@pytest.mark.parametrize("processes", [1, 2])
def test_eval_only_and_predict_on_the_adapter_folder(lm_runs, hf_assets, tmp_path, processes):
    """On 2 CPU processes too, where Accelerate would put DDP around the frozen model (which refuses it)."""
    args = language_modeling(hf_assets, "--do_train", "false", "--do_predict", "true", "--max_new_tokens", "4")
    out = tmp_path / "eval"
    assert_ok(run_on(processes, *args, "--model_name_or_path", str(lm_runs[2] / "model"), "--output_dir", str(out)))
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval/loss"] == pytest.approx(last_row(read_metrics(lm_runs[2]))["eval/loss"], abs=1e-6)
    rows = (out / "predictions.jsonl").read_text().splitlines()
    assert len(rows) == results["eval/num_samples"] == 401


# --- under FSDP2 and DeepSpeed: the adapter gathered from every shard ---


@pytest.mark.parametrize("config", strategy_params())
def test_sharded_adapter_trains_and_saves_as_ddp_does(lm_runs, hf_assets, tmp_path, config):
    out = tmp_path / "run"
    result = run_on(2, *lora_lm(hf_assets, 4), "--output_dir", str(out), config=config)
    assert_ok(result)
    assert "FutureWarning" not in result.stdout + result.stderr  # the libraries' own: quiet_peft, DeepSpeed's filter
    assert_processes(out, 2)
    assert read_metrics(out)[0]["setup/strategy"] == STRATEGIES[config]
    assert_same_training({1: lm_runs[2], 2: out}, steps=8)
    saved, expected = adapter_weights(out), adapter_weights(lm_runs[2])
    assert sorted(saved) == sorted(expected)  # the adapter alone, every tensor whole
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-5)


# --- a classifier: its label map saved beside the adapter, the best checkpoint kept ---


def classifier_accuracy(model_dir: Path, eval_file: str) -> float:
    """The eval accuracy of a saved classifier adapter, loaded by PEFT with the label map saved beside it."""
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoTokenizer

    id2label = {int(i): name for i, name in json.loads((model_dir / "labels.json").read_text())["id2label"].items()}
    model = AutoPeftModelForSequenceClassification.from_pretrained(model_dir, id2label=id2label).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in Path(eval_file).read_text().splitlines()]
    with torch.no_grad():
        logits = [model(**tokenizer(r["text"], truncation=True, max_length=128, return_tensors="pt")).logits[0]
                  for r in rows]  # fmt: skip
    predicted = [model.config.id2label[int(logit.argmax())] for logit in logits]
    return sum(p == r["label"] for p, r in zip(predicted, rows, strict=True)) / len(rows)


@pytest.fixture(scope="module")
def classifier(hf_assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_tc") / "run"
    args = classification(hf_assets, *LORA, "--max_steps", "12", "--eval_steps", "4", "--global_batch_size", "32",
                          "--metric_for_best_model", "accuracy", "--load_best_model_at_end", "true")  # fmt: skip
    assert_ok(run_main(*args, "--output_dir", str(out)))
    return out


def test_the_best_classifier_adapter_reloads_with_its_labels(classifier, hf_assets):
    best = json.loads((classifier / "eval_results.json").read_text())
    evals = [row["eval/accuracy"] for row in read_metrics(classifier) if "eval/accuracy" in row]
    assert best["eval/accuracy"] == max(evals) and len(set(evals)) > 1  # the adapter learned; the best is kept
    assert classifier_accuracy(classifier / "model", hf_assets["eval"]) == best["eval/accuracy"]


def test_eval_only_from_the_run_config_reproduces_the_best_and_predicts_label_names(classifier, hf_assets):
    best = json.loads((classifier / "eval_results.json").read_text())
    config = str(classifier / "config.yaml")
    assert_ok(run_main("--config", config, "--do_train", "false", "--do_predict", "true"))
    again = json.loads((classifier / "eval_results.json").read_text())
    assert again["eval/accuracy"] == best["eval/accuracy"]
    assert again["eval/loss"] == pytest.approx(best["eval/loss"], abs=1e-6)
    labels = {json.loads(line)["label"] for line in Path(hf_assets["eval"]).read_text().splitlines()}
    predicted = {json.loads(line)["prediction"] for line in (classifier / "predictions.jsonl").read_text().splitlines()}
    assert predicted <= labels


def test_reloading_a_classifier_adapter_reports_no_new_head(classifier, tmp_path):
    """transformers' load report of the base model would call the classifier head "newly initialized" at every
    eval or predict: the adapter brings it (a process of its own: the report goes to the real stderr)."""
    result = run_python("train.py", "--config", str(classifier / "config.yaml"), "--do_train", "false",
                        "--output_dir", str(tmp_path / "again"))  # fmt: skip
    assert_ok(result)
    assert "newly initialized" not in result.stderr and "MISSING" not in result.stderr


# --- bad input: one line, exit 2, nothing written ---


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (
            ["--lora_target_modules", "[c_atn]"],
            r"Target modules \{'c_atn'\} not found .*--lora_target_modules to "
            r"names of its Linear / Conv / Embedding modules: c_attn, c_fc, c_proj, lm_head, wpe, wte\)$",
        ),
        (["--from_scratch", "true"], r"--peft lora adapts a trained model: drop --from_scratch"),
        (["--lora_r", "0"], r"--lora_r and --lora_alpha must be > 0"),
        (["--model_name_or_path", "CTRL"], r"on CTRLLMHeadModel: Please specify `target_modules`.*--lora_target"),
    ],
    ids=["unknown module", "from scratch", "rank 0", "no default for the architecture"],
)
def test_bad_adapter_options(hf_assets, tmp_path, flags, pattern):
    if "CTRL" in flags:
        from transformers import CTRLConfig, CTRLLMHeadModel

        config = CTRLConfig(vocab_size=2000, n_embd=16, n_layer=1, n_head=2, dff=32, n_positions=64)
        CTRLLMHeadModel(config).save_pretrained(tmp_path / "ctrl")
        flags = ["--model_name_or_path", str(tmp_path / "ctrl"), "--tokenizer_name", hf_assets["gpt2"]]
    out = tmp_path / "run"
    assert_error_line(run_main(*language_modeling(hf_assets, "--peft", "lora", *QUICK, *flags), "--output_dir",
                               str(out)), pattern)  # fmt: skip
    assert not out.exists()


def test_merge_adapter_needs_an_adapter(hf_assets, tmp_path):
    out = tmp_path / "run"
    result = run_main(*classification(hf_assets, "--merge_adapter", "true", *QUICK), "--output_dir", str(out))
    assert_error_line(result, r"--merge_adapter true needs an adapter: add --peft lora")
    assert not out.exists()


def test_a_merged_classifier_adapter_classifies_in_a_pipeline_with_its_label_names(hf_assets, tmp_path):
    """--merge_adapter true on a classifier: a plain transformers classifier, which a pipeline names by its classes
    (the adapter folder's base config has no head for one: docs/hugging_face.md)."""
    from transformers import pipeline

    out = tmp_path / "merged"
    assert_ok(run_main(*classification(hf_assets, *LORA, "--merge_adapter", "true", *QUICK), "--output_dir", str(out)))
    rows = [json.loads(line) for line in Path(hf_assets["eval"]).read_text().splitlines()]
    labels = {row["label"] for row in rows}
    predicted = [result["label"] for result in pipeline("text-classification", model=str(out / "model"))(
        [row["text"] for row in rows[:8]])]  # fmt: skip
    assert set(predicted) <= labels and len(labels) > 1, (predicted, labels)
