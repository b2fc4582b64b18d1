"""FSDP2 in two dimensions, through the accelerate config's `parallelism_config` (docs/tensor_parallel.md):
- x tensor parallel (accelerate_configs/fsdp_tp.yaml, dp_shard_size x tp_size processes): `--task causal_lm`'s GPT
  (plan.py) or a `--task language_modeling` transformers model such as a Llama (transformers_plan.py: the model's own
  `base_model_tp_plan`) with its linears split over the tensor-parallel ranks, and every parameter sharded over the
  data-parallel ones by FSDP2. Its sharded checkpoints resume on the same mesh (src/checkpoint.py refuses another
  process count or strategy: the saved `setup/strategy` is FSDP2+TP).
- HSDP (accelerate_configs/hsdp.yaml, dp_replicate_size x dp_shard_size processes): any model sharded by FSDP2 within
  each replica group and its gradients all-reduced across the groups; `setup/strategy` is HSDP.

Accelerate builds the device mesh and hands the tensor-parallel ranks of a data-parallel group the same batches
(data_loader.py: process_index // tp_size); its FSDP2 path shards over the mesh's data-parallel dimensions. On CPU
processes it refuses the parallelism config (`ParallelismConfig._validate_accelerator`: FSDP2 or a GPU-like type
only, and the state is MULTI_CPU when the Accelerator is built; src/strategy.py makes FSDP2 there afterwards), so
here the config is built after that switch, as `Accelerator.__init__` would build it; on GPUs Accelerate builds it.
The plan, the skipped `_prepare_tp` and the metrics gathered once per data-parallel group are the feature's on both.
"""

import os

from src.errors import LaunchError
from src.features import Feature
from src.strategy import FSDP, refuse_older_torch, requested_strategy

USE_VARIABLE = "ACCELERATE_USE_PARALLELISM_CONFIG"  # what `accelerate launch` sets for a config's parallelism_config
DEFERRED = "deferred"  # its value once the feature holds the config back (Accelerate builds it for "true" only)
TASKS = ("causal_lm", "language_modeling")  # the tasks whose models have a plan: the GPT's, a transformers model's
# tensor parallel over gloo: torch 2.9 and 2.10 train unlike one process, 2.11 on as one process does (its tests,
# 2026-12-06); HSDP needs what FSDP2 needs (src/strategy.py)
CPU_TP_TORCH = "2.11"


def asked_for() -> bool:
    """Whether the accelerate config has a `parallelism_config` (its sizes: `ParallelismConfig()` reads them)."""
    return os.environ.get(USE_VARIABLE, "").lower() in ("true", DEFERRED)


class TensorParallel(Feature):
    def __init__(self):
        self.deferred = None  # the ParallelismConfig built after FSDP2 is enabled on CPU processes

    def check_launch(self, use_cpu: bool, config) -> None:
        if not asked_for():
            return
        from accelerate.parallelism_config import ParallelismConfig

        sizes = ParallelismConfig()  # the launcher's PARALLELISM_CONFIG_* variables
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if requested_strategy() != FSDP or sizes.dp_shard_size < 2 or sizes.cp_enabled or sizes.sp_enabled:
            raise LaunchError(
                "a parallelism_config here is FSDP2's, with tensor parallel or replicas (HSDP): use "
                "accelerate_configs/fsdp_tp.yaml or hsdp.yaml (distributed_type FSDP, fsdp_version 2, "
                "parallelism_config_dp_shard_size >= 2, no cp or sp)"
            )
        if sizes.total_size != launched:
            raise LaunchError(
                f"the accelerate config's parallelism_config asks for {sizes.total_size} processes "
                f"(dp_replicate x dp_shard x tp x cp) but {launched} were launched; launch with --num_processes "
                f"{sizes.total_size} or change the sizes"
            )
        if use_cpu and sizes.tp_enabled:
            refuse_older_torch("tensor parallel", CPU_TP_TORCH, instead="accelerate_configs/fsdp.yaml")
        if config is None or not sizes.tp_enabled:  # scripts/launch.py: the accelerate config alone; or HSDP
            return
        if config.task not in TASKS:
            raise LaunchError(
                f"tensor parallelism has plans for --task causal_lm's GPT and --task language_modeling's transformers "
                f"models only, not {config.task}; use accelerate_configs/fsdp.yaml"
            )

    def accelerator_options(self, use_cpu: bool, config) -> dict | None:
        """On CPU processes: FSDP2's plugin (src/strategy.py enables it), the parallelism config held back until then.
        On GPUs: None, Accelerate's own path."""
        if not asked_for() or not use_cpu:
            return None
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import FullyShardedDataParallelPlugin

        self.deferred = ParallelismConfig()
        os.environ[USE_VARIABLE] = DEFERRED  # else Accelerator() builds it now, on a MULTI_CPU state it refuses
        return {"cpu": True, "fsdp_plugin": FullyShardedDataParallelPlugin()}

    def adapt_model(self, model, accelerator):
        """The device mesh (on CPU processes, now that the state is FSDP2), then the model's plan (`plan_for`) on its
        "tp" dimension (Accelerate's prepare shards it over the data-parallel dimensions) and metrics gathered once
        per data-parallel group. HSDP has no plan: Accelerate's prepare shards the model over its replicas' mesh."""
        if self.deferred is not None:
            enable_on_cpu(accelerator, self.deferred)
            self.deferred = None
        config = accelerator.state.parallelism_config if hasattr(accelerator.state, "parallelism_config") else None
        if config is None or not config.tp_enabled:
            return model
        check, parallelize = plan_for(model)
        if problem := check(model, config.tp_size):
            raise LaunchError(problem)
        skip_accelerates_tp_pass(accelerator)
        gather_metrics_over_data_parallel_ranks(accelerator, config.tp_size)
        return parallelize(model, accelerator.torch_device_mesh["tp"])


def plan_for(model):
    """(check, parallelize) of the model's plan: the GPT's (plan.py) or a transformers model's own
    (transformers_plan.py); anything else is refused."""
    from src.features.gpt.model import GPT
    from src.features.tensor_parallel import plan, transformers_plan

    if isinstance(model, GPT):
        return plan.check_divisible, plan.parallelize_gpt
    if transformers_plan.is_transformers_model(model):
        return transformers_plan.check_plan, transformers_plan.parallelize_transformers_model
    raise LaunchError(
        f"tensor parallelism has plans for the causal_lm GPT and transformers models only, not {type(model).__name__}"
    )


def enable_on_cpu(accelerator, config) -> None:
    """What `Accelerator.__init__` does with a parallelism config (accelerator.py: `self.state.device_mesh =
    ...get_device_mesh(self.device.type)`, then `_validate_accelerator`), done once FSDP2 is on; checked."""
    state = accelerator.state
    if not accelerator.is_fsdp2 or getattr(state, "parallelism_config", None) is not None:
        raise LaunchError(
            "this Accelerate did not take FSDP2 x tensor parallel on CPU processes as expected "
            "(src/features/tensor_parallel/); use accelerate_configs/fsdp.yaml on this machine"
        )
    state.parallelism_config = config
    state.device_mesh = config.get_device_mesh(accelerator.device.type)
    config._validate_accelerator(accelerator)
    mesh = accelerator.torch_device_mesh
    if mesh is None or accelerator.parallelism_config is not config:
        raise LaunchError(
            "this Accelerate did not build the parallelism config's device mesh on CPU processes "
            "(src/features/tensor_parallel/); use accelerate_configs/fsdp.yaml on this machine"
        )


def skip_accelerates_tp_pass(accelerator) -> None:
    """`prepare` runs `Accelerator._prepare_tp` before FSDP2's: for a model whose parameters are all DTensors already
    (plan.py makes them so) it only remaps the optimizer to the same parameters, but it first imports transformers'
    `ReplicateParallel`, which transformers 5 no longer has (ImportError). So it is skipped; `_prepare_fsdp2`
    prepares everything, as for plain FSDP2."""
    if not callable(getattr(type(accelerator), "_prepare_tp", None)):
        raise LaunchError(
            "this Accelerate has no Accelerator._prepare_tp (src/features/tensor_parallel/ expects it); "
            "use accelerate_configs/fsdp.yaml"
        )
    accelerator._prepare_tp = lambda *args: args


def gather_metrics_over_data_parallel_ranks(accelerator, tp_size: int) -> None:
    """`gather_for_metrics` (evaluation, prediction) keeping one copy per data-parallel group: the tensor-parallel ranks
    of a group read the same batches and give the same outputs, which Accelerate's gather over every process would
    count `tp_size` times, and its cut of an uneven last batch (by the loader's data-parallel remainder) would cut
    wrongly. Processes are numbered with the tensor-parallel rank innermost (the mesh is (dp_shard, tp)), so every
    `tp_size`-th process's part is one group's."""
    import torch
    from accelerate.utils import recursively_apply

    world = accelerator.num_processes
    whole = type(accelerator).gather

    def gather(data):
        return recursively_apply(lambda t: torch.cat(t.chunk(world)[::tp_size]), whole(accelerator, data))

    def gather_for_metrics(data, use_gather_object: bool = False):
        if use_gather_object:
            raise LaunchError("gathering Python objects under tensor parallelism is not supported here")
        accelerator.gather = gather  # what Accelerate's gather_for_metrics gathers with
        try:
            return type(accelerator).gather_for_metrics(accelerator, data)
        finally:
            del accelerator.gather

    accelerator.gather_for_metrics = gather_for_metrics


FEATURE = TensorParallel()
