"""Write the shipped 8x8 digits (data/digits) as an image folder of PNGs, offline, for --task image_classification.

    python scripts/make_image_folder.py                          # data/digit_images/{train,eval}/<class>/<i>.png
    python scripts/make_image_folder.py --out my/images --max_per_split 200

Each split is a folder with one subfolder per class, named after the digit in words (`zero` ... `nine`, so the
label ids, which follow the names' sorted order, differ from the digits), holding grey 8x8 PNGs named by the row's
index in its split. That is the layout `datasets`' imagefolder builder labels by subfolder. The eval split has
359 images: a prime, so it shards unevenly on any process count. The result is the same on every run; it is
git-ignored and rebuilt in a second.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SPLITS = ("train", "eval")


def write_split(table, folder: Path, limit: int | None) -> int:
    """One PNG per row: 64 pixel values 0..16 -> an 8x8 grey image, 0..255."""
    from PIL import Image

    pixels, labels = table.column("pixels").to_pylist(), table.column("label").to_pylist()
    count = len(labels) if limit is None else min(limit, len(labels))
    for index in range(count):
        image = (np.asarray(pixels[index], dtype=np.uint16).reshape(8, 8) * 255 // 16).astype(np.uint8)
        path = folder / NAMES[labels[index]] / f"{index:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)  # uint8, 2-D: mode L
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits", type=Path, default=REPO / "data" / "digits", help="the digits' Parquet folder")
    parser.add_argument("--out", type=Path, default=Path("data/digit_images"), help="output folder")
    parser.add_argument("--max_per_split", type=int, help="at most this many images per split (default: all)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("PIL") is None:  # the Quickstart installs the core's requirements only
        print("error: writing PNGs needs Pillow: pip install -r requirements/images.txt", file=sys.stderr)
        sys.exit(2)
    if args.max_per_split is not None and args.max_per_split <= 0:
        parser.error(f"--max_per_split must be > 0 (got {args.max_per_split})")
    counts = {}
    for split in SPLITS:
        table = pq.read_table(args.digits / f"{split}.parquet")
        counts[split] = write_split(table, args.out / split, args.max_per_split)
    print(f"wrote {counts['train']} train and {counts['eval']} eval PNGs to {args.out}")


if __name__ == "__main__":
    main()
