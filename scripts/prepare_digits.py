"""Export scikit-learn's 8x8 handwritten digits to the Parquet files the default example trains on.

Run once; the output is committed under data/digits/, so neither scikit-learn nor this script is needed at
training time. The eval split has 359 images: a prime, so every process count shards it unevenly and the
metric-gathering code is always exercised on uneven shards.

    python scripts/prepare_digits.py [--out data/digits]
"""

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sklearn.datasets import load_digits

EVAL_SIZE = 359
SPLIT_SEED = 0


def write_split(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    pq.write_table(pa.table({"pixels": images.astype(np.uint8).tolist(), "label": labels.astype(np.int64)}), path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/digits"))
    args = parser.parse_args()

    digits = load_digits()  # 1,797 images, 64 pixels each with values 0..16
    order = np.random.default_rng(SPLIT_SEED).permutation(len(digits.target))
    eval_idx, train_idx = order[:EVAL_SIZE], order[EVAL_SIZE:]

    args.out.mkdir(parents=True, exist_ok=True)
    write_split(args.out / "train.parquet", digits.data[train_idx], digits.target[train_idx])
    write_split(args.out / "eval.parquet", digits.data[eval_idx], digits.target[eval_idx])
    print(f"wrote {len(train_idx)} train and {len(eval_idx)} eval images to {args.out}")
