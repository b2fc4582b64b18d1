"""What a run imports: only what it uses. Some libraries import an optional package wherever it is installed, just to
ask a question this run already knows the answer to; `hidden` makes such a package look uninstalled for that moment:
transformers while evaluate is imported (src/metrics.py), deepspeed in `Accelerator.prepare` and while a model is
saved unless the run is DeepSpeed (src/accelerator.py, src/final_model.py), datasets while Accelerate shards a data
loader (src/accelerator.py), mlflow while DeepSpeed is imported (src/features/deepspeed)."""

import contextlib
import sys


@contextlib.contextmanager
def hidden(name: str):
    """Inside, package `name` looks uninstalled: importlib's `find_spec` says None and `import name` raises ImportError
    (a None in sys.modules). A package that is imported already stays as it is."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None
    try:
        yield
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]
