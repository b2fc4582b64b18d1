"""Is the template's loop as fast and as light as a hand-written PyTorch loop? Measure it, side by side.

    python scripts/benchmark.py --output b.json                 # the digits CNN, 1 process, CPU
    python scripts/benchmark.py --model linear                  # tiny model: per-step overhead dominates
    python scripts/benchmark.py --processes 2                   # DDP on CPU (gloo) through the launchers
    python scripts/benchmark.py --device cuda                   # on a GPU

Four sides train the same model on the same data with the same batch, optimiser, LR schedule and clipping:
`raw`, a minimal PyTorch loop over a DataLoader (the textbook loop); `raw_index`, the same loop batching by index
(one gather per batch from the tensors: the best raw loop); `accelerate`, the plain Accelerate loop of its examples
(`prepare`, `accelerator.backward`, `accelerator.clip_grad_norm_`); `template`, `train.main`, what `python train.py`
runs. The hand-written sides are standalone: they import torch, pyarrow to read the Parquet file, the network's own
file (src/models/digits_cnn.py, plain torch) and, for `accelerate`, accelerate; nothing of the template. Each side
runs in a fresh process, in the order raw, raw_index, accelerate, template, raw, ... under each of two conditions:
`default`, what a user gets (torch's default threads, no allocator settings), and `tuned` (one thread per process
and the allocator settings below: the least noisy). Samples/s is timed at every optimiser step (the LR scheduler's
step), over the steps after the first quarter. Reported per condition and side: samples/s (median, min, max over
rounds), time from the spawn to the first optimiser step, whole-process wall (spawn to exit), peak memory (CUDA
allocated, or the resident set of the process, rank 0 on N processes), the packages it imported; and the ratios of
each round's pair of runs (seconds apart, so drift of the machine cancels), their median as `ratios`. `runs` hold
every run's numbers, with `steps`, the optimiser steps it recorded (every side: --steps).
"""

import time

STARTED, START_PERF = time.time(), time.perf_counter()  # before heavy imports: startup counts from the spawn

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


SIDES = ("raw", "raw_index", "accelerate", "template")
HAND_WRITTEN = ("raw", "raw_index", "accelerate")
CONDITIONS = ("default", "tuned")
DATA = REPO / "data/digits/train.parquet"
NOT_PACKAGES = {*sys.stdlib_module_names, "cython_runtime"}  # left out of a run's `imports`


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "linear"], default="cnn")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, help="optimiser steps per run (default: 600 cnn, 3000 linear)")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="clipping on every side (0: none)")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)  # the child's: None is torch's default
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--recipe", type=json.loads, help=argparse.SUPPRESS)  # the child's: recipe(), as JSON
    args = parser.parse_args(argv)
    args.steps = args.steps or (600 if args.model == "cnn" else 3000)
    return args


# --- what all sides share: timestamps at each optimiser step, the recipe ---


def record_step_times() -> list[float]:
    """Timestamp every LR scheduler step (once per optimiser step on each side); the constructor's call is skipped."""
    import torch

    times: list[float] = []
    step = torch.optim.lr_scheduler.LambdaLR.step

    def timed_step(self, *args, **kwargs):
        step(self, *args, **kwargs)
        if getattr(self, "_benchmark_started", False):
            times.append(time.perf_counter())
        self._benchmark_started = True

    torch.optim.lr_scheduler.LambdaLR.step = timed_step
    return times


def summarize(times: list[float], batch: int, device) -> dict:
    """This run's numbers, and the packages it imported (outside the standard library)."""
    import resource

    import torch

    steady = times[len(times) // 4 :]
    if device.type == "cuda":
        peak_gb = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux
    return {
        "samples_per_s": (len(steady) - 1) * batch / (steady[-1] - steady[0]),
        "steps": len(times),
        "first_step_at": STARTED + (times[0] - START_PERF),
        "peak_memory_gb": peak_gb,
        "imports": sorted({name.split(".")[0] for name in sys.modules if not name.startswith("_")} - NOT_PACKAGES),
        "src_modules": sorted(name for name in sys.modules if name == "src" or name.startswith("src.")),
    }


def training_config(args, output_dir: str):
    """The template's config of this benchmark; the hand-written sides get its numbers as recipe()."""
    from src.cli import resolve
    from src.config import TrainConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return resolve(
        TrainConfig(
            output_dir=output_dir,
            task_args={"model": args.model},
            max_steps=args.steps,
            global_batch_size=args.batch,
            per_device_train_batch_size=args.batch // world,
            logging_steps=50,
            eval_steps=10**9,
            save_steps=0,
            save_total_limit=None,
            report_to="none",
            max_grad_norm=args.max_grad_norm,
        )
    )


def recipe(args) -> dict:
    """What the hand-written sides must train with to match the template: its defaults, read once by the parent."""
    config = training_config(args, "unused")
    names = ("seed", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "warmup_steps", "logging_steps")
    if config.lr_scheduler_type != "cosine":
        raise SystemExit("the hand-written sides implement the default schedule, cosine; keep it as the default")
    return {name: getattr(config, name) for name in names} | {k: config.task_args[k] for k in ("norm", "num_labels")}


def warmup_cosine(step: int, total_steps: int, warmup_steps: int) -> float:
    """The template's default LR multiplier, written by hand: linear warmup, then cosine to 0."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# --- the hand-written sides: (a) over a DataLoader, (b) by index, (c) the plain Accelerate loop ---


def read_digits(device):
    """The digits' train split as tensors, read the way a hand-written script does."""
    import pyarrow.parquet as pq
    import torch

    table = pq.read_table(DATA).to_pydict()
    images = torch.tensor(table["pixels"], dtype=torch.float32).div(16.0).view(-1, 1, 8, 8)
    return images.to(device), torch.tensor(table["label"]).to(device)


def build_network(args, recipe: dict):
    """The template's network for --model, from its own file (plain torch), under the recipe's seed."""
    import torch
    from torch import nn

    torch.manual_seed(recipe["seed"])
    if args.model == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, recipe["num_labels"]))
    from src.models.digits_cnn import DigitsCNN  # imports torch only

    return DigitsCNN(num_labels=recipe["num_labels"], norm=recipe["norm"])


def adamw_and_schedule(model, args, recipe: dict):
    """AdamW (fused) without weight decay on 1-D parameters (biases, norms), warmup + cosine: the template's
    defaults."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": recipe["weight_decay"]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    betas = (recipe["adam_beta1"], recipe["adam_beta2"])
    optimizer = torch.optim.AdamW(groups, lr=recipe["learning_rate"], betas=betas, fused=True)
    schedule = lambda step: warmup_cosine(step, args.steps, recipe["warmup_steps"])  # noqa: E731
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def train_by_hand(args, model, optimizer, scheduler, epoch_batches, backward, clip_grad_norm_, device) -> None:
    """The loop of every hand-written side: forward, backward, clipping, step, and one host sync per log interval
    (as the template's). The sides differ in how batches come and in the backward and clipping calls."""
    import torch
    import torch.nn.functional as F

    step, epoch, loss_sum = 0, 0, torch.zeros((), device=device)
    while step < args.steps:
        for inputs, targets in epoch_batches(epoch):
            loss = F.cross_entropy(model(inputs), targets)
            backward(loss)
            if args.max_grad_norm:
                clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            loss_sum += loss.detach()
            step += 1
            if step % args.recipe["logging_steps"] == 0:
                loss_sum.item()
                loss_sum.zero_()
            if step == args.steps:
                break
        epoch += 1


def run_raw(args, by_index: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    times = record_step_times()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")) if args.device == "cuda" else None)
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    seed, batch = args.recipe["seed"], args.batch // world
    if by_index:  # (b): the data on the device, a batch is one gather by a slice of the epoch's permutation
        images, labels = read_digits(device)
        generator = torch.Generator().manual_seed(seed)
        per_epoch = len(labels) // args.batch

        def epoch_batches(epoch: int):
            order = torch.randperm(len(labels), generator=generator)[: per_epoch * args.batch].to(device)
            for indices in order[rank::world].split(batch):  # this process's share of each global batch
                yield images[indices], labels[indices]
    else:  # (a): the textbook loop, a DataLoader over a TensorDataset
        dataset = TensorDataset(*read_digits("cpu"))
        sampler = DistributedSampler(dataset, seed=seed, drop_last=True) if world > 1 else None
        loader = DataLoader(dataset, batch_size=batch, shuffle=sampler is None, sampler=sampler, drop_last=True)

        def epoch_batches(epoch: int):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for inputs, targets in loader:
                yield inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    model = build_network(args, args.recipe).to(device)
    optimizer, scheduler = adamw_and_schedule(model, args, args.recipe)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    train_by_hand(args, model, optimizer, scheduler, epoch_batches, torch.Tensor.backward,
                  torch.nn.utils.clip_grad_norm_, device)  # fmt: skip
    return summarize(times, args.batch, device)


def run_accelerate(args) -> dict:
    """(c) The loop of Accelerate's examples (examples/cv_example.py): prepare, accelerator.backward, its clipping."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    times = record_step_times()
    accelerator = Accelerator(cpu=args.device == "cpu")  # cpu=True: gloo DDP on N CPU processes, not N copies
    loader = DataLoader(TensorDataset(*read_digits("cpu")), batch_size=args.batch // accelerator.num_processes,
                        shuffle=True, drop_last=True)  # fmt: skip
    model = build_network(args, args.recipe)
    optimizer, scheduler = adamw_and_schedule(model, args, args.recipe)
    # The scheduler is not prepared: Accelerate's would step it once per process per optimiser step
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def epoch_batches(epoch: int):
        loader.set_epoch(epoch)
        return loader

    train_by_hand(args, model, optimizer, scheduler, epoch_batches, accelerator.backward,
                  accelerator.clip_grad_norm_, accelerator.device)  # fmt: skip
    accelerator.end_training()
    return summarize(times, args.batch, accelerator.device)


# --- (d) the template: train.main, exactly what `python train.py` runs ---


def run_template(args) -> dict:
    times = record_step_times()
    import train

    with tempfile.TemporaryDirectory() as output_dir:
        train.main(training_config(args, output_dir))
    gc.freeze()  # the quick exit train.py's __main__ ends with
    import torch

    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")) if args.device == "cuda" else None)
    return summarize(times, args.batch, device)


def child_main(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.child == "template":
        result = run_template(args)
    elif args.child == "accelerate":
        result = run_accelerate(args)
    else:
        result = run_raw(args, by_index=args.child == "raw_index")
    if int(os.environ.get("RANK", "0")) == 0:
        args.result.write_text(json.dumps(result))


# --- the parent: interleave rounds, summarize ---


def child_command(args, side: str, condition: str, result: Path) -> list[str]:
    script = [str(Path(__file__).resolve()), "--child", side, "--result", str(result)]
    options = [
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--processes",
        str(args.processes),
        "--device",
        args.device,
        "--max_grad_norm",
        str(args.max_grad_norm),
    ]
    if condition == "tuned":
        options += ["--threads", "1"]
    if side in HAND_WRITTEN:
        options += ["--recipe", json.dumps(args.recipe)]
    if args.processes == 1:
        return [sys.executable, *script, *options]
    if side in ("accelerate", "template"):
        launcher = [
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "accelerate_configs/ddp.yaml"),
            "--num_processes",
            str(args.processes),
        ]
    else:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(args.processes)]
    return [sys.executable, *launcher, *script, *options]


# glibc's malloc by default hands freed activations back to the OS and page-faults them in again on the next step:
# 0-1,240 faults per CNN step here, a count that differs from process to process and moves the speed of the same
# loop by up to 20% between runs. The tuned condition runs every side with two allocator settings that stop the
# give-back, so the comparison sees the loops, not the allocator's luck. (Huge pages favoured the raw side: unused.)
# The template sets the same on the CPU itself (the fast_accelerator feature), so in the default
# condition its runs don't fault and the raw loops', as a hand-written loop's, do.
STEADY_ALLOCATOR = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def child_env(condition: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GLIBC_TUNABLES")}
    env["HF_HUB_OFFLINE"] = "1"
    if condition == "tuned":
        env |= {"OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": STEADY_ALLOCATOR}
    return env


def run_side(args, side: str, condition: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        spawned, clock = time.time(), time.perf_counter()
        completed = subprocess.run(
            child_command(args, side, condition, result),
            cwd=REPO,
            env=child_env(condition),
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - clock
        if completed.returncode != 0:
            sys.exit(f"error: the {side} run failed:\n{completed.stderr[-3000:]}")
        measured = json.loads(result.read_text())
    measured["seconds_to_first_step"] = measured.pop("first_step_at") - spawned
    measured["wall_s"] = wall
    return measured


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


RATIOS = {  # name: (numerator side, denominator side, what is compared; for time and memory, lower is better)
    "template/raw": ("template", "raw", "samples_per_s"),
    "template/raw_index": ("template", "raw_index", "samples_per_s"),
    "template/accelerate": ("template", "accelerate", "samples_per_s"),
    "raw_index/raw": ("raw_index", "raw", "samples_per_s"),
    "accelerate/raw": ("accelerate", "raw", "samples_per_s"),
    "wall template/raw": ("template", "raw", "wall_s"),
    "wall template/accelerate": ("template", "accelerate", "wall_s"),
    "wall accelerate/raw": ("accelerate", "raw", "wall_s"),
    "first step template/accelerate": ("template", "accelerate", "seconds_to_first_step"),
    "memory template/raw": ("template", "raw", "peak_memory_gb"),
    "memory accelerate/raw": ("accelerate", "raw", "peak_memory_gb"),
}


def summarize_condition(runs: dict) -> dict:
    report = {
        side: {key: spread([r[key] for r in results]) for key in ("samples_per_s", "seconds_to_first_step", "wall_s")}
        | {"peak_memory_gb": max(r["peak_memory_gb"] for r in results), "imports": results[0]["imports"]}
        | {"runs": results}
        for side, results in runs.items()
    }
    rounds = {
        name: [a[key] / b[key] for a, b in zip(runs[top], runs[bottom], strict=True)]
        for name, (top, bottom, key) in RATIOS.items()
    }
    report["round_ratios"] = rounds
    report["ratios"] = {name: statistics.median(values) for name, values in rounds.items()}
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return {}
    args.recipe = recipe(args)
    runs = {condition: {side: [] for side in SIDES} for condition in args.conditions}
    for round_index in range(args.rounds):
        for condition in args.conditions:
            for side in SIDES:  # each round's runs are seconds apart: their ratios cancel the machine's drift
                runs[condition][side].append(run_side(args, side, condition))
            speeds = ", ".join(f"{side} {runs[condition][side][-1]['samples_per_s']:9.0f}" for side in SIDES)
            print(f"round {round_index + 1}/{args.rounds} {condition}: samples/s {speeds}", flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "result", "output", "threads", "recipe")}
    conditions = {condition: summarize_condition(runs[condition]) for condition in args.conditions}
    report = {"settings": settings, "recipe": args.recipe, "conditions": conditions}
    for condition, measured in conditions.items():
        ratios = ", ".join(f"{name} {value:.3f}" for name, value in measured["ratios"].items())
        print(f"{condition}: {ratios} (medians of {args.rounds} rounds)")
        first = ", ".join(f"{side} {measured[side]['seconds_to_first_step']['median']:.2f} s" for side in SIDES)
        wall = ", ".join(f"{side} {measured[side]['wall_s']['median']:.2f} s" for side in SIDES)
        memory = ", ".join(f"{side} {measured[side]['peak_memory_gb'] * 1024:.0f} MB" for side in SIDES)
        print(f"{condition}: first step {first}; wall {wall}; peak memory {memory}")
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
