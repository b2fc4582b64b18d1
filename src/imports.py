"""What a run imports: only what it uses. Some libraries import an optional package wherever it is installed, just to
ask a question this run already knows the answer to; `hidden` makes such a package look uninstalled for that moment.

- evaluate imports transformers (~0.6 s of CPU, 30 MB) for its pipeline evaluators, which metrics never use
  (src/metrics.py).
- Accelerate's `unwrap_model` (inside `save_model` and `get_state_dict`) imports deepspeed (~1 s and ~55 MB: it brings
  mlflow) to test whether the model is a DeepSpeedEngine; a run that is not DeepSpeed has none (src/final_model.py).
"""

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
