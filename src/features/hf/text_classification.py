"""Fine-tune a Hugging Face model to classify texts (or text pairs): `--task text_classification`.

    python train.py --task text_classification --model_name_or_path bert-base-uncased \
        --data_files '{train: my/train.jsonl, eval: my/eval.jsonl}' --text_column sentence --label_column label

`AutoModelForSequenceClassification` + `AutoTokenizer` (option names as in transformers' run_glue_no_trainer.py).
Texts are tokenised once (`datasets.map`, cached, on the main process first) and padded per batch
(`DataCollatorWithPadding`). Labels may be integers or strings; the label map is saved with the model
(`id2label` / `label2id`), so `model/` loads with `from_pretrained` and works in a `pipeline`.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from src.errors import UsageError
from src.features.hf.adapters import AdapterOptions
from src.features.hf.base import HuggingFaceTask, check_dropout, main_process_first
from src.tasks.classification import label_maps, save_labels


class TextClassification(HuggingFaceTask):
    @dataclass
    class Options(AdapterOptions):
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
            self.check_adapter_options()

    metrics = ["accuracy"]
    peft_task_type = "SEQ_CLS"  # --peft lora: the new classifier head trains (and is saved) with the adapters
    labels: list | None = None  # the class names in id order: from the train split, or a trained model's config

    def build_datasets(self):
        options = self.options
        train, evals = self.load_text_splits(self.columns(labelled=True), self.COLUMN_FLAGS)
        self.labels = sorted(set(train[options.label_column]))  # ids in sorted order: the same on every process
        with main_process_first():
            return self.tokenize(train), self.tokenize(evals)

    def build_eval_dataset(self, split: str, labelled: bool = True):
        (data,) = self.load_text_splits(self.columns(labelled), self.COLUMN_FLAGS, [split])
        if self.labels is None:  # no training in this run: the label map saved with the model
            id2label = self.model_config().id2label
            self.labels = [id2label[i] for i in range(len(id2label))]
        with main_process_first():
            return self.tokenize(data, labelled)

    COLUMN_FLAGS = "--text_column / --text_pair_column / --label_column"

    def columns(self, labelled: bool) -> list[str]:
        options = self.options
        return [options.text_column, *filter(None, [options.text_pair_column]), *([options.label_column] * labelled)]

    def tokenize(self, split, labelled: bool = True):
        options, label_ids = self.options, {str(label): i for i, label in enumerate(self.labels)}
        if labelled:  # labels compared as text: a reloaded model's label map holds strings
            unknown = {str(label) for label in split.unique(options.label_column)} - set(label_ids)
            if unknown:
                raise UsageError(
                    f"the {split.split or ''} split has labels the model does not know: "
                    f"{sorted(unknown)[:5]} (it knows {', '.join(label_ids)})"
                )

        def encode(rows: dict) -> dict:
            pairs = rows[options.text_pair_column] if options.text_pair_column else None
            encoded = self.tokenizer(rows[options.text_column], pairs, truncation=True, max_length=options.max_length)
            if not labelled:
                return dict(encoded)
            return {**encoded, "labels": [label_ids[str(label)] for label in rows[options.label_column]]}

        return split.map(encode, batched=True, remove_columns=split.column_names, desc="tokenizing")

    def collate_fn(self):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(self.tokenizer, return_tensors="pt")  # pads each batch to its longest text

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForSequenceClassification

        config = self.model_config(num_labels=len(self.labels), **label_maps(self.labels))
        return AutoModelForSequenceClassification.from_pretrained(self.model_path, config=config)

    def save_model(self, accelerator, model: nn.Module, directory: Path) -> None:
        """An adapter alone also gets its label map (labels.json): its base model's config has none."""
        super().save_model(accelerator, model, directory)
        if self.adapted and not self.options.merge_adapter and accelerator.is_main_process:
            save_labels(directory, self.labels)

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

    def predict(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        probabilities = logits.float().softmax(dim=-1)
        return {"prediction": probabilities.argmax(dim=-1), "probabilities": probabilities}

    def prediction_rows(self, outputs: dict[str, torch.Tensor]) -> list[dict]:
        """The predicted class by its name, as the labels were in the data."""
        rows = super().prediction_rows(outputs)
        return [{**row, "prediction": self.labels[row["prediction"]]} for row in rows]
