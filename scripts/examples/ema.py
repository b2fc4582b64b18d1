"""An exponential moving average (EMA) of the weights, for train.py's loop (docs/customize.md, "Your loop").

Three additions to train.py, placed by what they need, not by line:

    ema = EMA(accelerator, model, decay=0.95)  # once the model is prepared, before resume(): restored on resume
    ema.update(model)                           # once per optimiser step, after the optimiser has stepped
    evaluate(task, ema.model, eval_loader, metric, accelerator, prefix="eval_ema")  # at the end, as the model's

Every process keeps its own copy, updated from the same (all-reduced) weights, so the copies are the same everywhere
and on any process count. For models whose parameters are whole on each process: 1 process and DDP (under FSDP2
and ZeRO-3 each process holds shards).
"""

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from src.errors import UsageError


class EMA:
    """`model` is the prepared model; its weights at each update move the average by 1 - `decay` (the average spans
    about 1 / (1 - decay) updates)."""

    def __init__(self, accelerator, model: torch.nn.Module, decay: float = 0.95):
        if (
            accelerator.distributed_type.value == "FSDP"
            or getattr(accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3
        ):
            raise UsageError("the EMA of scripts/examples/ema.py needs whole weights on each process (1 process or "
                             "DDP), not the shards of FSDP or ZeRO-3")  # fmt: skip
        self.accelerator = accelerator
        self.average = AveragedModel(accelerator.unwrap_model(model), multi_avg_fn=get_ema_multi_avg_fn(decay))
        accelerator.register_for_checkpointing(self.average)  # saved by every save_state, loaded by load_state

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Once per optimiser step, never per micro-batch: with accumulation a step spans several."""
        self.average.update_parameters(self.accelerator.unwrap_model(model))

    @property
    def model(self) -> torch.nn.Module:
        """The averaged weights in a model of the same kind: evaluate or save it like the model."""
        return self.average.module
