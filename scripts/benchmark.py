"""Is the template's loop as fast as a hand-written PyTorch loop? Measure it, side by side.

    python scripts/benchmark.py --output b.json                 # the digits CNN, 1 process, CPU
    python scripts/benchmark.py --model linear                  # tiny model: per-step overhead dominates
    python scripts/benchmark.py --processes 2                   # DDP on CPU (gloo) through the launchers
    python scripts/benchmark.py --device cuda                   # on a GPU

Each round runs (a) a minimal raw PyTorch loop and (b) `train.main`, the code `python train.py` runs, each in a
fresh process, in the order a b a b ... Both train the same model on the same data with the same batch, optimiser,
LR schedule and clipping, and run with the same allocator settings. Both are timed the same way: a timestamp at
every optimiser step (the LR scheduler's step); steady-state samples/s is taken over the steps after the first
quarter. Reported: `ratio`, the median over rounds of b/a within each round (the pair is seconds apart, so drift of
the machine cancels), the round ratios, samples/s per side (median, min, max over rounds), time from process start
to the first optimiser step, and peak memory (CUDA allocated, or the process's resident set on CPU); each side's
`runs` hold every round's numbers, with `steps`, the optimiser steps the run recorded (both sides: --steps).
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "linear"], default="cnn")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, help="optimiser steps per run (default: 400 cnn, 2000 linear)")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (1: least noisy)")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--child", choices=["raw", "template"], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (400 if args.model == "cnn" else 2000)
    return args


# --- what both sides share: timestamps at each optimiser step, the settings ---


def record_step_times() -> list[float]:
    """Timestamp every LR scheduler step (once per optimiser step on both sides); the constructor's call is skipped."""
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


def summarize(times: list[float], batch: int) -> dict:
    steady = times[len(times) // 4 :]
    return {"samples_per_s": (len(steady) - 1) * batch / (steady[-1] - steady[0]), "steps": len(times)}


def peak_memory_gb(device) -> float:
    from src.meters import peak_memory_gb as measure

    return measure(device)


def training_config(args, output_dir: str):
    from src.config import TrainConfig, resolve

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return resolve(TrainConfig(
        output_dir=output_dir, task_args={"model": args.model}, max_steps=args.steps, global_batch_size=args.batch,
        per_device_train_batch_size=args.batch // world, logging_steps=50, eval_steps=10**9, save_steps=0,
        save_total_limit=None, report_to="none",
    ))  # fmt: skip


# --- (a) the raw loop ---


def run_raw(args) -> dict:
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from src.optim import build_optimizer, build_scheduler
    from src.tasks import build_task

    times = record_step_times()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")) if args.device == "cuda" else None)
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    config = training_config(args, "unused")
    table = pq.read_table(REPO / "data/digits/train.parquet").to_pydict()
    images = torch.tensor(table["pixels"], dtype=torch.float32).div(16.0).view(-1, 1, 8, 8)
    dataset = TensorDataset(images, torch.tensor(table["label"]))
    sampler = DistributedSampler(dataset, seed=config.seed, drop_last=True) if world > 1 else None
    loader = DataLoader(
        dataset, batch_size=args.batch // world, shuffle=sampler is None, sampler=sampler, drop_last=True
    )

    torch.manual_seed(config.seed)
    model = build_task(config).build_model().to(device)  # the same network, none of the template's loop
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, args.steps)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    step, epoch, loss_sum = 0, 0, torch.zeros((), device=device)
    while step < args.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for inputs, labels in loader:
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
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
    return {**summarize(times, args.batch), "first_step_at": STARTED + (times[0] - START_PERF),
            "peak_memory_gb": peak_memory_gb(device)}  # fmt: skip


# --- (b) the template: train.main, exactly what `python train.py` runs ---


def run_template(args) -> dict:
    times = record_step_times()
    import train

    with tempfile.TemporaryDirectory() as output_dir:
        train.main(training_config(args, output_dir))
    import torch

    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")) if args.device == "cuda" else None)
    return {**summarize(times, args.batch), "first_step_at": STARTED + (times[0] - START_PERF),
            "peak_memory_gb": peak_memory_gb(device)}  # fmt: skip


def child_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    result = run_raw(args) if args.child == "raw" else run_template(args)
    if int(os.environ.get("RANK", "0")) == 0:
        args.result.write_text(json.dumps(result))


# --- the parent: interleave rounds, summarize ---


def child_command(args, side: str, result: Path) -> list[str]:
    script = [str(Path(__file__).resolve()), "--child", side, "--result", str(result)]
    options = ["--model", args.model, "--steps", str(args.steps), "--batch", str(args.batch),
               "--processes", str(args.processes), "--device", args.device, "--threads", str(args.threads)]  # fmt: skip
    if args.processes == 1:
        return [sys.executable, *script, *options]
    if side == "raw":
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(args.processes)]
    else:
        launcher = ["-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs/ddp.yaml"),
                    "--num_processes", str(args.processes)]  # fmt: skip
    return [sys.executable, *launcher, *script, *options]


# glibc's malloc by default hands freed activations back to the OS and page-faults them in again on the next step:
# 400-1,100 faults per CNN step here, a count that differs from process to process and moves the speed of the same
# loop by up to 10% between runs. Both sides run with the same two allocator settings that stop the give-back, so
# the comparison sees the loops, not the allocator's luck. (Huge pages as well favoured the raw side: not used.)
STEADY_ALLOCATOR = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def run_side(args, side: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads),
               "GLIBC_TUNABLES": STEADY_ALLOCATOR}  # fmt: skip
        spawned = time.time()
        completed = subprocess.run(child_command(args, side, result), cwd=REPO, env=env, capture_output=True, text=True)
        if completed.returncode != 0:
            sys.exit(f"error: the {side} run failed:\n{completed.stderr[-3000:]}")
        measured = json.loads(result.read_text())
    measured["seconds_to_first_step"] = measured.pop("first_step_at") - spawned
    return measured


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return {}
    runs = {"raw": [], "template": []}
    for round_index in range(args.rounds):
        for side in runs:  # a b a b ...: each template run is compared with the raw run just before it
            runs[side].append(run_side(args, side))
        raw, template = runs["raw"][-1]["samples_per_s"], runs["template"][-1]["samples_per_s"]
        print(f"round {round_index + 1}/{args.rounds}: raw {raw:9.0f} samples/s, template {template:9.0f}, "
              f"ratio {template / raw:.3f}", flush=True)  # fmt: skip
    sides = {
        side: {
            "samples_per_s": spread([r["samples_per_s"] for r in results]),
            "seconds_to_first_step": spread([r["seconds_to_first_step"] for r in results]),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in results),
            "runs": results,  # one per round, in order: samples_per_s, optimiser steps timed, first step, memory
        }
        for side, results in runs.items()
    }
    round_ratios = [b["samples_per_s"] / a["samples_per_s"] for a, b in zip(runs["raw"], runs["template"], strict=True)]
    report = {
        "ratio": statistics.median(round_ratios),
        "round_ratios": round_ratios,
        "raw": sides["raw"],
        "template": sides["template"],
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "result", "output")},
    }
    startup_gap = sides["template"]["seconds_to_first_step"]["median"] - sides["raw"]["seconds_to_first_step"]["median"]
    print(f"ratio template/raw: {report['ratio']:.3f} (samples/s, median of {args.rounds} rounds); "
          f"startup: +{startup_gap:.2f} s to the first step")  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
