"""Evaluation metrics as `evaluate` modules. Names resolve to the local modules in src/evaluate_metrics/ first.

Every process computes the metric on the SAME gathered predictions (see `evaluate` in train.py), so
all processes agree on the result: no "4 accuracies on 4 GPUs".
"""

import sys
import uuid
from pathlib import Path

LOCAL_METRICS = Path(__file__).parent / "evaluate_metrics"


def load_metrics(names: list[str]):
    """One `evaluate` object computing all `names` (None if there are none); a name that isn't local is passed
    to `evaluate.load` as is."""
    if not names:
        return None
    evaluate = import_evaluate()

    # A fresh experiment id per load: processes on one machine never wait on each other's cache-file locks.
    # (keep_in_memory=True would avoid the files, but fails on Python 3.12.3: its fingerprint pickles pyarrow types.)
    experiment = uuid.uuid4().hex
    modules = []
    for name in names:
        local = LOCAL_METRICS / name
        modules.append(evaluate.load(str(local) if local.is_dir() else name, experiment_id=experiment))
    return evaluate.combine(modules)


def import_evaluate():
    """`import evaluate` without importing transformers (most of a second of CPU, docs/benchmark.md): evaluate
    imports it, if it can, only for its pipeline `evaluator`s, which metrics do not use. A None in sys.modules makes
    that optional import fail for the moment of the import; a task that uses transformers has loaded it already."""
    if "transformers" in sys.modules:
        import evaluate

        return evaluate
    import datasets  # noqa: F401  (first: it asks whether transformers is installed without importing it)

    sys.modules["transformers"] = None
    try:
        import evaluate
    finally:
        del sys.modules["transformers"]
    return evaluate
