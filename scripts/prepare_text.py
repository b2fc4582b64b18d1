"""Export the Python standard library's own source files as a text data set: real text every machine has offline.

    python scripts/prepare_text.py [--out data/stdlib] [--max_mb 8]     # --max_mb 0: every file, no cap

Reads the `.py` files under `sysconfig.get_paths()["stdlib"]` (test directories and site-packages skipped) and
writes `train.parquet` and `eval.parquet` with one row per file: `path` (relative to the stdlib) and `text`.
A file's split depends on its path only (a stable hash sends ~5% of files to eval), so it does not change with
--max_mb; the cap keeps files in a second, independent hash order until the size is reached. The content is
whatever this Python version ships, so the data set (not the recipe) differs between Python versions.
The output is git-ignored: it is rebuilt in seconds wherever it is needed.
"""

import argparse
import hashlib
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
EVAL_PERCENT = 5


def stable_hash(salt: str, path: str) -> int:
    """A hash of the path that is the same on every machine and run (unlike `hash()`, which is salted)."""
    return int.from_bytes(hashlib.sha256(f"{salt}:{path}".encode()).digest()[:8], "big")


def is_eval(path: str) -> bool:
    return stable_hash("split", path) % 100 < EVAL_PERCENT


def source_files(root: Path) -> list[str]:
    """The stdlib's .py files as sorted POSIX paths relative to `root`, without tests and installed packages."""
    return sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if not SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]) and path.is_file()
    )


def read_capped(root: Path, paths: list[str], max_bytes: int | None) -> tuple[dict[str, str], int]:
    """{path: text} for files taken in a stable pseudo-random order until `max_bytes`; files not UTF-8 skipped."""
    texts, total, skipped = {}, 0, 0
    for path in sorted(paths, key=lambda p: stable_hash("select", p)):
        data = (root / path).read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes:
            continue  # a smaller file later in the order may still fit
        try:
            texts[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        total += len(data)
    return texts, skipped


def write_split(path: Path, texts: dict[str, str]) -> None:
    names = sorted(texts)
    pq.write_table(pa.table({"path": names, "text": [texts[n] for n in names]}), path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/stdlib"))
    parser.add_argument("--max_mb", type=float, default=8.0, help="cap on the total size in MB (2**20 bytes); 0: none")
    args = parser.parse_args(argv)
    if args.max_mb < 0:
        parser.error(f"--max_mb must be >= 0 (got {args.max_mb})")

    root = Path(sysconfig.get_paths()["stdlib"])
    max_bytes = int(args.max_mb * 2**20) if args.max_mb else None
    texts, skipped = read_capped(root, source_files(root), max_bytes)
    splits = {"train": {}, "eval": {}}
    for path, text in texts.items():
        splits["eval" if is_eval(path) else "train"][path] = text

    args.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for name, split in splits.items():
        write_split(args.out / f"{name}.parquet", split)
        size = sum(len(t.encode()) for t in split.values()) / 2**20
        summary.append(f"{name} {len(split)} files {size:.2f} MB")
    total = sum(len(t.encode()) for t in texts.values()) / 2**20
    note = f", {skipped} non-UTF-8 skipped" if skipped else ""
    print(f"wrote {len(texts)} files ({total:.2f} MB) from {root} to {args.out}: {'; '.join(summary)}{note}")


if __name__ == "__main__":
    main()
