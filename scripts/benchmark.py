"""Is the template's loop as fast as a hand-written PyTorch loop? Measure it, side by side.

    python scripts/benchmark.py --output b.json                 # the digits CNN, 1 process, CPU
    python scripts/benchmark.py --model linear                  # tiny model: per-step overhead dominates
    python scripts/benchmark.py --processes 2                   # DDP on CPU (gloo) through the launchers
    python scripts/benchmark.py --device cuda                   # on a GPU

Three sides train the same model on the same data with the same batch, optimiser, LR schedule and clipping:
`raw`, a minimal PyTorch loop over a DataLoader (the naive hand-written loop); `raw_index`, the same loop batching
by index (one gather per batch from the tensors: the best raw loop); `template`, `train.main`, what
`python train.py` runs. Each runs in a fresh process, in the order raw, raw_index, template, raw, ... under each of
two conditions: `default`, what a user gets (torch's default threads, no allocator settings), and `tuned` (one
thread per process and the allocator settings below: the least noisy). Samples/s is timed at every optimiser step
(the LR scheduler's step), over the steps after the first quarter. Reported per condition and side: samples/s
(median, min, max over rounds), time from the spawn to the first optimiser step, whole-process wall (spawn to exit),
peak memory (CUDA allocated, or the resident set of the process, rank 0 on N processes); and the ratios of each
round's pair of runs (seconds apart, so drift of the machine cancels), their median as `ratios`. `runs` hold every
run's numbers, with `steps`, the optimiser steps it recorded (every side: --steps).
"""

import time

STARTED, START_PERF = time.time(), time.perf_counter()  # before heavy imports: startup counts from the spawn

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


SIDES = ("raw", "raw_index", "template")
CONDITIONS = ("default", "tuned")


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
    args = parser.parse_args(argv)
    args.steps = args.steps or (600 if args.model == "cnn" else 3000)
    return args


# --- what all sides share: timestamps at each optimiser step, the settings ---


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
    from src.meters import peak_memory_gb

    steady = times[len(times) // 4 :]
    return {
        "samples_per_s": (len(steady) - 1) * batch / (steady[-1] - steady[0]),
        "steps": len(times),
        "first_step_at": STARTED + (times[0] - START_PERF),
        "peak_memory_gb": peak_memory_gb(device),
    }


def training_config(args, output_dir: str):
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


# --- the raw loops: (a) over a DataLoader, (b) by index ---


def run_raw(args, by_index: bool) -> dict:
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from src.optim import build_optimizer, build_scheduler
    from src.tasks import build_task

    times = record_step_times()
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")) if args.device == "cuda" else None)
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    config = training_config(args, "unused")
    table = pq.read_table(REPO / "data/digits/train.parquet").to_pydict()
    images = torch.tensor(table["pixels"], dtype=torch.float32).div(16.0).view(-1, 1, 8, 8)
    labels = torch.tensor(table["label"])
    batch = args.batch // world
    if by_index:  # (b): the data on the device, a batch is one gather by a slice of the epoch's permutation
        images, labels = images.to(device), labels.to(device)
        generator = torch.Generator().manual_seed(config.seed)
        per_epoch = len(labels) // args.batch

        def epoch_batches(epoch: int):
            order = torch.randperm(len(labels), generator=generator)[: per_epoch * args.batch].to(device)
            for indices in order[rank::world].split(batch):  # this process's share of each global batch
                yield images[indices], labels[indices]
    else:  # (a): the textbook loop, a DataLoader over a TensorDataset
        dataset = TensorDataset(images, labels)
        sampler = DistributedSampler(dataset, seed=config.seed, drop_last=True) if world > 1 else None
        loader = DataLoader(dataset, batch_size=batch, shuffle=sampler is None, sampler=sampler, drop_last=True)

        def epoch_batches(epoch: int):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for inputs, targets in loader:
                yield inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    torch.manual_seed(config.seed)
    model = build_task(config).build_model().to(device)  # the same network, none of the template's loop
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, args.steps)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    step, epoch, loss_sum = 0, 0, torch.zeros((), device=device)
    while step < args.steps:
        for inputs, targets in epoch_batches(epoch):
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            if config.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            loss_sum += loss.detach()
            step += 1
            if step % config.logging_steps == 0:
                loss_sum.item()  # the same host sync per log interval as the template's
                loss_sum.zero_()
            if step == args.steps:
                break
        epoch += 1
    return summarize(times, args.batch, device)


# --- (c) the template: train.main, exactly what `python train.py` runs ---


def run_template(args) -> dict:
    times = record_step_times()
    import train

    with tempfile.TemporaryDirectory() as output_dir:
        train.main(training_config(args, output_dir))
    import torch

    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")) if args.device == "cuda" else None)
    return summarize(times, args.batch, device)


def child_main(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = run_template(args) if args.child == "template" else run_raw(args, by_index=args.child == "raw_index")
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
    if args.processes == 1:
        return [sys.executable, *script, *options]
    if side == "template":
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
# The template sets the same on the CPU itself (src/fast_path.py: keep_freed_host_memory), so in the default
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


RATIOS = {  # name: (numerator side, denominator side, what is compared; for wall and memory, lower is better)
    "template/raw": ("template", "raw", "samples_per_s"),
    "template/raw_index": ("template", "raw_index", "samples_per_s"),
    "raw_index/raw": ("raw_index", "raw", "samples_per_s"),
    "wall template/raw": ("template", "raw", "wall_s"),
    "wall template/raw_index": ("template", "raw_index", "wall_s"),
    "memory template/raw": ("template", "raw", "peak_memory_gb"),
}


def summarize_condition(runs: dict) -> dict:
    report = {
        side: {key: spread([r[key] for r in results]) for key in ("samples_per_s", "seconds_to_first_step", "wall_s")}
        | {"peak_memory_gb": max(r["peak_memory_gb"] for r in results), "runs": results}
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
    runs = {condition: {side: [] for side in SIDES} for condition in args.conditions}
    for round_index in range(args.rounds):
        for condition in args.conditions:
            for side in SIDES:  # each round's runs are seconds apart: their ratios cancel the machine's drift
                runs[condition][side].append(run_side(args, side, condition))
            speeds = ", ".join(f"{side} {runs[condition][side][-1]['samples_per_s']:9.0f}" for side in SIDES)
            print(f"round {round_index + 1}/{args.rounds} {condition}: samples/s {speeds}", flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "result", "output", "threads")}
    report = {"settings": settings, "conditions": {c: summarize_condition(runs[c]) for c in args.conditions}}
    for condition, measured in report["conditions"].items():
        ratios = ", ".join(f"{name} {value:.3f}" for name, value in measured["ratios"].items())
        first = ", ".join(f"{side} {measured[side]['seconds_to_first_step']['median']:.2f} s" for side in SIDES)
        print(f"{condition}: {ratios} (medians of {args.rounds} rounds); first step: {first}")
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
