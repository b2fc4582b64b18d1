"""DeepSpeed ZeRO-2/3 (accelerate_configs/deepspeed_zero{2,3}.yaml): its plugin, what it cannot do, its 16-bit inputs.

`PartialState` creates DeepSpeed's process group only with `cpu=False`, using the backend of a device (none on a
CPU-only machine): every process would train alone as rank 0 of 1. Naming the backend ("gloo") forms one group, and
DeepSpeed's own CPU accelerator does the rest, so CI proves ZeRO without GPUs (docs/sharded.md).
"""

import importlib.util
import os

import torch

from src.errors import LaunchError, UsageError
from src.features import Feature
from src.imports import hidden
from src.strategy import DEEPSPEED, requested_strategy

OFFLOAD_VARIABLES = {
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
}


class DeepSpeed(Feature):
    def check_launch(self, use_cpu: bool, config) -> None:
        if requested_strategy() != DEEPSPEED:
            return
        if importlib.util.find_spec("deepspeed") is None:
            raise LaunchError(
                "the accelerate config asks for DeepSpeed, which is not installed; "
                "`pip install deepspeed`, or use accelerate_configs/fsdp.yaml"
            )
        offloaded = [name for name, variable in OFFLOAD_VARIABLES.items() if os.environ.get(variable, "none") != "none"]
        if use_cpu and offloaded:
            raise LaunchError(
                f"the accelerate config offloads to the CPU ({', '.join(offloaded)}), but this machine "
                "trains on the CPU already; set it to none (false) in the config"
            )
        if config is None:  # scripts/launch.py: the accelerate config alone
            return
        clipping = os.environ.get("ACCELERATE_GRADIENT_CLIPPING")
        if clipping not in (None, "auto", "none") and float(clipping) != config.max_grad_norm:
            raise LaunchError(
                f"the accelerate config sets gradient_clipping {clipping} but --max_grad_norm is "
                f"{config.max_grad_norm}; remove gradient_clipping from the config (train.py sets DeepSpeed's "
                "from --max_grad_norm) or make them equal"
            )
        if config.skip_nonfinite_batches:  # Accelerate's DeepSpeed backward() also steps: the check would come after
            raise UsageError(
                "--skip_nonfinite_batches does not work with DeepSpeed (its engine steps inside "
                "backward, before the gradient norm can be checked); use FSDP or DDP, or turn it off"
            )
        if config.torch_compile:
            raise UsageError("--torch_compile is not supported with DeepSpeed here; use DDP or FSDP, or compile off")

    def accelerator_options(self, use_cpu: bool, config) -> dict | None:
        """The plugin, its gradient clipping from --max_grad_norm (DeepSpeed clips inside its own step; the rest comes
        from the accelerate config); on CPU processes `cpu=False` and a gloo group (cpu=True would skip DeepSpeed's)."""
        if requested_strategy() != DEEPSPEED:
            return None
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        with hidden("mlflow"):  # DeepSpeed's autotuner imports it wherever it is installed (~1.5 s), for autotuning
            import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() == "cpu":
            # DeepSpeed's CPU backend compiles a shared-memory all-reduce with g++ at its first init (28 s here) that
            # only its inference all-reduce uses; training's collectives go through the process group: skipped.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        options = {"cpu": False, "deepspeed_plugin": DeepSpeedPlugin(gradient_clipping=config.max_grad_norm)}
        return options | ({"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]} if use_cpu else {})

    def adapt_model(self, model, accelerator):
        """DeepSpeed bf16/fp16 keeps the weights themselves in 16 bits (no autocast), so float inputs are cast to
        them, as transformers' Trainer does for DeepSpeed (`_prepare_input`): a forward pre-hook casts every
        floating-point tensor argument. Token ids and labels (integers) pass unchanged."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
        if accelerator.distributed_type.value != DEEPSPEED or dtype is None:
            return model

        def cast(value):
            return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

        def cast_inputs(module, args, kwargs):
            return tuple(cast(arg) for arg in args), {name: cast(value) for name, value in kwargs.items()}

        model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
        return model


FEATURE = DeepSpeed()
