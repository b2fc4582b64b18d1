"""Fine-tune a Hugging Face model to classify texts (or text pairs): `--task text_classification`.

    python train.py --task text_classification --model_name_or_path bert-base-uncased \
        --data_files '{train: my/train.jsonl, eval: my/eval.jsonl}' --text_column sentence --label_column label

`AutoModelForSequenceClassification` + `AutoTokenizer` (option names as in transformers' run_glue_no_trainer.py).
Texts are tokenised once (`datasets.map`, cached, on the main process first) and padded per batch
(`DataCollatorWithPadding`). Labels may be integers or strings; the label map is saved with the model
(`id2label` / `label2id`), so `model/` loads with `from_pretrained` and works in a `pipeline`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from src.errors import UsageError
from src.tasks.hf import HuggingFaceTask, check_dropout, main_process_first


class TextClassification(HuggingFaceTask):
    @dataclass
    class Options:
        model_name_or_path: str | None = None  # a local model folder or a Hub name (bert-base-uncased)
        tokenizer_name: str | None = None  # None: the model's
        config_overrides: str | None = None  # applied to the model's config, e.g. "num_hidden_layers=2"
        text_column: str = "text"
        text_pair_column: str | None = None  # a second text per example (sentence pairs)
        label_column: str = "label"  # integers or strings: the label map is saved with the model
        max_length: int = 128  # tokens per example; longer texts are truncated
        dropout: float | None = None  # every dropout probability of the model; None: the model's own

        def __post_init__(self):
            if self.max_length <= 0:
                raise UsageError(f"--max_length must be > 0 (got {self.max_length})")
            check_dropout(self.dropout)

    metrics = ["accuracy"]

    def build_datasets(self):
        options = self.options
        columns = [options.text_column, options.label_column, *filter(None, [options.text_pair_column])]
        train, evals = self.load_text_splits(columns, "--text_column / --text_pair_column / --label_column")
        self.labels = sorted(set(train[options.label_column]))  # ids in sorted order: the same on every process
        unknown = set(evals[options.label_column]) - set(self.labels)
        if unknown:
            raise UsageError(f"the eval split has labels the train split lacks: {sorted(unknown)[:5]}")
        with main_process_first():
            return self.tokenize(train), self.tokenize(evals)

    def tokenize(self, split):
        options, label_ids = self.options, {label: i for i, label in enumerate(self.labels)}

        def encode(rows: dict) -> dict:
            pairs = rows[options.text_pair_column] if options.text_pair_column else None
            encoded = self.tokenizer(rows[options.text_column], pairs, truncation=True, max_length=options.max_length)
            return {**encoded, "labels": [label_ids[label] for label in rows[options.label_column]]}

        return split.map(encode, batched=True, remove_columns=split.column_names, desc="tokenizing")

    def collate_fn(self):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(self.tokenizer, return_tensors="pt")  # pads each batch to its longest text

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForSequenceClassification

        id2label = {i: str(label) for i, label in enumerate(self.labels)}
        label2id = {name: i for i, name in id2label.items()}
        config = self.model_config(num_labels=len(self.labels), id2label=id2label, label2id=label2id)
        return AutoModelForSequenceClassification.from_pretrained(self.model_path, config=config)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return model(**batch).loss  # the mean over the batch's examples

    def eval_outputs(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return {
            "loss": F.cross_entropy(logits.float(), labels, reduction="none"),
            "weight": torch.ones_like(labels, dtype=torch.float32),
            "predictions": logits.argmax(dim=-1),
            "references": labels,
        }
