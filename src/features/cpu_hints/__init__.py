"""Warnings, once per node at the start of a CPU run, for what makes it train slower than it could, each with its fix:
more processes than cores, and bf16 emulated on a CPU without bf16 instructions (docs/launching.md)."""

import os
from pathlib import Path

from src.errors import say
from src.features import Feature


class CPUHints(Feature):
    def check_launch(self, use_cpu: bool, config) -> None:
        """config None: scripts/launch.py's check before it starts the processes, which say it themselves; nothing to
        say of a run that trains nothing (--do_train false)."""
        if use_cpu and config is not None and config.do_train and os.environ.get("LOCAL_RANK", "0") == "0":
            for line in slow_cpu_setup(config):
                say(f"warning: {line}")


def slow_cpu_setup(config) -> list[str]:
    """What makes this CPU run train slower than it could, and the fix."""
    found = []
    processes, cores = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), usable_cores()
    if processes > cores:
        found.append(
            f"{processes} processes on {cores} CPU cores: they take turns, so this trains slower than {cores} "
            f"processes would; launch with --num_processes {cores} (the global batch stays the same)"
        )
    precision = config.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "bf16" and not cpu_has_bf16():
        found.append(
            "bf16 mixed precision on a CPU without bf16 instructions (AVX512-BF16, AMX): emulated, many times slower "
            "than float32 (docs/sharded.md); --mixed_precision no trains in float32"
        )
    return found


BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # /proc/cpuinfo's words for x86's AVX512-BF16 and AMX, Arm's BF16


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bf16 instructions; True where it can't be told (no /proc/cpuinfo: not Linux)."""
    try:
        return bool(BF16_FLAGS & set(cpuinfo.read_text().split()))
    except OSError:
        return True


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


FEATURE = CPUHints()
