"""The accelerate config's strategy, what this machine can't give it, FSDP2 on CPU for CI (docs/sharded.md)."""

import os

import torch
from accelerate import ParallelismConfig, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs, is_torch_version
from torch import nn

from src import features
from src.errors import LaunchError

FSDP, DEEPSPEED = "FSDP", "DEEPSPEED"
# FSDP2 over gloo: torch 2.6 fails at its first step, 2.7 and 2.8 train unlike one process (losses 2e-3 apart), 2.9 on
# as one process does (tests/test_sharded.py, 2026-12-06); HSDP too. Accelerate's FSDP2 on GPUs is not limited by it
CPU_FSDP2_TORCH = "2.9"


def requested_strategy() -> str | None:
    return next((n for n in (FSDP, DEEPSPEED) if os.environ.get(f"ACCELERATE_USE_{n}", "").lower() == "true"), None)


def check_launch(use_cpu: bool, config=None) -> None:
    """What the accelerate config asks that this machine can't give, found by each process before a group forms."""
    precision = (config and config.mixed_precision) or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if use_cpu and precision == "fp16":
        raise LaunchError(
            "fp16 mixed precision needs a GPU and this machine has none; use --mixed_precision bf16 (or no) on the CPU"
        )
    features.installed().check_launch(use_cpu, config)  # e.g. DeepSpeed's
    if not (use_cpu and requested_strategy() == FSDP):
        return
    if os.environ.get("FSDP_OFFLOAD_PARAMS", "") == "true":
        raise LaunchError(
            "the accelerate config offloads to the CPU (fsdp_offload_params), but this machine "
            "trains on the CPU already; set it to none (false) in the config"
        )
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise LaunchError(
            "the accelerate config asks for FSDP version 1, which needs GPUs, and this machine has "
            "none; use accelerate_configs/fsdp.yaml (FSDP2: fsdp_version: 2)"
        )
    refuse_older_torch("FSDP2", CPU_FSDP2_TORCH, instead="accelerate_configs/ddp.yaml")


def refuse_older_torch(what: str, oldest: str, instead: str) -> None:
    """`what` on CPU processes with a torch older than `oldest` (each caller's measured floor): one line."""
    if is_torch_version("<", oldest):
        raise LaunchError(
            f"{what} on CPU processes needs torch >= {oldest} (this is {torch.__version__}); use {instead} on this "
            "machine, or a newer torch"
        )


def accelerator_options(use_cpu: bool, config) -> dict:
    options = features.installed().accelerator_options(use_cpu, config)
    if options is not None:
        return options
    strategy = requested_strategy()
    if strategy == DEEPSPEED:
        raise LaunchError("the accelerate config asks for DeepSpeed, which this project does not include; use FSDP")
    if strategy == FSDP and use_cpu:
        return {"cpu": True, "fsdp_plugin": FullyShardedDataParallelPlugin()}
    return {"cpu": use_cpu}


def process_group_options(options: dict) -> dict:
    """`PartialState`'s arguments (it forms the group before the Accelerator exists): `cpu` and a strategy's backend."""
    backends = [h.backend for h in options.get("kwargs_handlers", []) if isinstance(h, InitProcessGroupKwargs)]
    return {"cpu": options["cpu"], **({"backend": backends[0]} if backends else {})}


def enable_fsdp_on_cpu(accelerator, plugin) -> None:
    """FSDP2 on a MULTI_CPU Accelerator: `AcceleratorState.__init__` (accelerate/state.py) switches to FSDP for GPU-like
    types only, so `cpu=True` drops the plugin (silently DDP); both shared states switch (lookups read either)."""
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise LaunchError(
            f"FSDP on CPU processes expects Accelerate's MULTI_CPU state, got {state.distributed_type} "
            f"(accelerate changed?); use accelerate_configs/ddp.yaml on this machine"
        )
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    if not (accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2):
        raise LaunchError(
            "this Accelerate did not take FSDP on CPU processes (src/strategy.py); "
            "use accelerate_configs/ddp.yaml on this machine"
        )


def data_parallel_size(num_processes: int) -> int:
    """Processes reading different batches: tensor/context-parallel ranks share theirs (process_index // tp_size)."""
    return num_processes // ParallelismConfig().non_data_parallel_size


def prepare_needs_optimizer(accelerator) -> bool:
    """Whether `prepare` refuses a model without an optimizer (eval-only): FSDP2 and ZeRO-1/2 do; ZeRO-3 does not."""
    if accelerator.distributed_type.value == DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage < 3
    return accelerator.is_fsdp2


def strategy_of(model: nn.Module) -> str:
    """Read off the prepared model, not the config: a silent fallback to DDP shows here."""
    from torch.distributed.tensor import DTensor

    model = getattr(model, "_orig_mod", model)  # --torch_compile's wrapper: the prepared model inside

    if type(model).__name__ == "DeepSpeedEngine":  # a prepared DeepSpeed model; deepspeed is not imported otherwise
        return f"DeepSpeed ZeRO-{model.zero_optimization_stage()}"
    dims = {d for p in model.parameters() if isinstance(p, DTensor) for d in p.device_mesh.mesh_dim_names or ("",)}
    if dims:  # sharded; over a "tp" dimension too (the tensor_parallel feature's plan), or in replicas (HSDP)
        return "FSDP2+TP" if "tp" in dims else "HSDP" if "dp_replicate" in dims else "FSDP2"
    return "DDP" if isinstance(model, nn.parallel.DistributedDataParallel) else "single process"


def fsdp_units(model: nn.Module) -> int:
    """How many modules FSDP2 sharded on their own (`fully_shard` per transformer block, plus the root)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(module, FSDPModule) for module in model.modules())
