"""The parallel strategy an accelerate config asks for (DDP, FSDP2, DeepSpeed ZeRO), what it can't do on this machine,
and what Accelerate lacks to run the sharded ones on CPU processes (over gloo), so that CI proves them without GPUs.

`accelerate launch --config_file X.yaml` hands the config to train.py as environment variables (ACCELERATE_USE_FSDP,
ACCELERATE_USE_DEEPSPEED, FSDP_*, ACCELERATE_DEEPSPEED_*). Accelerate runs both sharded strategies on accelerator
devices only:
- DeepSpeed: `PartialState` creates DeepSpeed's process group only with `cpu=False`, using the backend of a device
  (none on a CPU-only machine): every process then trains alone as rank 0 of 1. With the backend named ("gloo",
  in `partial_state_options` and `accelerator_options`) the processes form one group and DeepSpeed's own CPU
  accelerator does the rest.
- FSDP: `AcceleratorState.__init__` switches to FSDP only when the distributed type is MULTI_GPU/NPU/XPU/...,
  never MULTI_CPU (accelerate/state.py: `elif self.distributed_type in [DistributedType.MULTI_GPU, ...]`), so with
  `cpu=True` the FSDP plugin is dropped and the model silently becomes DDP. `enable_fsdp_on_cpu` makes the switch
  that branch makes, on both of Accelerate's shared states (AcceleratorState copies PartialState's when it is
  built, and later lookups read either), and fails with one line if a future Accelerate no longer takes it.
"""

import importlib.util
import os

import torch
from torch import nn

from src.errors import LaunchError, UsageError

FSDP, DEEPSPEED = "FSDP", "DEEPSPEED"


def requested_strategy() -> str | None:
    """FSDP or DEEPSPEED when the accelerate config asks for one, else None (DDP, or one process)."""
    for name in (FSDP, DEEPSPEED):
        if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() == "true":
            return name
    return None


def check_launch(use_cpu: bool, mixed_precision: str | None, max_grad_norm: float | None = None) -> None:
    """What an accelerate config asks for that this machine can't give, found by every process before any of them
    forms a group: one line (from the main process) instead of a traceback per rank. `max_grad_norm` None: the
    DeepSpeed clipping is not compared (scripts/launch.py, which checks the config file alone)."""
    strategy = requested_strategy()
    precision = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if use_cpu and precision == "fp16":
        raise LaunchError(
            "fp16 mixed precision needs a GPU and this machine has none; use --mixed_precision bf16 (or no) on the CPU"
        )
    if strategy == DEEPSPEED:
        if importlib.util.find_spec("deepspeed") is None:
            raise LaunchError(
                "the accelerate config asks for DeepSpeed, which is not installed; "
                "`pip install deepspeed`, or use accelerate_configs/fsdp.yaml"
            )
        clipping = os.environ.get("ACCELERATE_GRADIENT_CLIPPING")
        if max_grad_norm is not None and clipping not in (None, "auto", "none") and float(clipping) != max_grad_norm:
            raise LaunchError(
                f"the accelerate config sets gradient_clipping {clipping} but --max_grad_norm is "
                f"{max_grad_norm}; remove gradient_clipping from the config (train.py sets DeepSpeed's "
                "from --max_grad_norm) or make them equal"
            )
    if not use_cpu:
        return
    offloaded = [
        name
        for name, value in (
            ("offload_optimizer_device", os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")),
            ("offload_param_device", os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")),
            ("fsdp_offload_params", "cpu" if os.environ.get("FSDP_OFFLOAD_PARAMS", "") == "true" else "none"),
        )
        if strategy and value != "none"
    ]
    if offloaded:
        raise LaunchError(
            f"the accelerate config offloads to the CPU ({', '.join(offloaded)}), but this machine "
            "trains on the CPU already; set it to none (false) in the config"
        )
    if strategy == FSDP and os.environ.get("FSDP_VERSION", "1") != "2":
        raise LaunchError(
            "the accelerate config asks for FSDP version 1, which needs GPUs, and this machine has "
            "none; use accelerate_configs/fsdp.yaml (FSDP2: fsdp_version: 2)"
        )


def accelerator_options(use_cpu: bool, max_grad_norm: float) -> dict:
    """The Accelerator's arguments that depend on the strategy: `cpu`, the process group's backend, and the
    DeepSpeed plugin (its gradient clipping is --max_grad_norm: DeepSpeed clips inside its own step)."""
    strategy = requested_strategy()
    if strategy == FSDP and use_cpu:
        from accelerate.utils import FullyShardedDataParallelPlugin

        return {"cpu": True, "fsdp_plugin": FullyShardedDataParallelPlugin()}  # read from FSDP_* variables
    if strategy == DEEPSPEED:
        from accelerate.utils import DeepSpeedPlugin

        options = {"deepspeed_plugin": DeepSpeedPlugin(gradient_clipping=max_grad_norm)}  # the rest from the config
        if use_cpu:  # cpu=True would skip DeepSpeed's process group; gloo is what it can use on CPU processes
            from accelerate.utils import InitProcessGroupKwargs

            options |= {"cpu": False, "kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
        return options
    return {"cpu": use_cpu}


def partial_state_options(use_cpu: bool) -> dict:
    """`PartialState`'s arguments (it forms the process group before the Accelerator exists)."""
    if requested_strategy() == DEEPSPEED and use_cpu:
        return {"cpu": False, "backend": "gloo"}
    return {"cpu": use_cpu}


def enable_fsdp_on_cpu(accelerator, plugin) -> None:
    """Make a MULTI_CPU Accelerator an FSDP one, as accelerate/state.py does for GPUs: distributed type FSDP in both
    shared states, the plugin kept, its mixed precision set. Checked: FSDP2 only, and the switch must hold."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise LaunchError(
            f"FSDP on CPU processes expects Accelerate's MULTI_CPU state, got {state.distributed_type} "
            f"(accelerate changed?); use accelerate_configs/ddp.yaml on this machine"
        )
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    if not (accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2):
        raise LaunchError(
            "this Accelerate did not take FSDP on CPU processes (src/strategy.py); "
            "use accelerate_configs/ddp.yaml on this machine"
        )


def check_strategy(accelerator, config) -> None:
    """What a strategy can't do with the template's options, one line before anything is built."""
    if accelerator.distributed_type.value != DEEPSPEED:
        return
    if config.skip_nonfinite_batches:  # Accelerate's DeepSpeed backward() also steps: the check would come after it
        raise UsageError(
            "--skip_nonfinite_batches does not work with DeepSpeed (its engine steps inside "
            "backward, before the gradient norm can be checked); use FSDP or DDP, or turn it off"
        )
    if config.torch_compile:
        raise UsageError("--torch_compile is not supported with DeepSpeed here; use DDP or FSDP, or compile off")


def cast_inputs_for_deepspeed(model: nn.Module, accelerator) -> nn.Module:
    """DeepSpeed bf16/fp16 keeps the weights themselves in 16 bits (no autocast), so float inputs must be cast to
    them, as transformers' Trainer does for DeepSpeed (`_prepare_input`): a forward pre-hook on the model casts
    every floating-point tensor argument. Token ids and labels (integers) pass unchanged. Elsewhere: nothing."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    if accelerator.distributed_type.value != DEEPSPEED or dtype is None:
        return model

    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def cast_inputs(module, args, kwargs):
        return tuple(cast(arg) for arg in args), {name: cast(value) for name, value in kwargs.items()}

    model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    return model


def prepare_needs_optimizer(accelerator) -> bool:
    """Whether `accelerator.prepare` refuses a model without an optimizer (an eval-only run): FSDP2 ("a model and
    optimizer must be passed together") and DeepSpeed ZeRO-1/2 ("zero stage 2 requires an optimizer"). ZeRO-3
    shards for inference without one (an optimizer would allocate its state)."""
    if accelerator.distributed_type.value == DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage < 3
    return accelerator.is_fsdp2


class ShardMemory:
    """The proof that a strategy shards: each process's parameter and optimiser-state bytes, measured on the prepared
    objects once per start, after the first optimiser step (a torch optimiser's state exists only from then).
    Logged as the largest over the processes: what has to fit on every device."""

    def __init__(self, accelerator, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.accelerator, self.model, self.optimizer, self.logged = accelerator, model, optimizer, False

    def metrics(self) -> dict:
        """Call at the same step on every process (it gathers); {} after the first call."""
        if self.logged:
            return {}
        self.logged = True
        params = sum(local_bytes(p) for p in self.model.parameters())
        state = sum(local_bytes(t) for t in optimizer_state_tensors(self.optimizer))
        sizes = torch.tensor([[params, state]], dtype=torch.float64, device=self.accelerator.device)
        largest = self.accelerator.gather(sizes).amax(dim=0).tolist()
        return {"memory/param_bytes": int(largest[0]), "memory/optimizer_state_bytes": int(largest[1])}


def strategy_of(model: nn.Module) -> str:
    """Read off the prepared model, not the config: a silent fallback to DDP shows here."""
    from torch.distributed.tensor import DTensor

    if type(model).__name__ == "DeepSpeedEngine":  # a prepared DeepSpeed model; deepspeed is not imported otherwise
        return f"DeepSpeed ZeRO-{model.zero_optimization_stage()}"
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "FSDP2"
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "DDP"
    return "single process"


def fsdp_units(model: nn.Module) -> int:
    """How many modules FSDP2 sharded on their own (`fully_shard` per transformer block, plus the root)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(module, FSDPModule) for module in model.modules())


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this process holds of a tensor: a DTensor's local shard, a ZeRO-3 parameter's partition (`ds_tensor`;
    its `.data` is empty between gathers), else the tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    tensor = getattr(tensor, "ds_tensor", tensor)
    return tensor.numel() * tensor.element_size()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors (exp_avg, exp_avg_sq, ...) of the torch optimizer handed to `prepare`: DeepSpeed's ZeRO
    optimizer and FSDP2 keep this process's partition in it."""
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]
