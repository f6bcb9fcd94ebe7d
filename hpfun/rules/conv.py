"""Convolution, its backward, and pooling-like ops over trailing spatial dims.

Spatial dims are whole everywhere here (a split one would need halo exchange). The other dims:
- pooling, upsampling, col2im and their backwards work on each (batch, channel) plane alone,
  so every leading dim may be split (all tensors alike); avg pools and upsampling are linear;
- convolution(x (N, C, ...), w (O, C/g, ...)) is a contraction over C and the kernel window:
  a split batch stays split; out-channels split in w give out-channels split in the output;
  in-channels split in x and w give Partial(sum) (the bias, added once, must be Partial too);
  with groups > 1, whole groups split together (x's C and w's dim 0, which leads with the
  groups in both weight layouts) keep the output split, each rank convolving its groups. A
  transposed weight is (C, O/g, ...): its channel dims swap.
"""

from __future__ import annotations

import attrs

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option


@attrs.frozen(kw_only=True)
class Pool(Rule):
    """Ops over the last `spatial` dims of their first input, plane by plane.

    `linear`: positions of tensors the op is linear in (avg pools, upsampling, col2im, and
    backwards in grad_output): one of them may be Partial with the others replicated.
    """

    spatial: int = 2
    linear: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def strategies(self, call: OpCall) -> list[Strategy]:
        lead = call.tensors[0].ndim - self.spatial
        n_in, n_out = len(call.tensors), len(call.outputs)
        per_axis = []
        for a in range(call.mesh.ndim):
            options = []
            for t in call.tensors:
                p = t.layout.placements[a]
                if isinstance(p, Shard) and p.dim < lead:
                    options.append(((p,) * n_in, (p,) * n_out))
                elif isinstance(p, Partial) and p.reduce in ("sum", "avg") and t.index in self.linear and \
                        (t.dtype.is_floating_point or t.dtype.is_complex):  # (an integer pool rounds each term)
                    options.append((tuple(p if u is t else R for u in call.tensors), (p,) * n_out))
            per_axis.append(options + [replicated_option(call)])
        return combine_axes(call, per_axis)


def _channel_dims(call: OpCall, transposed_arg: int) -> tuple[int, int]:
    """(in-channel dim, out-channel dim) of the weight."""
    return (0, 1) if call.arg(transposed_arg) else (1, 0)


def _local_groups(call: OpCall, strategy: Strategy, x_index: int, groups_arg: int) -> int:
    """groups on this rank: a split of x's channels with groups > 1 splits whole groups."""
    groups = call.arg(groups_arg)
    return groups // strategy.inputs[x_index].shard_factor(1) if groups > 1 else groups


def _groups_divide(call: OpCall, strategy: Strategy, x_index: int, groups_arg: int) -> bool:
    groups = call.arg(groups_arg)
    return groups == 1 or groups % strategy.inputs[x_index].shard_factor(1) == 0


@attrs.frozen(kw_only=True)
class Convolution(Rule):
    """convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, w = call.tensors[0], call.tensors[1]
        w_in, w_out = _channel_dims(call, 6)
        grouped, psum = call.arg(8) > 1, Partial("sum")
        per_axis = []
        for a in range(call.mesh.ndim):
            p, q = x.layout.placements[a], w.layout.placements[a]
            options = []
            if p == Shard(0):
                options.append(self._option(call, p, R, R, p))
            if grouped and (p == Shard(1) or q == Shard(0)):  # w's dim 0 leads with the groups
                options.append(self._option(call, Shard(1), Shard(0), Shard(0), Shard(1)))
            if not grouped and q == Shard(w_out):
                options.append(self._option(call, R, q, Shard(0), Shard(1)))
            if not grouped and (p == Shard(1) or q == Shard(w_in)):
                options.append(self._option(call, Shard(1), Shard(w_in), psum, psum))
            if isinstance(p, Partial) and p.reduce in ("sum", "avg"):  # linear in x, and in w, separately
                options.append(self._option(call, p, R, p, p))
            if isinstance(q, Partial) and q.reduce in ("sum", "avg"):
                options.append(self._option(call, R, q, q, q))
            per_axis.append(options + [replicated_option(call)])
        return [s for s in combine_axes(call, per_axis) if _groups_divide(call, s, 0, 8)]

    @staticmethod
    def _option(call: OpCall, x, w, bias, out):
        return (x, w, bias)[: len(call.tensors)], (out,)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        args = list(args)
        args[8] = _local_groups(call, strategy, 0, 8)
        return ctx.call(call.op, tuple(args), kwargs)


@attrs.frozen(kw_only=True)
class ConvolutionBackward(Rule):
    """convolution_backward(grad_out, x, w, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask) -> (grad_x, grad_w, grad_bias), each only if asked.

    The same splits as the forward, read backwards: a split batch leaves grad_w and grad_bias
    Partial(sum) (sums over the batch); split out-channels leave grad_x Partial(sum); split
    in-channels keep grad_x and grad_w split; a Partial grad_out gives Partial everything
    (every gradient is linear in it).
    """

    def strategies(self, call: OpCall) -> list[Strategy]:
        tensors = call.tensors
        w_in, w_out = _channel_dims(call, 7)
        grouped = call.arg(9) > 1
        psum = Partial("sum")
        per_axis = []
        for a in range(call.mesh.ndim):
            g, x, w = (t.layout.placements[a] for t in tensors)
            options = []
            if Shard(0) in (g, x):
                options.append(self._option(call, (Shard(0), Shard(0), R), (Shard(0), psum, psum)))
            if grouped and Shard(1) in (g, x):
                options.append(self._option(call, (Shard(1), Shard(1), Shard(0)), (Shard(1), Shard(0), Shard(0))))
            if not grouped and (g == Shard(1) or w == Shard(w_out)):
                options.append(self._option(call, (Shard(1), R, Shard(w_out)), (psum, Shard(w_out), Shard(0))))
            if not grouped and (x == Shard(1) or w == Shard(w_in)):
                options.append(self._option(call, (R, Shard(1), Shard(w_in)), (Shard(1), Shard(w_in), R)))
            if isinstance(g, Partial) and g.reduce in ("sum", "avg"):
                options.append(self._option(call, (g, R, R), (g, g, g)))
            per_axis.append(options + [replicated_option(call)])
        return [s for s in combine_axes(call, per_axis) if _groups_divide(call, s, 1, 9)]

    @staticmethod
    def _option(call: OpCall, ins, outs):
        mask = call.arg(10)
        return ins, tuple(o for o, wanted in zip(outs, mask, strict=True) if wanted)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        args = list(args)
        args[9] = _local_groups(call, strategy, 1, 9)
        if args[3] is not None and call.arg(10)[2]:  # bias_sizes: the local number of out-channels
            args[3] = [strategy.outputs[-1].local_shape((args[3][0],))[0]]
        return ctx.call(call.op, tuple(args), kwargs)
