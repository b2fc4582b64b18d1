"""A GPT-style language model trained from scratch on text: `--task causal_lm`, see configs/lm.yaml.

    python scripts/prepare_text.py                         # once: the Python stdlib's source as data/stdlib
    python train.py --config configs/lm.yaml               # ~0.8M parameters, 200 steps in ~1 min on 2 CPU cores
    python train.py --config configs/lm.yaml --task_args '{n_layer: 2, n_embd: 64, max_eval_tokens: 65536}'

(`--task_args` on the command line replaces the YAML's `task_args` mapping as a whole, so repeat what you keep.)

Byte-level: the tokens are a text's UTF-8 bytes (vocabulary 256), so there is no tokenizer to download or train.
Each split's documents are joined with a separator byte and cut into fixed blocks of `block_size + 1` tokens
(input = block[:-1], target = block[1:]); the remainder is dropped. The model is a compact decoder-only
transformer in the style of nanoGPT. Its options come from `--task_args` (see `LMArgs`), checked here.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset

from src.config import TrainConfig, parse_task_args
from src.data import load_splits
from src.errors import UsageError

METRICS = []  # no predictions to score: the eval loss (and perplexity, below) is the metric
VOCAB_SIZE = 256  # bytes
SEPARATOR = 0  # the byte between documents: NUL, which text files do not contain
PREPARED_DIR = Path("data/stdlib")  # where scripts/prepare_text.py writes by default


@dataclass(frozen=True)
class LMArgs:
    """`--task_args` of causal_lm. The defaults: ~0.8M parameters, for CPU tests."""

    block_size: int = 128  # tokens per training sample (context length)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # > 0 makes 1- and N-process runs differ: dropout masks depend on the batch split
    max_train_tokens: int | None = None  # use only the first N tokens of the train split (quick runs)
    max_eval_tokens: int | None = None  # likewise for the eval split

    @classmethod
    def from_config(cls, config: TrainConfig) -> "LMArgs":
        """Check `config.task_args`: unknown keys, wrong types and bad values raise a one-line UsageError."""
        args = parse_task_args(cls, config)
        args.check()
        return args

    def check(self) -> None:
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
        if self.n_head > 0 and self.n_embd % self.n_head:
            problems.append(f"n_embd {self.n_embd} must be divisible by n_head {self.n_head}")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout must lie in [0, 1) (got {self.dropout})")
        if problems:
            raise UsageError("--task_args: " + "; ".join(problems))


# --- data ---


class TokenBlocks(Dataset):
    """Fixed-length blocks of byte tokens, stored as one uint8 tensor; items are (input_ids, targets) int64."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks  # (num_blocks, block_size + 1) uint8

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.blocks[index].long()
        return block[:-1], block[1:]


def build_datasets(config: TrainConfig) -> tuple[TokenBlocks, TokenBlocks]:
    args = LMArgs.from_config(config)
    check_data_present(config)
    splits = load_splits(config)
    return (
        to_blocks(splits[config.train_split], config, args.block_size, args.max_train_tokens),
        to_blocks(splits[config.eval_split], config, args.block_size, args.max_eval_tokens),
    )


def check_data_present(config: TrainConfig) -> None:
    """The two likely slips before any data is read: digits' files still configured, or data/stdlib not built."""
    if config.dataset_name:
        return
    if config.data_files == TrainConfig().data_files:
        raise UsageError(
            "--task causal_lm needs text, but data_files are the digits example's; use --config configs/lm.yaml, "
            "or set --data_files and --input_column to your text"
        )
    for path in config.data_files.values():
        if not Path(path).is_file() and Path(path).parent.parts[-2:] == PREPARED_DIR.parts:
            raise UsageError(
                f"data file {path} not found; create it once with `python scripts/prepare_text.py` "
                "(the Python stdlib's source as text), or point --data_files at your own text"
            )


def to_blocks(split, config: TrainConfig, block_size: int, max_tokens: int | None) -> TokenBlocks:
    """One split's texts -> UTF-8 bytes joined by SEPARATOR -> (num_blocks, block_size + 1), remainder dropped."""
    if config.input_column not in split.column_names:
        raise UsageError(
            f"the data has no column {config.input_column!r} (it has {', '.join(split.column_names)}); "
            "set --input_column to the text column"
        )
    texts = split[config.input_column]
    if not all(isinstance(text, str) for text in texts[:1]):
        raise UsageError(f"column {config.input_column!r} must hold text (got {type(texts[0]).__name__})")
    data = chr(SEPARATOR).join(texts).encode("utf-8")
    if max_tokens is not None:
        data = data[:max_tokens]
    tokens = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())  # copy: frombuffer is read-only
    num_blocks = len(tokens) // (block_size + 1)
    if num_blocks == 0:
        raise UsageError(
            f"the {split.split or ''} split has {len(tokens)} tokens, fewer than one block of {block_size + 1}; "
            "use more text or a smaller --task_args block_size"
        )
    return TokenBlocks(tokens[: num_blocks * (block_size + 1)].view(num_blocks, block_size + 1))


# --- model ---


class CausalSelfAttention(nn.Module):
    def __init__(self, args: LMArgs):
        super().__init__()
        self.n_head = args.n_head
        self.dropout = args.dropout
        self.qkv = nn.Linear(args.n_embd, 3 * args.n_embd)
        self.proj = nn.Linear(args.n_embd, args.n_embd)  # a residual projection: scaled init, see GPT
        self.resid_dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = (
            t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(channels, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, channels)))


class MLP(nn.Module):
    def __init__(self, args: LMArgs):
        super().__init__()
        self.fc = nn.Linear(args.n_embd, 4 * args.n_embd)
        self.proj = nn.Linear(4 * args.n_embd, args.n_embd)  # a residual projection
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, args: LMArgs):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd)
        self.attn = CausalSelfAttention(args)
        self.ln_2 = nn.LayerNorm(args.n_embd)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """(batch, time) token ids -> (batch, time, 256) next-token logits. The LM head shares the token embedding."""

    def __init__(self, args: LMArgs):
        super().__init__()
        self.block_size = args.block_size
        self.tok_emb = nn.Embedding(VOCAB_SIZE, args.n_embd)
        self.pos_emb = nn.Embedding(args.block_size, args.n_embd)
        self.dropout = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.lm_head = nn.Linear(args.n_embd, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        self.gradient_checkpointing = False
        self.apply(init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * args.n_layer))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.block_size:
            raise ValueError(f"sequence length {length} exceeds block_size {self.block_size}")
        positions = torch.arange(length, device=input_ids.device)
        x = self.dropout(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)  # recompute the block's activations in backward
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))

    def gradient_checkpointing_enable(self) -> None:
        """`--gradient_checkpointing true`: keep only each block's input for backward (less memory, ~30% slower)."""
        self.gradient_checkpointing = True


def init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(config: TrainConfig) -> nn.Module:
    return GPT(LMArgs.from_config(config))


# --- loss and evaluation ---


def training_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the batch (all samples have the same length)."""
    input_ids, targets = batch
    logits = model(input_ids)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def eval_outputs(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """Per sequence: the summed token losses and the token count, so eval/loss is the mean loss per token."""
    input_ids, targets = batch
    logits = model(input_ids)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    batch_size, length = targets.shape
    return {
        "loss": losses.view(batch_size, length).sum(dim=1),
        "weight": torch.full((batch_size,), float(length), device=targets.device),
    }


def derived_metrics(scores: dict) -> dict:
    return {"eval/perplexity": math.exp(scores["eval/loss"])}


# --- throughput ---


def tokens_per_sample(config: TrainConfig) -> int:
    return LMArgs.from_config(config).block_size


def count_parameters(args: LMArgs, non_embedding: bool = True) -> int:
    """The model's parameter count from its shapes (exact; tests check it against the model).

    non_embedding: without the position embedding, as nanoGPT's `get_num_params()`; the token embedding stays
    in, as it is also the LM head's weight.
    """
    d = args.n_embd
    per_layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    total = VOCAB_SIZE * d + args.block_size * d + args.n_layer * per_layer + 2 * d
    return total - args.block_size * d if non_embedding else total


def flops_per_token(model: nn.Module, config: TrainConfig) -> float:
    """Training FLOPs (forward + backward) per token, nanoGPT's `estimate_mfu` convention (PaLM paper, app. B):
    6 N + 12 n_layer n_head head_dim block_size, N = parameters without the position embedding.

    N comes from the config, not from `model`: under FSDP or DeepSpeed ZeRO-3 a process holds only a shard of
    the parameters, so counting them there would be wrong. `model` is accepted for the task interface.
    """
    args = LMArgs.from_config(config)
    head_dim = args.n_embd // args.n_head
    return 6 * count_parameters(args) + 12 * args.n_layer * args.n_head * head_dim * args.block_size
