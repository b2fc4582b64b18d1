"""Write a multi-shard text corpus for `--streaming`: the Python stdlib's source (as scripts/prepare_text.py reads it)
split into N Parquet shards of a `text` column, plus an eval file.

    python scripts/make_shards.py --out data/shards --num_shards 16 [--max_mb 8] [--copies 1]

Writes `train-00000-of-00016.parquet` ... and `eval.parquet` (the same ~5% of files as prepare_text.py, by a hash of
the path). Train files are dealt to the shards in a stable hash order, so shards hold similar amounts of text.
`--copies K` repeats the train text K times (each copy's rows with their own path): a K times larger corpus of
the same text, for measuring that streaming memory does not grow with the corpus. Rows are written in row groups
of 64, so a reader holds a few dozen documents at a time, not a whole shard.
"""

import argparse
import sys
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.prepare_text import is_eval, read_capped, source_files, stable_hash  # noqa: E402

ROW_GROUP = 64


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/shards"))
    parser.add_argument("--num_shards", type=int, default=16)
    parser.add_argument("--max_mb", type=float, default=8.0, help="cap on the text read, in MB (2**20 bytes); 0: none")
    parser.add_argument("--copies", type=int, default=1, help="repeat the train text this many times")
    args = parser.parse_args(argv)
    if args.num_shards < 1 or args.copies < 1 or args.max_mb < 0:
        parser.error("--num_shards and --copies must be >= 1, --max_mb >= 0")

    root = Path(sysconfig.get_paths()["stdlib"])
    texts, _ = read_capped(root, source_files(root), int(args.max_mb * 2**20) if args.max_mb else None)
    train = sorted((p for p in texts if not is_eval(p)), key=lambda p: stable_hash("shard", p))
    evals = sorted(p for p in texts if is_eval(p))
    shards = [{"path": [], "text": []} for _ in range(args.num_shards)]
    rows = [(f"{copy}/{path}", texts[path]) for copy in range(args.copies) for path in train]
    for i, (path, text) in enumerate(rows):
        shards[i % args.num_shards]["path"].append(path)
        shards[i % args.num_shards]["text"].append(text)

    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("train-*.parquet"):  # a previous corpus with another shard count
        old.unlink()
    for i, shard in enumerate(shards):
        pq.write_table(pa.table(shard), args.out / f"train-{i:05d}-of-{args.num_shards:05d}.parquet", ROW_GROUP)
    pq.write_table(pa.table({"path": evals, "text": [texts[p] for p in evals]}), args.out / "eval.parquet", ROW_GROUP)
    size = sum(len(text.encode()) for _, text in rows) / 2**20
    print(
        f"wrote {len(rows)} train documents ({size:.2f} MB) in {args.num_shards} shards and {len(evals)} eval "
        f"documents to {args.out}"
    )


if __name__ == "__main__":
    main()
