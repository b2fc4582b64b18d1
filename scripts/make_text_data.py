"""Make a small text-classification data set from the Python standard library's source: offline and deterministic.

    python scripts/make_text_data.py [--out data/text] [--train_size 3000] [--eval_size 401]

Writes `train.jsonl` and `eval.jsonl`, one row per source line: {"id": "<file>:<line>", "text": ..., "label": ...}
with the indentation stripped and one of three labels, which the start of the line decides, so a tiny model can
learn them: "comment" (a `#` comment), "def" (a `def`, `async def` or `class` statement) and "code" (any other
statement). Python's tokenizer finds the lines, so text inside strings and docstrings is never taken for code.
Lines of 3-200 characters only; each text appears once in the data set. The classes are balanced, the rows in a
stable pseudo-random order, and the split is by file (no file gives rows to both), with a stable hash of the path
choosing the eval files. The eval size defaults to 401, a prime, so that every process count shards it unevenly.
The content is whatever this Python version ships; the output is git-ignored and rebuilt in seconds.
"""

import argparse
import io
import json
import sys
import sysconfig
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.prepare_text import read_capped, source_files, stable_hash  # noqa: E402

LABELS = ("code", "comment", "def")
MIN_CHARS, MAX_CHARS = 3, 200
EVAL_PERCENT = 15  # of the files; eval needs far fewer rows, but enough of each label to choose from
SOURCE_MB = 4  # of stdlib source: thousands of candidate lines per label, tokenized in about a second
# Python 3.12+ splits f-strings (3.14+: t-strings too) into a start token, their content and fields, and an end one
STRING_STARTS = {getattr(tokenize, name, tokenize.STRING) for name in ("STRING", "FSTRING_START", "TSTRING_START")}
F_STRING_STARTS = STRING_STARTS - {tokenize.STRING}
F_STRING_ENDS = {getattr(tokenize, name) for name in ("FSTRING_END", "TSTRING_END") if hasattr(tokenize, name)}
SKIP_TOKENS = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def line_label(first: tokenize.TokenInfo, second: tokenize.TokenInfo | None) -> str | None:
    """A line's label from its first two tokens; None for a line that starts with a string: docstrings look like
    prose, not code."""
    if first.type == tokenize.COMMENT:
        return "comment"
    if first.type in STRING_STARTS:
        return None
    if first.string in ("def", "class") or (first.string == "async" and second is not None and second.string == "def"):
        return "def"
    return "code"


def line_starts(text: str) -> dict[int, list[tokenize.TokenInfo]]:
    """Line number -> the first two tokens of each line whose first non-blank character starts a token: this leaves
    out the inside and the end of multi-line strings, which the prefix of a line alone cannot tell."""
    starts, inside = {}, 0  # inside: f-string depth; its tokens are string content or fields, never a line's start
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        row, column = token.start
        if not inside and token.type not in SKIP_TOKENS:
            if row in starts:
                if len(starts[row]) == 1:
                    starts[row].append(token)
            elif not token.line[:column].strip():
                starts[row] = [token]
        inside += (token.type in F_STRING_STARTS) - (token.type in F_STRING_ENDS)
    return starts


def labelled_lines(path: str, text: str) -> list[tuple[str, str, str]]:
    """(id, text, label) for the lines of one file that have a label and 3-200 characters; none for a file that
    Python's tokenizer rejects."""
    try:
        starts = line_starts(text)
    except (tokenize.TokenError, SyntaxError):
        return []
    rows = []
    for number, tokens in starts.items():
        label = line_label(tokens[0], tokens[1] if len(tokens) > 1 else None)
        line = tokens[0].line.strip()
        if label is not None and MIN_CHARS <= len(line) <= MAX_CHARS:
            rows.append((f"{path}:{number}", line, label))
    return rows


def balanced_sample(rows: list[tuple[str, str, str]], size: int, split: str) -> list[dict]:
    """`size` rows, as equal a number per label as possible, chosen and ordered by a stable hash of their id."""
    per_label = {label: size // len(LABELS) + (i < size % len(LABELS)) for i, label in enumerate(LABELS)}
    chosen = []
    for label, count in per_label.items():
        candidates = sorted((row for row in rows if row[2] == label), key=lambda row: stable_hash("pick", row[0]))
        if len(candidates) < count:
            raise ValueError(f"{split}: {count} {label!r} rows wanted, only {len(candidates)} lines available")
        chosen += candidates[:count]
    chosen.sort(key=lambda row: stable_hash("order", row[0]))  # labels mixed, not in blocks
    return [{"id": id_, "text": text, "label": label} for id_, text, label in chosen]


def split_rows(texts: dict[str, str]) -> dict[str, list[tuple[str, str, str]]]:
    """Candidate rows per split, files split by a hash of their path; a text seen before (in train first) dropped,
    so no text is in the data set twice and eval never repeats a train line."""
    splits = {"train": [], "eval": []}
    for path in sorted(texts):
        splits["eval" if stable_hash("text-split", path) % 100 < EVAL_PERCENT else "train"].append(path)
    seen, rows = set(), {}
    for split, paths in splits.items():
        rows[split] = []
        for path in paths:
            for row in labelled_lines(path, texts[path]):
                if row[1] not in seen:
                    seen.add(row[1])
                    rows[split].append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/text"))
    parser.add_argument("--train_size", type=int, default=3000)
    parser.add_argument("--eval_size", type=int, default=401, help="rows in eval.jsonl (a prime by default)")
    args = parser.parse_args(argv)
    for name in ("train_size", "eval_size"):
        if getattr(args, name) < len(LABELS):
            parser.error(f"--{name} must be >= {len(LABELS)}, one row per label (got {getattr(args, name)})")

    root = Path(sysconfig.get_paths()["stdlib"])
    texts, _ = read_capped(root, source_files(root), SOURCE_MB * 2**20)
    candidates = split_rows(texts)
    sizes = {"train": args.train_size, "eval": args.eval_size}
    try:
        data = {split: balanced_sample(rows, sizes[split], split) for split, rows in candidates.items()}
    except ValueError as e:
        parser.error(f"{e}; ask for fewer rows")

    args.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for split, rows in data.items():
        write_jsonl(args.out / f"{split}.jsonl", rows)
        files = len({row["id"].rsplit(":", 1)[0] for row in rows})
        summary.append(f"{split} {len(rows)} rows from {files} files")
    print(f"wrote {'; '.join(summary)} ({', '.join(LABELS)}) from {root} to {args.out}")


if __name__ == "__main__":
    main()
