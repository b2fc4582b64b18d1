"""Plan a run's memory per device before renting the devices: the configured model's parameters, gradients, AdamW
state and activations under each sharding strategy, and the largest per-device batch that fits (docs/memory_planner.md).

    python scripts/plan_memory.py --devices 8 --device_memory 80GiB
    python scripts/plan_memory.py --config configs/lm.yaml --devices 8 --device_memory 80GiB --json plan.json

The run's flags and `--config` files are train.py's. The model and optimiser are built as train.py builds them, and
one micro-batch's forward, backward and optimiser step runs on the CPU under torch's MemTracker, which sorts every
tensor into parameters, gradients, optimiser state and activations; at two micro-batch sizes, so that activations
are known as a constant plus bytes per sample. A model whose weights and AdamW state would take more than a quarter
of this machine's memory is measured with fake tensors (torch's FakeTensorMode: shapes, no data), which give the
same bytes. The strategies' shares are arithmetic on those measurements.
"""

import argparse
import contextlib
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.errors import UsageError, command_line  # noqa: E402

TP = 2  # the tensor-parallel degree of the FSDP2+TP row
# strategy -> whether it divides (parameters, gradients, optimiser state) over the devices; each holds all otherwise
SHARDED = {
    "DDP": (False, False, False),
    "ZeRO-2": (False, True, True),
    "ZeRO-3": (True, True, True),
    "FSDP2": (True, True, True),
    "FSDP2+TP": (True, True, True),  # over dp x tp devices; the tp devices of a group share their micro-batch
}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
USAGE = "see python scripts/plan_memory.py --help"


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print its usage and exit; bad input is one line here
        raise UsageError(f"{message}; {USAGE}")


def memory_size(text: str) -> int:
    """'80GiB', '141GB', '24576MiB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS or float(match.group(1)) <= 0:
        raise UsageError(
            f"--device_memory {text}: not a memory size; write a number and a unit, e.g. 80GiB, 141GB or 24576MiB"
        )
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The planner's own flags, and the rest: train.py's, for train.py's parser (which names an unknown flag)."""
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--devices", type=int, required=True, help="devices (processes) the run will have")
    parser.add_argument("--device_memory", type=memory_size, required=True, help="memory of each, e.g. 80GiB")
    parser.add_argument("--json", type=Path, help="also write the plan to this file")
    parser.add_argument(
        "--fake", choices=["auto", "true", "false"], default="auto", help="measure with fake tensors (no data); "
        "auto: when the model's weights, gradients and AdamW state take over a quarter of this machine's memory"
    )  # fmt: skip
    args, rest = parser.parse_known_args(argv)
    if args.devices < 1:
        raise UsageError(f"--devices must be >= 1 (got {args.devices}); {USAGE}")
    return args, rest


# --- measuring one step ---


def categories(snapshot: dict) -> dict[str, int]:
    """A MemTracker snapshot, summed over devices, keyed by the categories' names (Parameter, Gradient, Activation,
    Temp, Optstate, Buffer, Other, Total)."""
    summed = {}
    for device in snapshot.values():
        for key, value in device.items():
            name = getattr(key, "value", key)
            summed[name] = summed.get(name, 0) + value
    return summed


def measure_step(task, model, optimizer, batch) -> dict[str, int]:
    """One micro-batch's forward, backward and optimiser step: what the step leaves (parameters, their gradients, the
    optimiser's state) and the peak of what the forward and backward make (activations, temporaries, the batch)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer, batch)  # the batch: "Other"
    with tracker:
        task.loss(model, batch).backward()
        peak = categories(tracker.get_tracker_snapshot("peak"))
        optimizer.step()
        held = categories(tracker.get_tracker_snapshot())  # gradients still there: zero_grad() frees them
        optimizer.zero_grad()
    return {
        "param_bytes": held.get("Parameter", 0),
        "buffer_bytes": held.get("Buffer", 0),
        "grad_bytes": held.get("Gradient", 0),
        "optimizer_state_bytes": held.get("Optstate", 0),
        "activation_bytes": sum(peak.get(name, 0) for name in ("Activation", "Temp", "Other")),
    }


def first_batches(task, config, sizes: tuple[int, int]) -> dict:
    """size -> a micro-batch of that many samples: the first batch of the loader train.py would build, of the larger
    size, and its first samples (padded text stays as long in both, so that only the batch size differs)."""
    import dataclasses

    import torch
    from accelerate.utils import set_seed
    from torch.utils._pytree import tree_map_only

    from src import features, loaders

    set_seed(config.seed)  # the loader shuffles: the same batch on every call
    config = dataclasses.replace(config, per_device_train_batch_size=max(sizes))
    loader = features.installed().train_loader(task, config, False)  # e.g. a stream
    if loader is None:
        train_set, eval_set = task.build_datasets()
        loader, _ = loaders.build_dataloaders(train_set, eval_set, config, task.collate_fn())
    batch = next(iter(loader))
    batch = dict(batch) if isinstance(batch, Mapping) else batch  # e.g. a BatchEncoding: a dict torch's pytree walks
    return {size: tree_map_only(torch.Tensor, lambda tensor, size=size: tensor[:size].clone(), batch) for size in sizes}


def too_big_for_ram(task, config, accelerator) -> bool:
    """Whether the model's weights, gradients and AdamW's two states would take over a quarter of this machine's
    memory; counted on a model of fake tensors, so that nothing is allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from src import tasks

    try:
        with FakeTensorMode():
            model = tasks.starting_model(task, config, accelerator)
    except Exception:  # a model fake tensors can't build is measured with real ones
        return False
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 4 * weights > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4


def measure(config, fake: str) -> dict:
    """The step measured at two micro-batch sizes (half the configured one and the configured one), without and, for
    a model that supports it, with activation checkpointing."""
    import torch
    from accelerate import Accelerator
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map_only

    from src import distributed, optim, tasks

    per_device = config.per_device_train_batch_size
    sizes = (per_device // 2, per_device) if per_device > 1 else (1, 2)
    task = tasks.build_task(config)
    batches = first_batches(task, config, sizes)  # real data, also for fake tensors
    accelerator = Accelerator(cpu=True)  # what features adapt the model for, as scripts/convert_checkpoint.py
    use_fake = fake == "true" or (fake == "auto" and too_big_for_ram(task, config, accelerator))
    mode = FakeTensorMode() if use_fake else contextlib.nullcontext()
    measured = {"fake_tensors": use_fake, "batch_sizes": list(sizes), "steps": {}}
    with mode, tasks.task_errors(type(task)):
        model = tasks.starting_model(task, config, accelerator)
        model.train()
        optimizer = optim.build_optimizer(model, config)
        checkpointing = [False, *([True] if any(hasattr(model, name) for name in distributed.CHECKPOINTING) else [])]
        measured["activation_checkpointing"] = checkpointing
        for checkpointed in checkpointing:
            if checkpointed:  # one way only, so after the runs without it
                distributed.enable_gradient_checkpointing(model)
            for size in sizes:
                batch = batches[size]
                if use_fake:
                    batch = tree_map_only(torch.Tensor, mode.from_tensor, batch)
                measured["steps"][step_key(size, checkpointed)] = measure_step(task, model, optimizer, batch)
    measured["model"] = type(model).__name__
    measured["parameters"] = sum(p.numel() for p in model.parameters())
    return measured


def step_key(size: int, checkpointed: bool) -> str:
    """How the plan's JSON names a measured step: "16", or "16+ac" with activation checkpointing."""
    return f"{size}+ac" if checkpointed else str(size)


def activation_line(measured: dict, checkpointed: bool) -> tuple[float, float]:
    """(bytes per sample, constant bytes) of activations, through the two measured micro-batches."""
    small, large = measured["batch_sizes"]
    at_small = measured["steps"][step_key(small, checkpointed)]["activation_bytes"]
    at_large = measured["steps"][step_key(large, checkpointed)]["activation_bytes"]
    per_sample = (at_large - at_small) / (large - small)
    return per_sample, at_small - per_sample * small


# --- the plan: arithmetic on the measurements ---


def largest_batch(free: float, per_sample: float, samples_per_group: int) -> int:
    """The largest micro-batch that fits in `free` bytes and divides the samples each data-parallel group takes per
    optimiser step (the global batch stays the same); 0 if none does."""
    fits = math.floor(free / per_sample) if per_sample > 0 else samples_per_group
    return max([b for b in range(1, min(fits, samples_per_group) + 1) if samples_per_group % b == 0], default=0)


def plan(measured: dict, global_batch: int, devices: int, device_memory: int) -> list[dict]:
    """Per strategy, without and with activation checkpointing: each device's bytes at the largest micro-batch that
    fits (1 where none does) and the gradient accumulation that keeps the global batch."""
    whole = measured["steps"][step_key(measured["batch_sizes"][0], False)]
    rows = []
    for strategy, sharded in SHARDED.items():
        if strategy == "FSDP2+TP" and (devices < TP or devices % TP):
            continue
        data_parallel = devices // TP if strategy == "FSDP2+TP" else devices
        samples = global_batch // data_parallel if global_batch % data_parallel == 0 else 0  # per group and step
        params, grads, states = (
            math.ceil(whole[key] / devices) if divided else whole[key]
            for key, divided in zip(("param_bytes", "grad_bytes", "optimizer_state_bytes"), sharded, strict=True)
        )
        held = params + whole["buffer_bytes"] + grads + states  # buffers: whole on every device
        for checkpointed in measured["activation_checkpointing"]:
            per_sample, constant = activation_line(measured, checkpointed)
            batch = largest_batch(device_memory - held - max(constant, 0), per_sample, samples)
            activations = max(0, round(constant + per_sample * max(batch, 1)))
            rows.append({
                "strategy": strategy, "activation_checkpointing": checkpointed, "data_parallel": data_parallel,
                "param_bytes": params, "buffer_bytes": whole["buffer_bytes"], "grad_bytes": grads,
                "optimizer_state_bytes": states, "activation_bytes": activations, "total_bytes": held + activations,
                "activation_bytes_per_sample": per_sample, "activation_bytes_constant": constant,
                "max_per_device_batch": batch, "gradient_accumulation": samples // batch if batch else None,
                "problem": None if batch else (
                    "does not fit at a micro-batch of 1" if samples
                    else f"the global batch {global_batch} does not divide over {data_parallel} data-parallel groups"
                ),
            })  # fmt: skip
    return rows


# --- output ---


def size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""  # not reached


def table(result: dict) -> str:
    measured, config = result["measured"], result["config"]
    small, large = measured["batch_sizes"]
    how = "fake tensors" if measured["fake_tensors"] else "real tensors"
    lines = [
        f"{config['task']}: {measured['model']}, {measured['parameters']:,} parameters; one step measured on the CPU "
        f"({how}) at micro-batches {small} and {large}",
        f"{result['devices']} devices of {size(result['device_memory'])}, global batch {result['global_batch']}; "
        "bytes per device at the largest micro-batch that fits (max batch; 1 where none does)",
    ]
    if measured["activation_checkpointing"] == [False]:
        lines.append(f"activation checkpointing: {measured['model']} has no gradient_checkpointing_enable(): none")
    header = ["strategy", "act. ckpt", "parameters", "gradients", "optimizer", "activations", "total", "max batch",
              "accumulation"]  # fmt: skip
    rows = [header]
    for row in result["strategies"]:
        batch = row["max_per_device_batch"]
        rows.append([
            row["strategy"], "yes" if row["activation_checkpointing"] else "no",
            size(row["param_bytes"] + row["buffer_bytes"]), size(row["grad_bytes"]),
            size(row["optimizer_state_bytes"]), size(row["activation_bytes"]), size(row["total_bytes"]),
            str(batch) if batch else "-", str(row["gradient_accumulation"] or "-"),
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    problems = dict.fromkeys(f"{row['strategy']}: {row['problem']}" for row in result["strategies"] if row["problem"])
    return "\n".join([*lines, *problems])


def main(argv: list[str] | None = None) -> dict:
    from src.cli import parse_config

    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = parse_config(rest)
    except UsageError as err:  # an unknown flag: name the planner's own flags too
        own = "the planner's own flags: --devices, --device_memory, --json, --fake"
        raise UsageError(f"{err} ({own})" if "unrecognized arguments" in str(err) else str(err)) from err
    measured = measure(config, args.fake)
    # the global batch to keep: the configured one, or what the configured accumulation makes on these devices
    global_batch = config.global_batch_size or (
        config.per_device_train_batch_size * args.devices * config.gradient_accumulation_steps
    )
    result = {
        "devices": args.devices, "device_memory": args.device_memory, "global_batch": global_batch,
        "config": {"task": config.task, "per_device_train_batch_size": config.per_device_train_batch_size},
        "measured": measured, "strategies": plan(measured, global_batch, args.devices, args.device_memory),
    }  # fmt: skip
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    command_line(main)()
