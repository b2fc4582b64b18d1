"""A compact decoder-only transformer in the style of nanoGPT (the causal_lm task's model).

(batch, time) token ids -> (batch, time, vocab_size) next-token logits; pre-LayerNorm blocks, a tied LM head,
GPT-2's scaled init of the residual projections. `count_parameters` and `flops_per_token` give its numbers from the
config alone, so they are right under FSDP or ZeRO-3 too, where a process holds only a shard of the weights.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, args: GPTConfig):
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
    def __init__(self, args: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(args.n_embd, 4 * args.n_embd)
        self.proj = nn.Linear(4 * args.n_embd, args.n_embd)  # a residual projection
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, args: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd)
        self.attn = CausalSelfAttention(args)
        self.ln_2 = nn.LayerNorm(args.n_embd)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """(batch, time) token ids -> (batch, time, vocab_size) next-token logits; the LM head is the token embedding."""

    _no_split_modules = ["Block"]  # FSDP2 shards each block on its own (accelerate_configs/fsdp.yaml), as transformers'

    def __init__(self, args: GPTConfig):
        super().__init__()
        self.block_size = args.block_size
        self.tok_emb = nn.Embedding(args.vocab_size, args.n_embd)
        self.pos_emb = nn.Embedding(args.block_size, args.n_embd)
        self.dropout = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=False)
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


def count_parameters(args: GPTConfig, non_embedding: bool = True) -> int:
    """The model's parameter count from its shapes (exact; tests check it against the model).

    non_embedding: without the position embedding, as nanoGPT's `get_num_params()`; the token embedding stays
    in, as it is also the LM head's weight.
    """
    d = args.n_embd
    per_layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    total = args.vocab_size * d + args.block_size * d + args.n_layer * per_layer + 2 * d
    return total - args.block_size * d if non_embedding else total


def flops_per_token(args: GPTConfig) -> float:
    """Training FLOPs (forward + backward) per token, nanoGPT's `estimate_mfu` convention (PaLM paper, app. B):
    6 N + 12 n_layer n_head head_dim block_size, N = parameters without the position embedding."""
    head_dim = args.n_embd // args.n_head
    return 6 * count_parameters(args) + 12 * args.n_layer * args.n_head * head_dim * args.block_size
