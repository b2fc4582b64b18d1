"""A ZeRO-2/3 checkpoint (a partition per process) read into one process's whole model and optimizer, so that
scripts/convert_checkpoint.py writes it as a one-process/DDP checkpoint that resumes on any process count.

DeepSpeed's own consolidation does the reading: `zero_to_fp32` gathers the fp32 master weights (the ones the next
step updates, also under bf16), `ds_to_universal` (its universal checkpoint) the AdamW state of each parameter. Both
run on the CPU, one process, no process group.
"""

import argparse
import contextlib
import io
import tempfile
from pathlib import Path

import torch
from accelerate.utils import MODEL_NAME
from deepspeed.checkpoint import ds_to_universal
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from src.errors import UsageError, one_line

TAG = MODEL_NAME  # "pytorch_model": the folder Accelerate's save_state gives DeepSpeed's save_checkpoint


def load_zero_checkpoint(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The weights and the AdamW state (exp_avg, exp_avg_sq, step, and the groups' hyperparameters: lr is the
    schedule's current one) of `checkpoint`, a checkpoints/step_<N> folder saved under ZeRO-2/3 on any process
    count, into `model` and `optimizer` as built by train.py on one process. Partitions missing or not of this
    model: one line (UsageError)."""
    if not (checkpoint / TAG).is_dir():
        raise UsageError(f"{checkpoint} has no {TAG}/ (DeepSpeed's partitions); convert a complete ZeRO checkpoint")
    try:
        read_partitions(checkpoint, model, optimizer)
    except Exception as err:  # DeepSpeed asserts, and raises its own kinds, on partitions it can't read
        raise UsageError(
            f"{checkpoint}: its partitions do not fit this model/optimiser or are damaged: {one_line(err)[:300]}"
        ) from err


def read_partitions(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # DeepSpeed's chatter
        model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag=TAG))
        with tempfile.TemporaryDirectory() as scratch:  # it also writes `latest_universal` beside its output folder
            universal = Path(scratch) / "universal"
            ds_to_universal.main(universal_arguments(checkpoint / TAG, universal))
            load_optimizer_state(universal / "zero", model, optimizer)


def universal_arguments(source: Path, target: Path) -> argparse.Namespace:
    """ds_to_universal's command-line arguments: in this process (no worker pool); its `--inject_missing_state`
    because Accelerate's engine saves no universal-checkpoint info, which only pipeline/tensor parallelism needs."""
    return argparse.Namespace(
        input_folder=str(source), output_folder=str(target), num_extract_workers=1, num_merge_workers=1,
        keep_temp_folder=False, strict=True, inject_missing_state=True,
    )  # fmt: skip


def load_optimizer_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """`folder`: the universal checkpoint's zero/, a folder per parameter named as in `model.named_parameters()`
    (`exp_avg.pt`, `exp_avg_sq.pt`, flat), and `optimizer_state.pt` with the param groups in the optimizer's order."""
    common = torch.load(folder / "optimizer_state.pt", weights_only=False)  # DeepSpeed's own objects: trusted here
    names = {param: name for name, param in model.named_parameters()}
    fresh = optimizer.state_dict()  # its params are numbered in group order: the layout optimizer.bin has
    pairs = zip(common[PARAM_GROUPS], fresh["param_groups"], strict=True)  # ZeRO keeps the optimizer's groups
    groups = [{**saved, "params": group["params"]} for saved, group in pairs]  # saved: lr, betas, weight_decay, ...
    state = {}
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        path = folder / names[param]
        state[index] = {key: universal_tensor(path / f"{key}.pt").view_as(param) for key in ("exp_avg", "exp_avg_sq")}
        # AdamW's bias correction needs the step exact. ZeRO-1/2 write each parameter's; ZeRO-3 keeps one per flat
        # group, equal in all of them, as its own universal load reads it. A tensor per parameter, as torch's own:
        # fused AdamW adds 1 to it in place for each parameter that shares it.
        step_file = path / "step.pt"
        step = universal_tensor(step_file) if step_file.is_file() else common[OPTIMIZER_STATE_DICT]["state"][0]["step"]
        state[index]["step"] = torch.tensor(float(step))
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def universal_tensor(path: Path) -> torch.Tensor:
    value = torch.load(path, weights_only=False)
    return value[PARAM] if isinstance(value, dict) else value  # ZeRO-1/2: {"param": ..., "cat_dim": ...}; ZeRO-3 bare
