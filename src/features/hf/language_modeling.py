"""Train a Hugging Face causal language model (GPT-2 and the like): `--task language_modeling`.

    python train.py --task language_modeling --model_name_or_path gpt2 --data_files '{train: a.txt.jsonl, ...}'
    python train.py --task language_modeling --model_name_or_path gpt2 --from_scratch true \
        --config_overrides "n_layer=2,n_embd=64,n_head=2"        # a new model from a config: pre-training

`AutoModelForCausalLM` + `AutoTokenizer` (option names as in transformers' run_clm_no_trainer.py). With `packing`
(the default), texts are tokenised, joined and cut into blocks of `block_size` tokens (run_clm's group_texts): every
sample is full, nothing is padded. Without it, each text is one sample, truncated to `block_size` and padded per
batch. Either way the loss is summed over the tokens and divided by the tokens of the whole global batch (see
`loss_reduction` in src/tasks/base.py), so 1 and N processes train the same even when batches hold padding.
"""

import math
from dataclasses import dataclass
from functools import partial
from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn

from src.errors import UsageError
from src.features.hf.adapters import AdapterOptions
from src.features.hf.base import HuggingFaceTask, check_dropout, main_process_first
from src.imports import hidden

IGNORE = -100  # labels the loss skips: padding


def pad_and_label(pad, samples: list[dict]) -> dict:
    """Pad to the batch's longest sample; the labels are the inputs with the padding ignored. (Not by pad token id:
    GPT-2 pads with its end-of-text token, whose real occurrences must still be learned.)"""
    batch = pad(samples)
    mask = batch.get("attention_mask")
    batch["labels"] = batch["input_ids"] if mask is None else batch["input_ids"].masked_fill(mask == 0, IGNORE)
    return batch


class LanguageModeling(HuggingFaceTask):
    @dataclass
    class Options(AdapterOptions):
        tokenizer_name: str | None = None  # None: the model's
        from_scratch: bool = False  # a new model from the config (and config_overrides), not the saved weights
        config_overrides: str | None = None  # applied to the config, e.g. "n_layer=2,n_embd=64,n_head=2"
        text_column: str = "text"
        block_size: int | None = None  # tokens per sample; None: the tokenizer's model_max_length, at most 1024
        packing: bool = True  # join texts and cut full blocks (run_clm); false: one text per sample, padded
        dropout: float | None = None  # every dropout probability of the model; None: the model's own
        max_new_tokens: int = 32  # --do_predict: tokens generated (greedily) after each text of the predicted split

        def __post_init__(self):
            if self.block_size is not None and self.block_size < 2:
                raise UsageError(f"--block_size must be >= 2 (got {self.block_size})")
            check_dropout(self.dropout)
            self.check_adapter_options()
            if self.peft and self.from_scratch:
                raise UsageError("--peft lora adapts a trained model: drop --from_scratch true, or drop --peft")

    loss_reduction = "sum"
    peft_task_type = "CAUSAL_LM"

    def build_datasets(self):
        train, evals = self.load_text_splits([self.options.text_column], "--text_column")
        self.set_block_size()
        with main_process_first():
            return self.tokenize(train), self.tokenize(evals)

    def build_eval_dataset(self, split: str, labelled: bool = True):
        """Blocks to evaluate; or, only to predict, one prompt per text (see `prompts`)."""
        (data,) = self.load_text_splits([self.options.text_column], "--text_column", [split])
        self.set_block_size()
        with main_process_first():
            return self.tokenize(data) if labelled else self.prompts(data)

    def prompts(self, split):
        """Each text's last block_size - max_new_tokens tokens, left-padded to that length (with the attention
        mask), so that every batch has one shape and generation continues right after the text."""
        length = self.block_size - self.options.max_new_tokens
        if length < 1:
            raise UsageError(
                f"--max_new_tokens {self.options.max_new_tokens} leaves no room for a prompt in "
                f"--block_size {self.block_size}"
            )
        pad = self.tokenizer.pad_token_id

        def encode(rows: dict) -> dict:
            tails = [ids[-length:] for ids in self.tokenizer(rows[self.options.text_column])["input_ids"]]
            return {
                "input_ids": [[pad] * (length - len(ids)) + ids for ids in tails],
                "attention_mask": [[0] * (length - len(ids)) + [1] * len(ids) for ids in tails],
            }

        return split.map(encode, batched=True, remove_columns=split.column_names, desc="tokenizing prompts")

    def set_block_size(self) -> None:
        """The tokenizer's padding, the model's config (read once: build_model uses it too), and block_size."""
        if self.tokenizer.pad_token is None:  # GPT-2 has none; padded positions are masked out of the loss anyway
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.transformers_config = self.model_config()
        positions = self.transformers_config.to_dict()
        limit = min(
            self.tokenizer.model_max_length,
            positions.get("n_positions") or positions.get("max_position_embeddings") or 1024,
        )
        if self.options.block_size and self.options.block_size > limit:
            raise UsageError(
                f"--block_size {self.options.block_size} exceeds what the model and tokenizer take "
                f"({limit} positions); use --block_size {limit} or less"
            )
        self.block_size = self.options.block_size or min(limit, 1024)

    def tokenize(self, split):
        blocks = split.map(self.encode, batched=True, remove_columns=split.column_names, desc="tokenizing")
        if len(blocks) == 0:
            raise UsageError(
                f"the {split.split or ''} split has no sample of 2 or more tokens; use more text, "
                "or a smaller --block_size"
            )
        return blocks

    def encode(self, rows: dict) -> dict:
        """A batch of texts -> samples: packed blocks of block_size tokens, or (without packing) one per text."""
        column, block_size = self.options.text_column, self.block_size
        if not self.options.packing:
            encoded = self.tokenizer(rows[column], truncation=True, max_length=block_size)
            return {
                k: [v for v, ids in zip(values, encoded["input_ids"], strict=True) if len(ids) > 1]
                for k, values in encoded.items()
            }
        ids = list(chain.from_iterable(self.tokenizer(rows[column])["input_ids"]))
        usable = len(ids) // block_size * block_size  # the remainder of each map batch is dropped, as in run_clm
        return {"input_ids": [ids[i : i + block_size] for i in range(0, usable, block_size)]}

    def build_train_stream(self):
        """--streaming: the train split tokenised (and packed) on the fly, in the data-loader workers if any, 64
        texts at a time; then shuffled in a buffer of samples (and the shard order) by seed and epoch."""
        self.load_tokenizer()
        from src.features.streaming import FEATURE as streaming
        from src.features.streaming.stream import SampleStream, load_stream

        stream = load_stream(self.config, self.config.train_split)
        self.set_block_size()
        samples = stream.map(self.encode, batched=True, batch_size=64, remove_columns=stream.column_names)
        buffer = streaming.options(
            self.config
        ).shuffle_buffer_size  # one shard at a time: see CausalLM.build_train_stream
        return SampleStream(samples.shuffle(seed=self.config.seed, buffer_size=buffer, max_buffer_input_shards=1), dict)

    def collate_fn(self):
        from transformers import DataCollatorWithPadding

        return partial(pad_and_label, DataCollatorWithPadding(self.tokenizer, return_tensors="pt"))

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        if self.options.from_scratch:
            return AutoModelForCausalLM.from_config(self.transformers_config)
        return AutoModelForCausalLM.from_pretrained(self.model_path, config=self.transformers_config)

    def token_losses(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, time - 1) next-token losses and the mask of the tokens that count (not padding)."""
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        targets = batch["labels"][:, 1:]
        losses = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none"
        )
        return losses.view_as(targets), targets != IGNORE

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        losses, _ = self.token_losses(model, batch)
        return losses.sum()  # summed: the loop divides by the global batch's count_items

    def count_items(self, batch) -> torch.Tensor:
        return (batch["labels"][:, 1:] != IGNORE).sum()

    def eval_outputs(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        losses, counted = self.token_losses(model, batch)
        return {"loss": losses.sum(dim=1), "weight": counted.sum(dim=1).float()}  # eval/loss: the mean per token

    @torch.no_grad()
    def predict(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Greedy `generate` (the same on any process count), padded to max_new_tokens so batches gather."""
        new_tokens = self.options.max_new_tokens
        from accelerate.utils import extract_model_from_parallel

        with hidden("deepspeed"):  # else imported (~2 s a process, mlflow with it) to look for a DeepSpeedEngine
            generator = extract_model_from_parallel(model)  # DDP's wrapper has no generate()
        output = generator.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
            # a process whose texts all ended keeps stepping until every one's have: FSDP2 and ZeRO-3 gather weights
            # in each forward, so the others would wait forever (transformers detects its own FSDP, not Accelerate's)
            synced_gpus=torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1,
        )
        generated = output[:, batch["input_ids"].shape[1] :]
        return {"generated": F.pad(generated, (0, new_tokens - generated.shape[1]), value=self.tokenizer.pad_token_id)}

    def prediction_rows(self, outputs: dict[str, torch.Tensor]) -> list[dict]:
        texts = self.tokenizer.batch_decode(outputs["generated"], skip_special_tokens=True)
        return [{"generated": text} for text in texts]

    def derived_metrics(self, scores: dict) -> dict:
        return {"eval/perplexity": math.exp(min(scores["eval/loss"], 700))}

    def tokens_per_sample(self) -> int | None:
        return self.block_size if self.options.packing else None
