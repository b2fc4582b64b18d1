"""Plot the metrics.jsonl of one or more training runs into one PNG, the runs overlaid in each panel.

    python scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] -o out.png [--label NAME ...]

Panels, x axis = optimizer step: train/loss, each numeric eval/* metric (except eval/num_samples), train/lr and
each throughput key (train/*_per_s, e.g. samples_per_s or tokens_per_s). Panels no run has data for are skipped.
Bad input prints one `error: ...` line to stderr and exits with code 2 without writing the image.
"""

import argparse
import json
import math
import sys
from pathlib import Path

NOT_PLOTTED = {"eval/num_samples"}
LINE_STYLES = ["-", "--", ":", "-."]  # so that runs with identical curves stay visible


class InputError(Exception):
    pass


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise InputError(f"{path} not found: pass a run directory that train.py wrote (its --output_dir)")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path} ({e}): check the file's permissions and encoding") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            raise InputError(f'{path} line {number} is not a JSON object with an integer "step": fix or delete it')
        rows.append(row)
    return rows


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of one key; a step logged twice (e.g. after a resume) keeps its last value."""
    by_step = {row["step"]: row[key] for row in rows if is_number(row.get(key))}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def panel_keys(runs: list[list[dict]]) -> list[str]:
    keys = sorted({k for rows in runs for row in rows for k, v in row.items() if k != "step" and is_number(v)})
    evals = [k for k in keys if k.startswith("eval/") and k not in NOT_PLOTTED]
    throughput = [k for k in keys if k.startswith("train/") and k.endswith("_per_s")]
    return [k for k in ["train/loss", *evals, "train/lr", *throughput] if k in keys]


def default_label(run_dir: Path, rows: list[dict]) -> str:
    world_size = next((row["setup/world_size"] for row in rows if "setup/world_size" in row), None)
    return run_dir.resolve().name + (f" ({world_size} proc)" if world_size is not None else "")


def plot(runs: list[list[dict]], labels: list[str], keys: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.4 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        for i, (rows, label) in enumerate(zip(runs, labels, strict=True)):
            steps, values = series(rows, key)
            if steps:
                marker = "o" if len(steps) <= 30 else None
                ax.plot(steps, values, f"C{i}", ls=LINE_STYLES[i % 4], marker=marker, ms=3, label=label)
        ax.set(title=key, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    fig.suptitle(" vs ".join(labels))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--label", action="append", default=[], help="legend name, once per RUN_DIR, in order")
    args = parser.parse_args(argv)
    try:
        if args.label and len(args.label) != len(args.run_dirs):
            raise InputError(f"{len(args.label)} --label for {len(args.run_dirs)} run dirs: give one per run or none")
        runs = [read_rows(d) for d in args.run_dirs]
        keys = panel_keys(runs)
        if not keys:
            raise InputError("no train/eval metrics in the given metrics.jsonl files: did the runs log any step?")
        labels = args.label or [default_label(d, rows) for d, rows in zip(args.run_dirs, runs, strict=True)]
        plot(runs, labels, keys, args.output)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {args.output} ({e.strerror}): choose a writable -o path", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
