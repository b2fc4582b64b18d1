"""`--profile_steps N`: a torch.profiler trace of N training steps after 2 warm-up steps, one Chrome trace per process
in output_dir/profile/ (open it in chrome://tracing or https://ui.perfetto.dev)."""

import logging
from dataclasses import dataclass
from pathlib import Path

from src.errors import UsageError
from src.features import Feature

logger = logging.getLogger(__name__)


@dataclass
class ProfilerOptions:
    profile_steps: int = 0  # > 0: record a torch.profiler trace of that many steps to output_dir/profile/

    def __post_init__(self):
        if self.profile_steps < 0:
            raise UsageError(f"--profile_steps must be >= 0 (got {self.profile_steps})")


class StepProfiler(Feature):
    Options = ProfilerOptions
    profiler = None  # the running torch profiler, between on_start and the end of its schedule

    def on_start(self, accelerator, config, resumed: bool) -> None:
        steps = self.options(config).profile_steps
        self.profiler = None
        if not steps:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        trace_dir = Path(config.output_dir) / "profile"
        trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if accelerator.device.type == "cuda" else [])

        def save(profiler) -> None:
            path = trace_dir / f"trace_rank{accelerator.process_index}.json"
            profiler.export_chrome_trace(str(path))
            logger.info("profiler trace of %d steps written to %s", steps, path)

        self.steps_left = 2 + steps  # the schedule's: one step waited, one warm-up, then `steps` recorded
        schedule = schedule(wait=1, warmup=1, active=steps, repeat=1)
        self.profiler = profile(activities=activities, schedule=schedule, on_trace_ready=save)
        self.profiler.start()

    def on_step(self, accelerator, config, step: int) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        self.steps_left -= 1
        if self.steps_left == 0:  # the trace is written: stop before anything else is recorded
            self.stop()

    def on_end(self, accelerator, config, model_dir: Path) -> None:
        self.stop()  # a run shorter than the schedule: its trace so far

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None


FEATURE = StepProfiler()
