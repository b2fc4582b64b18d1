"""The plan for a `transformers` causal LM (`--task language_modeling`; proven on a tiny Llama built from a config):
the model's own `config.base_model_tp_plan` (a Llama's: q/k/v_proj and gate/up_proj "colwise", o_proj and down_proj
"rowwise") applied with torch's ColwiseParallel / RowwiseParallel, so each tensor-parallel rank computes its own
attention heads (its share of the key/value heads too) and its share of the MLP's hidden units; a block costs two
all-reduces forward and two backward. The vocabulary is split too: the token embedding by rows (each rank looks up
its share of the vocabulary, the partial embeddings all-reduced) and the head by output (each rank's logits of its
share, all-gathered), so each process holds about 1/(dp x tp) of the model however large the vocabulary; a tied head
stays the embedding's parameter (both are split by vocabulary rows). The rest (the RMSNorms) is replicated on the
tensor-parallel ranks (plan.replicate_the_rest); FSDP2 then shards every parameter over the data-parallel ranks too.

transformers is imported by the model's own package only: this module never imports it, so the feature works in a
project without it (or without the hf feature)."""

import re
import sys

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from src.features.tensor_parallel.plan import replicate_the_rest

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}  # transformers' names -> torch's styles


def is_transformers_model(model) -> bool:
    """A `transformers` model (not one wrapped by PEFT's adapters): only possible once transformers is imported."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def planned_linears(model) -> dict[str, str]:
    """The base model's linears named by its config's plan (`layers.*.self_attn.q_proj`, "*" one name) -> style."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    names = [name for name, _ in model.base_model.named_modules()]
    found = {}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        found |= {name: style for name in names if regex.fullmatch(name)}
    return found


def check_plan(model, tp_size: int) -> str | None:
    """Why the model can't be split over `tp_size` ranks by its own plan, or None."""
    kind, config = type(model).__name__, model.config
    planned = planned_linears(model)
    if not planned:
        return f"{kind} has no tensor-parallel plan (its config's base_model_tp_plan); use accelerate_configs/fsdp.yaml"
    styles = sorted({style for style in planned.values() if style not in STYLES})
    if styles:
        return f"{kind}'s tensor-parallel plan uses {', '.join(styles)}; this feature applies colwise and rowwise only"
    modules = dict(model.base_model.named_modules())
    if any(not isinstance(modules[name], nn.Linear) for name in planned):
        return f"{kind}'s tensor-parallel plan splits modules that are not nn.Linear; this feature splits linears only"
    # A parameter beside the split linears (in their attention or MLP) would see only this rank's heads or hidden
    # units, and a replicated copy of it would train on a part: refused rather than trained wrongly.
    for parent in {name.rpartition(".")[0] for name in planned}:
        for name, _ in modules[parent].named_parameters():
            if f"{parent}.{name}".rpartition(".")[0] not in planned:
                return f"{kind}'s {parent}.{name} sits between the split linears but the plan does not split it"
    if not isinstance(model.get_input_embeddings(), nn.Embedding) or not isinstance(
        model.get_output_embeddings(), nn.Linear
    ):
        return f"{kind} has no nn.Embedding input and nn.Linear head for the plan to split by vocabulary"
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads is not None and heads % tp_size:
            return f"the model's {name} {heads} is not divisible by the tensor-parallel size {tp_size}"
    return None


def parallelize_transformers_model(model: nn.Module, tp_mesh) -> nn.Module:
    """The plan applied in place (check_plan first): the blocks' linears, the embedding and the head split over
    `tp_mesh`, the other parameters replicated on it."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embedding.weight
    styles = {name: STYLES[style]() for name, style in planned_linears(model).items()}
    parallelize_module(model.base_model, tp_mesh, styles)
    parallelize_module(embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate()))  # vocabulary rows: Shard(0)
    parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))  # the same rows, logits gathered
    if tied:  # both split the (vocabulary, hidden) weight by rows alike: one parameter again
        head.register_parameter("weight", embedding.weight)
    replicate_the_rest(model, tp_mesh)
    return model
