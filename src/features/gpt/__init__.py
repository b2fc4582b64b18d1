"""`--task causal_lm`: a GPT (nanoGPT-style) trained from scratch on text, e.g. the Python stdlib's source
(configs/lm.yaml, docs/lm.md)."""

from src.features import Feature


class GPT(Feature):
    tasks = {"causal_lm": "src.features.gpt.causal_lm.CausalLM"}


FEATURE = GPT()
