"""Tokens/s and MFU in each log step's train metrics: `train/tokens_per_s` for tasks that count their tokens
(`CountsTokens`), and `train/mfu` for those that also count their FLOPs (`CountsFlops`) on GPUs with a known peak."""

from typing import Protocol, runtime_checkable

import torch

from src.features import Feature

# bf16 dense tensor-core peak per GPU (data sheets), MFU only for these; the most specific name first ("L40S", "L4")
PEAK_FLOPS = {"H200 NVL": 835e12, "H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
              "A100": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12}  # fmt: skip


@runtime_checkable
class CountsTokens(Protocol):
    """A task whose samples are tokens (the GPT's, packed language modeling): it logs train/tokens_per_s."""

    def tokens_per_sample(self) -> int | None:
        """Tokens in one training sample; None: not a fixed count (e.g. texts padded per batch)."""


@runtime_checkable
class CountsFlops(Protocol):
    """A task that knows its model's training cost: with `CountsTokens`, it logs train/mfu on GPUs with a known peak."""

    def flops_per_token(self) -> float | None:
        """Training FLOPs per token (forward + backward)."""


def throughput_metrics(task, accelerator, samples_per_s: float) -> dict:
    """samples/s -> tokens/s (tasks that count tokens) and MFU (that count FLOPs too, on a known GPU)."""
    tokens_per_sample = task.tokens_per_sample() if isinstance(task, CountsTokens) else None
    if tokens_per_sample is None:
        return {}
    tokens_per_s = samples_per_s * tokens_per_sample
    peak = flops_per_token = None
    if accelerator.device.type == "cuda" and isinstance(task, CountsFlops):
        name = torch.cuda.get_device_name(accelerator.device)
        peak = next((flops for gpu, flops in PEAK_FLOPS.items() if gpu in name), None)
        flops_per_token = task.flops_per_token()
    if peak is None or flops_per_token is None:
        return {"train/tokens_per_s": tokens_per_s}
    mfu = tokens_per_s * flops_per_token / (peak * accelerator.num_processes)
    return {"train/tokens_per_s": tokens_per_s, "train/mfu": mfu}


class Throughput(Feature):
    def train_metrics(self, metrics: dict, accelerator, task) -> dict:
        added = throughput_metrics(task, accelerator, metrics["train/samples_per_s"])
        # right after samples/s: the rates side by side
        items = list(metrics.items())
        at = list(metrics).index("train/samples_per_s") + 1
        return dict(items[:at] + list(added.items()) + items[at:])


FEATURE = Throughput()
