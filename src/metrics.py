"""Evaluation metrics as `evaluate` modules. Names resolve to the local modules in src/evaluate_metrics/ first.

Every process computes the metric on the SAME gathered predictions (see `evaluate_model` in train.py), so
all processes agree on the result: no "4 accuracies on 4 GPUs".
"""

from pathlib import Path

LOCAL_METRICS = Path(__file__).parent / "evaluate_metrics"


def load_metrics(names: list[str]):
    """One `evaluate` object computing all `names` (None if there are none); a name that isn't local is passed
    to `evaluate.load` as is."""
    if not names:
        return None
    import evaluate

    modules = []
    for name in names:
        local = LOCAL_METRICS / name
        # keep_in_memory: processes on one machine must not share the metric's on-disk cache files
        modules.append(evaluate.load(str(local) if local.is_dir() else name, keep_in_memory=True))
    return evaluate.combine(modules)
