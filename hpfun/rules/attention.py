"""Fused scaled-dot-product attention, forward and backward, kept whole.

The fused kernels (the CPU flash op; CUDA's flash, memory-efficient and cuDNN ops) compute
softmax(q k^T * scale + mask) v one query row at a time, never holding the B x H x T x S
scores. Which splits keep that local, per mesh axis:
- batch (dim 0) and heads (dim 1) of every tensor: each (batch, head) pair is its own
  attention. With grouped-query attention (fewer key/value heads than query heads) a head
  split serves whole groups because shards are even: query heads [i H/n, (i+1) H/n) read key
  heads [i Hkv/n, (i+1) Hkv/n).
- query rows (dim 2 of the query, the output, its gradient and the logsumexp), keys and
  values whole: each row is its own softmax. Only for the CPU op (CUDA's logsumexp may be
  padded along the rows, and its flash kernel takes no mask). The keys' and values' gradients
  are then sums over the rows: `Partial(sum)`. Causal attention split so (context
  parallelism with the keys gathered) runs with the causal mask written out for the rank's
  rows: the kernel's own counts rows from 0, and a shard's rows start later, at the offset its
  mesh coordinates give (a T/n x S mask per rank, in the query's dtype, 0 or -inf).
- a mask or bias follows the dim of (B, H, T, S) it has at full size, and is whole where it
  broadcasts.
- the backward is linear in the output's gradient: a `Partial(sum)` gradient (the rest
  replicated) gives `Partial(sum)` gradients.
Splitting the keys (dim 2 of k and v) needs the softmax across ranks (ring attention): no
strategy offers it, so propagation gathers the keys first and prices that.

With dropout the kernels draw from torch's generator, which no layout can reproduce: capture
takes the math path for an attention with dropout on every device (the CPU takes it anyway),
whose dropout hpfun draws; a fused kernel with dropout recorded all the same runs replicated.
"""

from __future__ import annotations

import math

import attrs
import torch

from hpfun.layout import Layout, Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, TensorArg, combine_axes, replicated_option

aten = torch.ops.aten

# What each argument or output name of the fused ops holds, as dims of (B, H, T, S)
_Q = ("query", "grad_out", "grad_out_", "out", "output", "grad_query")  # (B, Hq, T, E)
_KV = ("key", "value", "grad_key", "grad_value")  # (B, Hkv, S, E)
_LSE = ("logsumexp", "log_sumexp")  # (B, Hq, T)
_MASK = ("attn_mask", "attn_bias", "grad_attn_bias")  # broadcasts to (B, Hq, T, S)


def _role(name: str) -> str:
    for role, names in (("q", _Q), ("kv", _KV), ("lse", _LSE), ("mask", _MASK)):
        if name in names:
            return role
    return "other"  # random state, sequence offsets: replicated


@attrs.frozen(kw_only=True)
class Attention(Rule):
    """`_scaled_dot_product_*_attention*` forward or backward (see the module docstring).

    `rows`: the query rows may be split (keys whole); `dropout_arg`, `causal_arg`: positions of
    dropout_p and is_causal; `returns`: the outputs' names where the schema leaves them out."""

    rows: bool = False
    dropout_arg: int
    causal_arg: int
    returns: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # names of unnamed outputs

    def strategies(self, call: OpCall) -> list[Strategy]:
        ins, outs = self._roles(call)
        if outs is None or call.arg(self.dropout_arg, default=0.0):
            r = Layout.replicated(call.mesh)
            return [Strategy((r,) * len(call.tensors), (r,) * len(call.outputs))]
        splits = [self._split(call, ins, outs, 0), self._split(call, ins, outs, 1)]
        if self.rows and not (call.arg(self.causal_arg, default=False) and "mask" in ins):
            splits.append(self._rows(call, ins, outs))  # causal: `emit` writes the rank's mask
        per_axis = []
        for a in range(call.mesh.ndim):
            # a split some input already has on this axis (from replicated inputs, any split
            # would look cheaper to a greedy walk, which then pays to undo it downstream)
            options = [o for o in splits if any(isinstance(p, Shard) and t.layout.placements[a] == p
                                                for t, p in zip(call.tensors, o[0], strict=True))]
            options.append(self._linear(call, ins, outs, a))
            per_axis.append([*options, replicated_option(call)])
        return combine_axes(call, per_axis)

    def _roles(self, call: OpCall):
        """Each tensor input's and output's role, by its name in the op's schema."""
        schema = call.op._schema
        names = {}
        for i, a in enumerate(call.args):
            if isinstance(a, TensorArg):
                names[id(a)] = schema.arguments[i].name
        for name, a in call.kwargs.items():
            if isinstance(a, TensorArg):
                names[id(a)] = name
        ins = tuple(_role(names.get(id(t), "")) for t in call.tensors)
        returns = list(self.returns) or [r.name for r in schema.returns if str(r.type) == "Tensor"]
        # an optional gradient not asked for (efficient attention's bias) is no output at all
        outs = tuple(_role(n) for n in returns[:len(call.outputs)]) if len(returns) >= len(call.outputs) else None
        return ins, outs

    def _split(self, call: OpCall, ins, outs, dim: int):
        """Batch (dim 0) or heads (dim 1) split in every tensor that has it at full size."""
        full = _query_shape(call, ins)
        return (tuple(_follow(t.shape, r, dim, full) for t, r in zip(call.tensors, ins, strict=True)),
                tuple(_follow(o.shape, r, dim, full) for o, r in zip(call.outputs, outs, strict=True)))

    def _rows(self, call: OpCall, ins, outs):
        """Query rows split: keys and values whole, their gradients summed over the rows."""
        full = _query_shape(call, ins)

        def row(shape, role, output):
            if role in ("q", "lse"):
                return Shard(2)
            if role == "mask":
                d = len(shape) - 2
                return Shard(d) if d >= 0 and shape[d] == full[2] else R
            if role == "kv" and output:
                return Partial("sum")
            return R

        return (tuple(row(t.shape, r, False) for t, r in zip(call.tensors, ins, strict=True)),
                tuple(row(o.shape, r, True) for o, r in zip(call.outputs, outs, strict=True)))

    def _linear(self, call: OpCall, ins, outs, axis: int):
        """The backward from a Partial(sum) output gradient, everything else replicated."""
        grads = [i for i, (t, r) in enumerate(zip(call.tensors, ins, strict=True)) if r == "q"]
        if "lse" in outs or not grads:  # a forward
            return None
        g = call.tensors[grads[0]].layout.placements[axis]
        if g != Partial("sum"):
            return None
        return (tuple(g if i == grads[0] else R for i in range(len(call.tensors))),
                tuple(g if r in ("q", "kv", "mask") else R for r in outs))

    def emit(self, ctx, call: OpCall, strategy: Strategy, args: tuple, kwargs: dict):
        """The op on the local blocks; causal with the query rows split, with the causal mask of
        the rank's rows in place of `is_causal` (row i of the block at global offset o sees the
        keys j <= o + i, as the whole op's row o + i does)."""
        ins, _ = self._roles(call)
        q = call.tensors[ins.index("q")]
        layout = strategy.inputs[ins.index("q")]
        if not (call.arg(self.causal_arg, default=False) and layout.shard_axes(2)):
            return super().emit(ctx, call, strategy, args, kwargs)
        rows, keys = layout.local_shape(q.shape)[2], call.tensors[ins.index("kv")].shape[2]
        first = ctx.shard_offset(layout, q.shape, 2)
        index = ctx.call(aten.add.Tensor, (ctx.call(aten.arange.default, (rows,), ctx.made(torch.int64)), first))
        seen = ctx.call(aten.ge.Tensor, (ctx.call(aten.view.default, (index, [rows, 1])),
                                         ctx.call(aten.arange.default, (keys,), ctx.made(torch.int64))))
        zeros = ctx.call(aten.zeros.default, ([rows, keys],), ctx.made(q.dtype))
        mask = ctx.call(aten.masked_fill.Scalar, (zeros, ctx.call(aten.logical_not.default, (seen,)), -math.inf))
        args, kwargs = list(args), {**kwargs, "attn_mask": mask}
        if self.causal_arg < len(args):
            args[self.causal_arg] = False
        else:
            kwargs["is_causal"] = False
        return ctx.call(call.op, tuple(args), kwargs)

    def work(self, call: OpCall, strategy: Strategy) -> float:
        """Multiply-adds per rank: q k^T and p v forward; the backward recomputes q k^T and
        takes four more products of the same size."""
        ins, _ = self._roles(call)
        q = ins.index("q")
        kv = ins.index("kv")
        rows = strategy.inputs[q].local_shape(call.tensors[q].shape)
        keys = strategy.inputs[kv].local_shape(call.tensors[kv].shape)[2]
        return float((5 if "lse" in ins else 2) * math.prod(rows) * keys)


def _query_shape(call: OpCall, ins: tuple) -> tuple:
    """(B, Hq, T, E): the shape of the query (or the output's gradient, alike)."""
    return call.tensors[ins.index("q")].shape


def _follow(shape: tuple, role: str, dim: int, full: tuple):
    """Shard(dim of B, H) for a tensor of `role`, where it has that dim at full size."""
    if role in ("q", "kv", "lse"):
        return Shard(dim)
    if role == "mask":
        d = dim - (4 - len(shape))
        return Shard(d) if d >= 0 and shape[d] == full[dim] else R
    return R
