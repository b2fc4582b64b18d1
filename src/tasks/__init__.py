"""Tasks: what is trained (data -> tensors, model, loss, eval outputs), selected by `--task`.

A task is a module with these functions (see digits.py, the default, tabular.py and causal_lm.py):

    build_datasets(config) -> (train Dataset, eval Dataset)
    build_model(config) -> nn.Module
    training_loss(model, batch) -> scalar loss, averaged over the batch
    eval_outputs(model, batch) -> dict of per-sample tensors: "loss" (summed over the sample's terms),
        "weight" (how many terms: 1 for a class label, the token count for text), and optionally
        "predictions" and "references" for the `evaluate` metrics named in its METRICS list

and optionally `derived_metrics(scores) -> dict` (e.g. perplexity from the loss) and
`tokens_per_sample(config) -> int` / `flops_per_token(model, config) -> float` for throughput and MFU.
A third task is one new module plus one config: `--task my_package.my_task` imports any module path.
"""

import importlib

from src.errors import UsageError

BUILT_IN = {"digits": "src.tasks.digits", "causal_lm": "src.tasks.causal_lm", "tabular": "src.tasks.tabular"}


def load_task(name: str):
    module = BUILT_IN.get(name, name)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):
            raise UsageError(f"unknown --task {name!r}; use one of {', '.join(BUILT_IN)} or a module path") from err
        raise
