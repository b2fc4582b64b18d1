"""What a run imports: only what it uses. Some libraries import an optional package wherever installed, just to ask what
this run knows; `hidden` hides it then: transformers while evaluate is imported (src/metrics.py), deepspeed in
`Accelerator.prepare` and `unwrap_model` (the model save's too) unless the run is DeepSpeed, and datasets while
Accelerate shards a loader (src/features/fast_accelerator), mlflow while DeepSpeed is imported
(src/features/deepspeed)."""

import contextlib
import sys


@contextlib.contextmanager
def hidden(name: str):
    """Inside, `name` looks uninstalled (a None in sys.modules: find_spec None, ImportError) unless imported already."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None
    try:
        yield
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]
