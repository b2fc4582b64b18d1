"""Hyperparameter search with Optuna, each trial a real `accelerate launch` of train.py.

    python scripts/sweep.py configs/sweep/digits.yaml --n_trials 20
    python scripts/sweep.py configs/sweep/digits.yaml --n_trials 20 --accelerate_config accelerate_configs/ddp.yaml \\
        -- --config configs/default.yaml --report_to wandb                  # after --: flags for every trial
    python scripts/sweep.py configs/sweep/digits.yaml --storage postgresql://user:pass@host/db   # several machines

The search space file (configs/sweep/digits.yaml is an example):

    metric: eval/accuracy          # the objective: the trial's last value of this key in its metrics.jsonl
    direction: maximize            # default: eval/loss, minimize
    fixed: {max_steps: 100}        # train.py fields (or task options) set for every trial
    parameters:                    # any TrainConfig field or task option
      learning_rate: {low: 1.0e-4, high: 3.0e-2, log: true}   # a float range, log scale
      warmup_steps: {low: 0, high: 40, step: 10}              # integers: an int range
      norm: {choices: [group, batch]}
    pruner: {MedianPruner: {n_warmup_steps: 30}}   # any optuna.pruners class and its arguments (default: median)
    sampler: {TPESampler: {seed: 0}}               # any optuna.samplers class and its arguments (default: TPE)

Trial n trains in <output_dir>/trial_<n> (its console output in trial_<n>.log), with `--run_group <study>` (the wandb
group) and `--run_name <study>-trial_<n>`. While it runs, each new value of the metric in its metrics.jsonl goes to
the pruner; a pruned trial's processes get SIGTERM at once (SIGKILL 15 s later), and it stops at a step boundary.
`kill` (SIGTERM) or Ctrl-C on the sweep stops its running trial too, marked failed.

The study lives in SQLite, <output_dir>/study.db, unless --storage names another database Optuna takes. --n_trials
counts the study's finished (complete or pruned) trials: run the same command again after a kill and it continues.
A trial a killed sweep left RUNNING is marked failed by Optuna's heartbeat once 30 s have passed (checked at each
trial's start and at the end). At the end: a markdown
table of the trials on stdout and <output_dir>/trials.png. Bad input: one `error:` line, exit code 2, nothing written.
"""

import argparse
import contextlib
import difflib
import json
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.launch import free_port  # noqa: E402
from src.errors import UsageError, command_line, one_line  # noqa: E402

POLL_SECONDS = 0.1  # how often a running trial's metrics.jsonl is read (a stat and a short read)
STOP_GRACE_SECONDS = 15  # after SIGTERM (train.py saves a checkpoint and exits 75), then SIGKILL
HEARTBEAT = 10  # seconds between a running trial's heartbeats in the study
RANGE_KEYS = {"low", "high", "log", "step"}


class TrialFailed(Exception):
    """The trial's train.py exited with an error: the trial is FAIL and the sweep goes on."""


@dataclass
class Space:
    path: Path
    metric: str
    direction: str
    fixed: dict
    distributions: dict  # name -> optuna distribution
    pruner: object
    sampler: object


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, train_args = parse_args(argv)
    optuna = import_optuna()
    space = load_space(args.space, train_args)
    study_name = args.study_name or args.space.stem
    output_dir = Path(args.output_dir or f"runs/sweeps/{study_name}")
    reserved = [arg for arg in train_args if arg.split("=")[0] == "--output_dir"]
    if reserved:
        raise UsageError(f"{reserved[0]}: the sweep sets each trial's output_dir; use the sweep's --output_dir")
    if args.accelerate_config:
        from scripts.launch import check_config_file

        problem = check_config_file(args.accelerate_config)
        if problem:
            raise UsageError(problem)

    url = args.storage or f"sqlite:///{output_dir / 'study.db'}"
    shown = storage_name(url)
    if not args.storage:
        output_dir.mkdir(parents=True, exist_ok=True)  # for study.db; all input is checked: from here on we write
    try:
        storage = optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT, grace_period=3 * HEARTBEAT)
    except Exception as err:  # sqlalchemy: no driver, no server, no access; each its own class
        raise UsageError(f"--storage {shown}: {one_line(err)[:300]}") from None
    output_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill`: stop the running trial too, as Ctrl-C does
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        direction=space.direction,
        sampler=space.sampler,
        pruner=space.pruner,
        load_if_exists=True,
    )
    finished_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=finished_states))
    print(f"study {study_name} in {shown}: {done} of {args.n_trials} trials finished", flush=True)
    if done < args.n_trials:
        study.optimize(
            lambda trial: objective(trial, space, args.accelerate_config, train_args, output_dir, study_name),
            n_trials=args.n_trials - done,  # failed trials use up this run's attempts: a restart tries again
            callbacks=[optuna.study.MaxTrialsCallback(args.n_trials, states=finished_states)],  # other workers'
            catch=(TrialFailed,),
        )
    optuna.storages.fail_stale_trials(study)  # what optimize does before each trial: also when none was left to run
    print(trials_table(study, space.metric))
    plot = plot_trials(study, space.metric, output_dir / "trials.png")
    if plot:
        print(f"plot: {plot}")


def storage_name(url: str) -> str:
    """The database URL as printed: without its password. A URL sqlalchemy can't parse is bad input."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        raise UsageError(
            f"--storage {url!r} is not a database URL; e.g. sqlite:///study.db, postgresql://host/db"
        ) from None


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The sweep's own flags; everything after `--` goes to every trial's train.py."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("space", type=Path, help="the search space YAML (see configs/sweep/digits.yaml)")
    parser.add_argument(
        "--n_trials", type=int, default=10, help="finished trials wanted in the study, all runs together"
    )
    parser.add_argument("--accelerate_config", help="accelerate config for every trial (default: accelerate's own)")
    parser.add_argument("--study_name", help="default: the search space file's name")
    parser.add_argument("--output_dir", help="default: runs/sweeps/<study_name>; trial n in <output_dir>/trial_<n>")
    parser.add_argument("--storage", help="an Optuna RDB URL; default: sqlite:///<output_dir>/study.db")
    args = parser.parse_args(argv[:split])
    if args.n_trials <= 0:
        raise UsageError(f"--n_trials must be > 0 (got {args.n_trials})")
    return args, argv[split + 1 :]


def import_optuna():
    try:
        import optuna
    except ImportError:
        raise UsageError("scripts/sweep.py needs optuna: pip install optuna") from None
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # one line per trial is ours (not a traceback per failure)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # the heartbeat
    return optuna


def load_space(path: Path, train_args: list[str]) -> Space:
    """Read and check the search space: every name a config field, every value one train.py accepts."""
    import optuna
    import yaml

    if not path.is_file():
        raise UsageError(f"search space {path} not found; see configs/sweep/digits.yaml for the format")
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UsageError(f"search space {path} is not valid YAML: {one_line(err)}") from None
    problem = lambda message: UsageError(f"search space {path}: {message}")  # noqa: E731
    keys = {"metric", "direction", "fixed", "parameters", "pruner", "sampler"}
    for key in spec if isinstance(spec, dict) else ():
        if key not in keys:
            raise problem(f"unknown key {key!r}{did_you_mean(key, keys)}; it holds {', '.join(sorted(keys))}")
    if not isinstance(spec, dict) or not isinstance(spec.get("parameters"), dict) or not spec["parameters"]:
        raise problem("needs `parameters:`, a mapping of config fields to {low, high} or {choices: [...]}")
    direction = spec.get("direction", "minimize")
    if direction not in ("maximize", "minimize"):
        raise problem(f"direction must be maximize or minimize (got {direction!r})")
    fixed = spec.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise problem("`fixed:` must map config fields to values")
    base = [*train_args, *flags(fixed)]
    known = config_fields(base)
    for name in [*fixed, *spec["parameters"]]:
        if name == "output_dir":
            raise problem("output_dir is set by the sweep (<output_dir>/trial_<n>); use the sweep's --output_dir")
        if name not in known:
            raise problem(f"unknown config field {name!r}{did_you_mean(name, known)}")
    check_train_args(base, f"search space {path}: fixed")
    distributions = {name: distribution(name, value, problem) for name, value in spec["parameters"].items()}
    for name, dist in distributions.items():  # each end of each range, each choice: one train.py accepts
        values = dist.choices if hasattr(dist, "choices") else (dist.low, dist.high)
        for value in values:
            check_train_args([*base, *flags({name: value})], f"search space {path}: {name}={value!r}")
    return Space(
        path=path,
        metric=spec.get("metric", "eval/loss"),
        direction=direction,
        fixed=fixed,
        distributions=distributions,
        pruner=optuna_object(optuna.pruners, spec.get("pruner", "MedianPruner"), problem),
        sampler=optuna_object(optuna.samplers, spec.get("sampler", "TPESampler"), problem),
    )


def distribution(name: str, spec, problem):
    """{choices: [...]} or {low, high, log?, step?} (ints if low, high and step are) -> an Optuna distribution."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if not isinstance(spec, dict) or not (set(spec) <= RANGE_KEYS or set(spec) == {"choices"}):
        raise problem(f"{name}: give {{low, high}} (optional log: true, step) or {{choices: [...]}} (got {spec!r})")
    try:
        if "choices" in spec:
            if not isinstance(spec["choices"], list) or not spec["choices"]:
                raise ValueError("choices must be a non-empty list")
            return CategoricalDistribution(spec["choices"])
        if "low" not in spec or "high" not in spec:
            raise ValueError("a range needs low and high")
        numbers = [spec["low"], spec["high"], spec.get("step") or 1]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in numbers):
            return IntDistribution(spec["low"], spec["high"], log=spec.get("log", False), step=spec.get("step") or 1)
        return FloatDistribution(
            float(spec["low"]), float(spec["high"]), log=spec.get("log", False), step=spec.get("step")
        )
    except (ValueError, TypeError) as err:
        raise problem(f"{name}: {err}") from None


def optuna_object(module, spec, problem):
    """`MedianPruner` or `{MedianPruner: {n_warmup_steps: 30}}` -> optuna.pruners.MedianPruner(n_warmup_steps=30)."""
    name, kwargs = next(iter(spec.items())) if isinstance(spec, dict) and len(spec) == 1 else (spec, {})
    names = [n for n in dir(module) if n[0].isupper() and not n.startswith("Base")]
    if not isinstance(name, str) or name not in names:
        raise problem(f"unknown {module.__name__} class {name!r}{did_you_mean(str(name), names)}; one of {names}")
    try:
        return getattr(module, name)(**(kwargs or {}))
    except (TypeError, ValueError) as err:
        raise problem(f"{name}: {err}") from None


def config_fields(train_args: list[str]) -> list[str]:
    """TrainConfig's fields and the options of the task the trials train (train.py's own way of finding it)."""
    from src.cli import find_task_name
    from src.config import TrainConfig
    from src.tasks import task_class

    task = task_class(find_task_name(train_args))
    return [f.name for f in fields(TrainConfig) if f.name != "task_args"] + [f.name for f in fields(task.Options)]


def check_train_args(train_args: list[str], where: str) -> None:
    from src.cli import parse_config

    try:
        parse_config(train_args)
    except UsageError as err:
        raise UsageError(f"{where}: {err}") from None


def did_you_mean(word: str, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def flags(values: dict) -> list[str]:
    """{name: value} -> ['--name=value'], the form a wandb agent passes too; lists and dicts as JSON."""

    def text(value) -> str:
        if isinstance(value, (bool, type(None), list, dict)):
            return json.dumps(value)
        return str(value)

    return [f"--{name}={text(value)}" for name, value in values.items()]


def launch_command(accelerate_config: str | None) -> list[str]:
    """`accelerate launch` as a module of this Python; each trial on a free port, so sweeps can share a machine."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
    return [*command, "--config_file", accelerate_config] if accelerate_config else command


def objective(trial, space: Space, accelerate_config, train_args: list[str], output_dir: Path, study: str) -> float:
    """Run one trial to its end (or until pruned); its value is the metric's last value in its metrics.jsonl."""
    import optuna

    params = {name: suggest(trial, name, dist) for name, dist in space.distributions.items()}
    trial_dir = output_dir / f"trial_{trial.number}"
    group = [] if any(arg.startswith("--run_group") for arg in train_args) else [f"--run_group={study}"]
    command = [
        *launch_command(accelerate_config),
        str(REPO / "train.py"),
        *train_args,
        *flags(space.fixed),
        f"--output_dir={trial_dir}",
        *group,
        f"--run_name={study}-trial_{trial.number}",
        *flags(params),
    ]
    trial.set_user_attr("output_dir", str(trial_dir))
    print(f"trial {trial.number}: {' '.join(flags(params))}", flush=True)
    started = time.monotonic()
    values = MetricValues(trial_dir / "metrics.jsonl", space.metric)
    with open(output_dir / f"trial_{trial.number}.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        while True:
            exited = process.poll() is not None  # read after an exit too: the last values
            for step, value in values.new():
                trial.report(value, step)
                if trial.should_prune():
                    stop(process)
                    print(f"trial {trial.number}: pruned at step {step}, {space.metric} {value:.4g}", flush=True)
                    raise optuna.TrialPruned(f"{space.metric} {value:.4g} at step {step}")
            if exited:
                break
            time.sleep(POLL_SECONDS)
    finally:
        stop(process)  # a no-op once it has exited; on Ctrl-C or an error in the sweep, no orphaned trainers
    seconds = time.monotonic() - started
    if process.returncode != 0:
        reason = last_error_line(output_dir / f"trial_{trial.number}.log")
        print(f"trial {trial.number}: failed, exit code {process.returncode}: {reason}", flush=True)
        raise TrialFailed(f"exit code {process.returncode}: {reason}")
    if values.last is None:
        raise never_logged(values, space.path)
    print(f"trial {trial.number}: {space.metric} {values.last:.4g} ({seconds:.0f} s)", flush=True)
    return values.last


def suggest(trial, name: str, dist):
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


def never_logged(values: "MetricValues", space_path: Path) -> UsageError:
    """The sweep's metric is not in a finished trial's metrics.jsonl: the error names the eval keys that are."""
    from src.best import closest_key

    logged = sorted(key for key in values.keys if key.startswith("eval/"))
    hint = f"did you mean {close}? " if (close := closest_key(values.key, logged)) else ""
    return UsageError(
        f"{values.key} is never logged in {values.path}; {hint}set `metric:` in {space_path} to an eval key it holds "
        f"({', '.join(logged) or 'eval/loss'})"
    )


class MetricValues:
    """The (step, value) pairs of one key that train.py has appended to metrics.jsonl since the last call."""

    def __init__(self, path: Path, key: str):
        self.path, self.key, self.offset, self.last = path, key, 0, None
        self.keys: set[str] = set()  # every key logged so far

    def new(self) -> list[tuple[int, float]]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            data = file.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next call
        self.offset += len(complete)
        rows = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.keys.update(key for row in rows for key in row)
        pairs = [(row["step"], float(row[self.key])) for row in rows if self.key in row]
        self.last = pairs[-1][1] if pairs else self.last
        return pairs


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the launcher and every process it started, SIGKILL to what is left after the grace period."""
    import psutil  # accelerate's own dependency

    if process.poll() is not None:
        return
    try:
        parent = psutil.Process(process.pid)
        processes = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for each in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            each.terminate()
    _, alive = psutil.wait_procs(processes, timeout=STOP_GRACE_SECONDS)
    for each in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            each.kill()
    process.wait()


def last_error_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1].strip()


def trials_table(study, metric: str) -> str:
    """Every trial of the study (any worker's), as a markdown table, and the best one."""
    names = sorted({name for trial in study.trials for name in trial.params})
    rows = [
        f"| trial | state | {metric} | last step | seconds | {' | '.join(names)} |",
        "| " + " | ".join(["---"] * (5 + len(names))) + " |",
    ]
    for trial in study.trials:
        value = trial.value if trial.value is not None else trial.intermediate_values.get(trial.last_step)
        seconds = (trial.datetime_complete - trial.datetime_start).total_seconds() if trial.datetime_complete else None
        cells = [
            trial.number,
            trial.state.name,
            value,
            trial.last_step,
            seconds,
            *(trial.params.get(name) for name in names),
        ]
        rows.append("| " + " | ".join(cell_text(cell) for cell in cells) + " |")
    try:
        best = study.best_trial
        rows.append(
            f"\nbest: trial {best.number}, {metric} {best.value:.4g}: {' '.join(flags(best.params))} "
            f"(run: {best.user_attrs.get('output_dir')})"
        )
    except ValueError:
        rows.append("\nno trial has finished yet")
    return "\n".join(rows)


def cell_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def plot_trials(study, metric: str, path: Path) -> Path | None:
    """Left: each trial's metric over its steps (pruned ones stop early). Right: each trial's value, best so far."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: pip install matplotlib", flush=True)
        return None
    from optuna.trial import TrialState

    fig, (curves, history) = plt.subplots(1, 2, figsize=(11, 4))
    for trial in study.trials:
        steps = sorted(trial.intermediate_values)
        pruned = trial.state == TrialState.PRUNED
        label = f"{trial.number} (pruned)" if pruned else str(trial.number)
        style = {"linestyle": "--", "color": "gray"} if pruned else {}
        curves.plot(steps, [trial.intermediate_values[s] for s in steps], label=label, **style)
    curves.set(xlabel="step", ylabel=metric, title="trials (dashed: pruned)")
    curves.legend(fontsize="small", ncol=2)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED and t.intermediate_values]
    history.plot([t.number for t in complete], [t.value for t in complete], "o", label="complete")
    history.plot(
        [t.number for t in pruned],
        [t.intermediate_values[t.last_step] for t in pruned],
        "x",
        color="gray",
        label="pruned (its last value)",
    )
    better = max if study.direction.name == "MAXIMIZE" else min
    best_so_far = [better(t.value for t in complete[: i + 1]) for i in range(len(complete))]
    history.step([t.number for t in complete], best_so_far, where="post", label="best so far")
    history.xaxis.get_major_locator().set_params(integer=True)
    history.set(xlabel="trial", ylabel=metric, title=f"study {study.study_name}")
    history.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    command_line(main)()
