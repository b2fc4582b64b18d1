"""Fine-tuning a small BERT on CPU: the template's loop against Hugging Face Trainer, side by side.

    python scripts/benchmark_trainer.py --output t.json          # 6 interleaved rounds, 1 process, CPU

Both sides fine-tune the same BERT-tiny-shaped classifier (2 layers, hidden 128, 2 heads, feed-forward 512; built
from a config with the tokenizer of scripts/make_tiny_model.py, which this runs if data/tiny/bert is missing) on
the same texts (scripts/make_text_data.py), with the same batch, AdamW, linear schedule with warmup, clipping and
`--dropout 0`: `template` is `train.main` with `--task text_classification`, `trainer` is `Trainer.train` with the
same tokenizer, `DataCollatorWithPadding` and `TrainingArguments`, dropping an epoch's short last batch as the
template does, so both sides train on the same padded batches at every step. Each run is a fresh process, the sides
alternating, so each round's ratio cancels the machine's drift. Samples/s is timed as scripts/benchmark.py does, at
every optimiser step over the steps after the first quarter (both sides step a `LambdaLR` once per optimiser step).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.benchmark import child_env, record_step_times, summarize  # noqa: E402

SIDES = ("template", "trainer")
WARMUP_STEPS = 10


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200, help="optimiser steps per run")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--data_root", type=Path, default=REPO / "data", help="holds tiny/bert and text/*.jsonl")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)  # the child's: the model folder
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 8 or args.batch < 1:
        parser.error("--rounds must be >= 1, --steps >= 8 (a quarter is skipped as warm-up) and --batch >= 1")
    return args


def made_here(args) -> None:
    """The tiny tokenizer and the text data, made where missing, as the docs' commands make them."""
    root = args.data_root.resolve()
    if not (root / "tiny/bert").is_dir():
        make = [sys.executable, str(REPO / "scripts/make_tiny_model.py"), "--kind", "bert", "--out"]
        subprocess.run([*make, str(root / "tiny/bert")], check=True)
    if not (root / "text/train.jsonl").is_file():
        make = [sys.executable, str(REPO / "scripts/make_text_data.py"), "--out", str(root / "text")]
        subprocess.run(make, check=True)


def make_model(tokenizer_folder: Path, out: Path) -> None:
    """A BERT-tiny-shaped encoder (no head: both sides add the same fresh classifier) with the tiny tokenizer."""
    import torch
    from transformers import BertTokenizer

    from scripts.make_tiny_model import bert_model

    tokenizer = BertTokenizer.from_pretrained(tokenizer_folder)
    torch.manual_seed(0)
    bert_model(tokenizer, hidden_size=128, intermediate_size=512).save_pretrained(out)
    tokenizer.save_pretrained(out)


def text_files(args) -> dict[str, str]:
    # the template's task reads the eval split too (unused here: --do_eval false)
    return {split: str(args.data_root.resolve() / f"text/{split}.jsonl") for split in ("train", "eval")}


def run_template(args) -> dict:
    times = record_step_times()
    import train

    with tempfile.TemporaryDirectory() as output_dir:
        train.main(
            [
                *("--task", "text_classification", "--model_name_or_path", str(args.model)),
                *("--data_files", json.dumps(text_files(args)), "--dropout", "0"),
                *("--max_steps", str(args.steps), "--global_batch_size", str(args.batch)),
                *("--per_device_train_batch_size", str(args.batch), "--learning_rate", "1e-3", "--weight_decay", "0"),
                *("--lr_scheduler_type", "linear", "--warmup_steps", str(WARMUP_STEPS)),
                *("--do_eval", "false", "--save_steps", "0", "--report_to", "none", "--logging_steps", "50"),
                *("--output_dir", output_dir),
            ]
        )
    import torch

    return summarize(times, args.batch, torch.device("cpu"))


def run_trainer(args) -> dict:
    times = record_step_times()
    import torch
    from datasets import load_dataset
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_dataset("json", data_files=text_files(args)["train"], split="train")
    labels = sorted(set(data["label"]))
    data = data.map(
        lambda rows: (
            tokenizer(rows["text"], truncation=True, max_length=128)
            | {"labels": [labels.index(label) for label in rows["label"]]}
        ),
        batched=True,
        remove_columns=data.column_names,
    )
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(labels), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            learning_rate=1e-3,
            weight_decay=0.0,
            lr_scheduler_type="linear",
            warmup_steps=WARMUP_STEPS,
            max_grad_norm=1.0,
            dataloader_drop_last=True,  # as the template: no short batch at an epoch's end shifting every later one
            logging_steps=50,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model, args=training_args, train_dataset=data, data_collator=DataCollatorWithPadding(tokenizer)
        )
        trainer.train()
    return summarize(times, args.batch, torch.device("cpu"))


def run_side(args, side: str, model: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", side, "--model", str(model), "--result", str(result)]
        command += ["--steps", str(args.steps), "--batch", str(args.batch), "--data_root", str(args.data_root)]
        completed = subprocess.run(command, cwd=REPO, env=child_env("default"), capture_output=True, text=True)
        if completed.returncode != 0:
            sys.exit(f"error: the {side} run failed:\n{completed.stderr[-3000:]}")
        return json.loads(result.read_text())


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        result = run_template(args) if args.child == "template" else run_trainer(args)
        args.result.write_text(json.dumps(result))
        return {}
    made_here(args)
    runs = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as model:
        make_model(args.data_root.resolve() / "tiny/bert", Path(model))
        for round_index in range(args.rounds):
            for side in SIDES:
                runs[side].append(run_side(args, side, Path(model)))
            speeds = ", ".join(f"{side} {runs[side][-1]['samples_per_s']:7.0f}" for side in SIDES)
            print(f"round {round_index + 1}/{args.rounds}: samples/s {speeds}", flush=True)
    ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(runs["template"], runs["trainer"], strict=True)]
    report = {
        "settings": {"rounds": args.rounds, "steps": args.steps, "batch": args.batch},
        "round_ratios": ratios,
        "template/trainer": statistics.median(ratios),
        "runs": runs,
    }
    median = report["template/trainer"]
    print(f"template/trainer samples/s: median {median:.3f} (per round {min(ratios):.2f}-{max(ratios):.2f})")
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
