"""Convert a checkpoint between a whole model (one process or DDP) and FSDP2's shards, or from DeepSpeed ZeRO-2/3's
partitions to a whole model, so that a run continues under the other strategy (or on another number of processes)
with the same weights, optimiser state, schedule, RNG and data position (docs/sharded.md).

    python scripts/convert_checkpoint.py runs/digits/checkpoints/step_10 runs/sharded/checkpoints/step_10 --to FSDP2
    python scripts/convert_checkpoint.py runs/sharded/checkpoints/step_10 runs/whole/checkpoints/step_10 --to DDP

One process does it: the run's model and optimiser are built from the checkpoint's config.yaml, as train.py builds
them, and torch.distributed.checkpoint (DCP) moves their state between the two layouts; FSDP2 reshards DCP's files
onto any number of processes as it loads them. A ZeRO checkpoint is read by DeepSpeed's own consolidation
(src/features/deepspeed/convert.py). The rest of the checkpoint (schedule, RNG, data position) is copied.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

from accelerate.utils import MODEL_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.checkpoint import CONVERTS  # noqa: E402
from src.errors import UsageError, command_line  # noqa: E402
from src.run_dir import CONFIG_FILE, STATE_FILE, TMP_PREFIX  # noqa: E402

WHOLE = ("model.safetensors", "optimizer.bin")  # what Accelerate's save_state writes for one process or DDP
SHARDED = ("pytorch_model_fsdp_0", "optimizer_0")  # ... and under FSDP2 (DCP folders)
ZERO = (MODEL_NAME, "latest", "zero_to_*.py")  # ... and under DeepSpeed (its folder, tag file and scripts)


def convert(source: Path, target: Path, to: str) -> None:
    if not (source / STATE_FILE).is_file():
        raise UsageError(f"{source} is not a complete checkpoint (no {STATE_FILE}); use a checkpoints/step_<N> folder")
    if target.exists():
        raise UsageError(f"{target} exists; name a new folder for the converted checkpoint")
    state = json.loads((source / STATE_FILE).read_text())
    strategy, sharded = state.get("strategy"), to == "DDP"  # sharded: the source
    if strategy not in CONVERTS[to]:
        needs = "FSDP2's and DeepSpeed ZeRO-2/3's" if sharded else "a whole model's (one process or DDP)"
        raise UsageError(f"{source} was saved by {strategy}; --to {to} converts {needs} checkpoints only")

    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from src import optim, tasks
    from src.cli import parse_config

    config = parse_config(["--config", str(source / CONFIG_FILE)])
    task = tasks.build_task(config)
    model = tasks.starting_model(task, config, Accelerator(cpu=True))  # e.g. with LoRA's adapters, as in training
    optimizer = optim.build_optimizer(model, config)
    if strategy.startswith("DeepSpeed"):  # ZeRO's partitions: the deepspeed feature reads them with DeepSpeed's tools
        try:
            from src.features.deepspeed.convert import load_zero_checkpoint
        except ImportError as err:  # the feature deleted, or deepspeed not installed
            raise UsageError(f"converting {strategy}'s checkpoints needs the deepspeed feature: {err}") from None
        load_zero_checkpoint(source, model, optimizer)
    elif sharded:  # DCP's files -> this process's whole model and optimizer
        model_state, optimizer_state = get_state_dict(model, optimizer)  # (an empty optimizer state is initialised)
        dcp.load({"model": model_state}, checkpoint_id=source / SHARDED[0])
        dcp.load({"optimizer": optimizer_state}, checkpoint_id=source / SHARDED[1])
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    else:
        safetensors.torch.load_model(model, source / WHOLE[0])  # tied weights (a GPT's head) saved once: as Accelerate
        optimizer.load_state_dict(torch.load(source / WHOLE[1], weights_only=True))
    # written as save_checkpoint writes one: under TMP_PREFIX (which a run clears), the trainer state last
    partial = target.with_name(TMP_PREFIX + target.name)
    shutil.rmtree(partial, ignore_errors=True)
    try:
        shutil.copytree(source, partial, ignore=shutil.ignore_patterns(*WHOLE, *SHARDED, *ZERO, STATE_FILE))
        if sharded:
            safetensors.torch.save_model(model, partial / WHOLE[0], metadata={"format": "pt"})  # tied weights once
            torch.save(optimizer.state_dict(), partial / WHOLE[1])
        else:
            model_state, optimizer_state = get_state_dict(model, optimizer)  # keyed by parameter name, as FSDP2 saves
            dcp.save({"model": model_state}, checkpoint_id=partial / SHARDED[0])
            dcp.save({"optimizer": optimizer_state}, checkpoint_id=partial / SHARDED[1])
        (partial / STATE_FILE).write_text(json.dumps({**state, "strategy": to}, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # nothing half-written left behind
        raise
    partial.rename(target)  # whole or not at all
    print(f"{target}: the checkpoint for {to}; resume with --resume_from_checkpoint {target}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_<N> folder")
    parser.add_argument("output", type=Path, help="the converted checkpoint's folder (a new one)")
    parser.add_argument("--to", choices=["FSDP2", "DDP"], required=True)
    args = parser.parse_args()
    command_line(convert)(args.checkpoint, args.output, args.to)
