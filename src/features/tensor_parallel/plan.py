"""The GPT's tensor-parallel plan (src/features/gpt/model.py): in each block the MLP's fc is split by output (column-
wise: each tensor-parallel rank computes its share of the hidden units) and its projection by input (row-wise: the
partial sums all-reduced); the attention's qkv and projection are both split by input, each rank computing its own
heads (TensorParallelAttention), so a block costs three all-reduces forward and three backward. The rest (the
embeddings, LayerNorms, the tied head) is replicated on the tensor-parallel ranks; FSDP2 then shards every parameter
over the data-parallel ranks too."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from src.features.gpt.model import GPT, CausalSelfAttention


class TensorParallelAttention(CausalSelfAttention):
    """GPT's attention over this rank's heads. qkv is split by input (row-wise), so every rank gets the whole [q|k|v]
    (one all-reduce) and takes its own heads' columns; its output projection is row-wise too, taking just those. Row-
    wise, not column-wise: qkv's rows pack q, k and v, so a column-wise rank would hold all of q and half of k, and the
    strided shard that gives [q_r; k_r; v_r] is one torch.distributed.checkpoint cannot save (overlapping chunks)."""

    def forward(self, x):
        batch, time, channels = x.shape
        qkv, rank, ranks = self.qkv(x), 0, 1
        if isinstance(qkv, DTensor):  # replicated on the tensor-parallel ranks
            rank, ranks = qkv.device_mesh.get_local_rank(), qkv.device_mesh.size()
            qkv = qkv.to_local(grad_placements=[Partial()])  # each rank's gradient is its heads': they sum to the whole
        width, head_dim = channels // ranks, channels // self.n_head
        q, k, v = (
            t[..., rank * width : (rank + 1) * width].view(batch, time, -1, head_dim).transpose(1, 2)
            for t in qkv.split(channels, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, width)))


BLOCK_PLAN = {  # each block's linears: the attention's row-wise (see above), the MLP's column- then row-wise
    "attn.qkv": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=False),
    "attn.proj": RowwiseParallel,
    "mlp.fc": ColwiseParallel,
    "mlp.proj": RowwiseParallel,
}


def check_divisible(model: GPT, tp_size: int) -> str | None:
    """Why the model can't be split over `tp_size` ranks, or None."""
    attention = model.blocks[0].attn
    if attention.n_head % tp_size:
        return f"--n_head {attention.n_head} is not divisible by the tensor-parallel size {tp_size}"
    return None


def parallelize_gpt(model: GPT, tp_mesh) -> GPT:
    """The plan applied in place: each block's linears split over `tp_mesh`, the other parameters replicated on it."""
    for block in model.blocks:
        block.attn.__class__ = TensorParallelAttention
        parallelize_module(block, tp_mesh, {name: style() for name, style in BLOCK_PLAN.items()})
    replicate_the_rest(model, tp_mesh)
    return model


def replicate_the_rest(model: nn.Module, tp_mesh) -> None:
    """Every parameter the plan left whole becomes a DTensor replicated on `tp_mesh` (tied ones stay one parameter: the
    head is the token embedding), its module taking and giving plain tensors. Accelerate's own pass (`_prepare_tp`)
    would do this too but re-registers each parameter by its first name only, untying the head."""
    replicated = {}
    for module in list(model.modules()):
        own = [(name, p) for name, p in module._parameters.items() if p is not None and not isinstance(p, DTensor)]
        for name, param in own:
            if id(param) not in replicated:
                local = DTensor.from_local(param.data, tp_mesh, [Replicate()], run_check=False)
                replicated[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            module.register_parameter(name, replicated[id(param)])
        if own:
            module.register_forward_pre_hook(lambda _, args: tuple(replicate(a, tp_mesh) for a in args))
            module.register_forward_hook(lambda _, args, output: output.to_local())


def replicate(value, mesh):
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        return value
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
