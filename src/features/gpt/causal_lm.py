"""A GPT-style language model trained from scratch on text: `--task causal_lm`, see configs/lm.yaml.

    python scripts/prepare_text.py                         # once: the Python stdlib's source as data/stdlib
    python train.py --config configs/lm.yaml               # ~0.8M parameters, 200 steps in ~1 min on 2 CPU cores
    python train.py --config configs/lm.yaml --n_layer 2 --n_embd 64 --max_eval_tokens 65536

Byte-level: the tokens are a text's UTF-8 bytes (vocabulary 256), so there is no tokenizer to download or train.
Each split's documents are joined with a separator byte and cut into fixed blocks of `block_size + 1` tokens
(input = block[:-1], target = block[1:]); the remainder is dropped. The model is src/features/gpt/model.py.
With `--streaming true` the train split is read from shard files and packed on the fly (docs/streaming.md).
"""

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from src.data import check_columns, load_splits
from src.errors import UsageError
from src.features.gpt.model import GPT, GPTConfig, count_parameters, flops_per_token
from src.tasks.base import Task

VOCAB_SIZE = 256  # bytes
SEPARATOR = 0  # the byte between documents: NUL, which text files do not contain
PREPARED_DIR = Path("data/stdlib")  # where scripts/prepare_text.py writes by default
PACK_DOCUMENTS = 64  # --streaming packs this many documents at a time: its memory is theirs, not the corpus's


class TokenBlocks(Dataset):
    """Fixed-length blocks of byte tokens, stored as one uint8 tensor; items are (input_ids, targets) int64."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks  # (num_blocks, block_size + 1) uint8

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.blocks[index].long()
        return block[:-1], block[1:]

    # a batch as one gather (src/batches.py: Gatherable), the same tensors default_collate stacks from __getitem__
    def gather(self, indices: torch.Tensor) -> list[torch.Tensor]:
        blocks = self.blocks[indices].long()
        return [blocks[:, :-1].contiguous(), blocks[:, 1:].contiguous()]

    def to(self, device: torch.device) -> "TokenBlocks":
        return TokenBlocks(self.blocks.to(device))

    def nbytes(self) -> int:
        return self.blocks.nbytes


def pack(texts: list[str], block_size: int, max_tokens: int | None = None) -> np.ndarray:
    """Texts -> UTF-8 bytes joined by SEPARATOR -> (num_blocks, block_size + 1) uint8, the remainder dropped."""
    data = chr(SEPARATOR).join(texts).encode("utf-8")[:max_tokens]
    num_blocks = len(data) // (block_size + 1)
    return np.frombuffer(data, dtype=np.uint8, count=num_blocks * (block_size + 1)).reshape(num_blocks, -1).copy()


def pack_examples(examples: dict, column: str, block_size: int) -> dict:
    """A batch of a stream's documents -> {"block": one bytes object per block} (datasets' batched map)."""
    texts = examples[column]
    if texts and not isinstance(texts[0], str):
        raise UsageError(f"column {column!r} must hold text (got {type(texts[0]).__name__})")
    return {"block": [row.tobytes() for row in pack(texts, block_size)]}


def block_to_sample(example: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A streamed block -> (input_ids, targets) int64, as TokenBlocks gives them."""
    block = torch.frombuffer(bytearray(example["block"]), dtype=torch.uint8).long()
    return block[:-1], block[1:]


class CausalLM(Task):
    @dataclass
    class Options:
        """The defaults: ~0.8M parameters, for CPU tests."""

        text_column: str = "text"  # the column holding the documents
        block_size: int = 128  # tokens per training sample (context length)
        n_layer: int = 4
        n_head: int = 4
        n_embd: int = 128
        dropout: float = 0.0  # > 0 makes 1- and N-process runs differ: dropout masks depend on the batch split
        max_train_tokens: int | None = None  # use only the first N tokens of the train split (quick runs)
        max_eval_tokens: int | None = None  # likewise for the eval split
        max_new_tokens: int = 32  # --do_predict: bytes generated (greedily) after each text of the predicted split

        def __post_init__(self):
            problems = [
                f"{name} must be > 0 (got {getattr(self, name)})"
                for name in ("block_size", "n_layer", "n_head", "n_embd")
                if getattr(self, name) <= 0
            ]
            problems += [
                f"{name} must be > block_size (got {getattr(self, name)})"
                for name in ("max_train_tokens", "max_eval_tokens")
                if getattr(self, name) is not None and getattr(self, name) <= self.block_size
            ]
            if self.max_new_tokens <= 0:
                problems.append(f"max_new_tokens must be > 0 (got {self.max_new_tokens})")
            if self.n_head > 0 and self.n_embd % self.n_head:
                problems.append(f"n_embd {self.n_embd} must be divisible by n_head {self.n_head}")
            if not 0 <= self.dropout < 1:
                problems.append(f"dropout must lie in [0, 1) (got {self.dropout})")
            if problems:
                raise UsageError("causal_lm options: " + "; ".join(problems))

    default_data_files = {"train": str(PREPARED_DIR / "train.parquet"), "eval": str(PREPARED_DIR / "eval.parquet")}

    @property
    def model_config(self) -> GPTConfig:
        o = self.options
        return GPTConfig(VOCAB_SIZE, o.block_size, o.n_layer, o.n_head, o.n_embd, o.dropout)

    # --- data ---

    def build_datasets(self) -> tuple[TokenBlocks, TokenBlocks]:
        self.check_data_present()
        splits = load_splits(self.config)
        return (
            self.to_blocks(splits[self.config.train_split], self.options.max_train_tokens),
            self.to_blocks(splits[self.config.eval_split], self.options.max_eval_tokens),
        )

    def build_eval_dataset(self, split: str, labelled: bool = True) -> Dataset:
        """Blocks to evaluate; or, only to predict (`labelled` False), one prompt per text: its last block_size
        bytes, left-padded with the separator (the model reads it as "a text starts"); generation slides the window."""
        self.check_data_present()
        data = load_splits(self.config, [split])[split]
        if labelled:
            return self.to_blocks(data, self.options.max_eval_tokens)
        check_columns(data, [self.options.text_column], "--text_column to the text column", split)
        length = self.options.block_size
        prompts = torch.full((len(data), length), SEPARATOR, dtype=torch.long)
        for row, text in enumerate(data[self.options.text_column]):
            tail = text.encode("utf-8")[-length:]
            if tail:
                prompts[row, length - len(tail) :] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
        return TensorDataset(prompts)

    def check_data_present(self) -> None:
        """The likely slip before any data is read: data/stdlib not built yet."""
        if self.config.dataset_name:
            return
        prepared = {Path(file).parts for file in self.default_data_files.values()}  # another name there: a typo
        for path in map(Path, self.config.data_files.values()):
            if not path.is_file() and path.parts[-3:] in prepared:
                raise UsageError(
                    f"data file {path} not found; create it once with `python scripts/prepare_text.py` "
                    "(the Python stdlib's source as text), or point --data_files at your own text"
                )

    def to_blocks(self, split, max_tokens: int | None) -> TokenBlocks:
        """One split's texts -> UTF-8 bytes joined by SEPARATOR -> (num_blocks, block_size + 1), remainder dropped."""
        column, block_size = self.options.text_column, self.options.block_size
        check_columns(split, [column], "--text_column to the text column")
        texts = split[column]
        if not all(isinstance(text, str) for text in texts[:1]):
            raise UsageError(f"column {column!r} must hold text (got {type(texts[0]).__name__})")
        blocks = pack(texts, block_size, max_tokens)
        if len(blocks) == 0:
            tokens = min(len(chr(SEPARATOR).join(texts).encode("utf-8")), max_tokens or math.inf)
            raise UsageError(
                f"the {split.split or ''} split has {tokens} tokens, fewer than one block of {block_size + 1}; "
                "use more text or a smaller --block_size"
            )
        return TokenBlocks(torch.from_numpy(blocks))

    def build_train_stream(self):
        """--streaming: the train files read lazily, packed on the fly (PACK_DOCUMENTS documents at a time, in the
        data-loader workers if any), then shuffled in a buffer of blocks (and the shard order) by seed and epoch."""
        o = self.options
        if o.max_train_tokens is not None:
            raise UsageError("--max_train_tokens does not apply with --streaming; --max_steps sets how much is read")
        from src.features.streaming import FEATURE as streaming
        from src.features.streaming.stream import SampleStream, load_stream

        stream = load_stream(self.config, self.config.train_split)
        check_columns(stream, [o.text_column], "--text_column to the text column")  # from the files' schema
        blocks = stream.map(
            pack_examples,
            batched=True,
            batch_size=PACK_DOCUMENTS,
            remove_columns=stream.column_names,
            fn_kwargs={"column": o.text_column, "block_size": o.block_size},
        )
        # one shard at a time into the buffer: datasets' default (10) reads shards in threads, ~10x slower here, and
        # sleeps 5 s at the end of every epoch (apache/arrow#45214)
        buffer = streaming.options(self.config).shuffle_buffer_size
        blocks = blocks.shuffle(seed=self.config.seed, buffer_size=buffer, max_buffer_input_shards=1)
        return SampleStream(blocks, block_to_sample)

    # --- model, loss, evaluation ---

    def build_model(self) -> nn.Module:
        logging.getLogger("accelerate.utils.other").addFilter(tied_head_saved)  # once: the same filter
        return GPT(self.model_config)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        """Mean next-token cross-entropy over every token of the batch (all samples have the same length)."""
        input_ids, targets = batch
        logits = model(input_ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def eval_outputs(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Per sequence: the summed token losses and the token count, so eval/loss is the mean loss per token."""
        input_ids, targets = batch
        logits = model(input_ids)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        batch_size, length = targets.shape
        return {
            "loss": losses.view(batch_size, length).sum(dim=1),
            "weight": torch.full((batch_size,), float(length), device=targets.device),
        }

    def derived_metrics(self, scores: dict) -> dict:
        return {"eval/perplexity": math.exp(scores["eval/loss"])}

    @torch.no_grad()
    def predict(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Greedy decoding (the same on any process count): max_new_tokens bytes after each prompt."""
        tokens = batch[0]
        for _ in range(self.options.max_new_tokens):
            next_token = model(tokens[:, -self.options.block_size :])[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
        return {"generated": tokens[:, batch[0].shape[1] :]}

    def prediction_rows(self, outputs: dict[str, torch.Tensor]) -> list[dict]:
        """The generated bytes as text, up to the first separator (the model ending the text)."""
        return [
            {"generated": bytes(row.tolist()).split(bytes([SEPARATOR]))[0].decode("utf-8", errors="replace")}
            for row in outputs["generated"]
        ]

    # --- throughput ---

    def tokens_per_sample(self) -> int:
        return self.options.block_size

    def flops_per_token(self) -> float:
        return flops_per_token(self.model_config)

    def count_parameters(self, non_embedding: bool = True) -> int:
        return count_parameters(self.model_config, non_embedding)


def tied_head_saved(record: logging.LogRecord) -> bool:
    """Accelerate saves the tied head's weight once, as the embedding's, and warns at every save to check that a
    reload gets it back: GPT ties it again as it is built (a resumed run trains on as if never stopped:
    tests/test_lm.py). That warning is left out; any other passes."""
    return "Removed shared tensor {'lm_head.weight'} while saving" not in record.getMessage()
