"""Normalizations kept whole: layer norm, group norm, batch norm, and their backwards.

Each normalizes groups of elements by their own mean and variance, so a dim inside a group
must be whole and a dim that only indexes groups may be split:
- layer norm: the normalized (trailing) dims are whole, the leading dims may be split; the
  saved mean and rstd are split alike;
- group norm over (N, C, *): N may be split; C may be split in whole groups (the saved
  statistics, (N, group), then split on the group dim);
- batch norm over (N, C, *): C may be split (statistics are per channel); in training the
  batch statistics need every N and spatial element, so those dims are whole (capture
  decomposes training-mode batch norm into reductions instead, which a split batch turns
  into small all-reduces of per-channel sums); in eval it is per-channel affine, so any dim
  may be split.
Backwards: grad_input follows the forward's split; grad_weight and grad_bias are sums over
the split dims, hence Partial(sum); every gradient is linear in grad_out, so a Partial
grad_out gives Partial gradients.
"""

from __future__ import annotations

import attrs
import torch
from torch._prims_common import suggest_memory_format

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option


def _masked(outs: tuple, mask) -> tuple:
    """The outputs a backward computes: those its output_mask asks for."""
    return tuple(o for o, wanted in zip(outs, mask, strict=True) if wanted)


def _grad_out_partial(call: OpCall, a: int, mask) -> list:
    g = call.tensors[0].layout.placements[a]
    if not (isinstance(g, Partial) and g.reduce in ("sum", "avg")):
        return []
    return [((g,) + (R,) * (len(call.tensors) - 1), _masked((g, g, g), mask))]


@attrs.frozen(kw_only=True)
class LayerNorm(Rule):
    """native_layer_norm(x, normalized_shape, weight, bias, eps) -> (out, mean, rstd)."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x = call.tensors[0]
        lead = x.ndim - len(call.arg(1))
        per_axis = []
        for p in x.layout.placements:
            options = [replicated_option(call)]
            if isinstance(p, Shard) and p.dim < lead:
                options.insert(0, ((p,) + (R,) * (len(call.tensors) - 1), (p, p, p)))
            per_axis.append(options)
        return combine_axes(call, per_axis)


@attrs.frozen(kw_only=True)
class LayerNormBackward(Rule):
    """native_layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias,
    output_mask) -> (grad_x, grad_weight, grad_bias), each only if asked."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        lead, mask = call.tensors[1].ndim - len(call.arg(2)), call.arg(7)
        per_axis = []
        for a in range(call.mesh.ndim):
            options = _grad_out_partial(call, a, mask)
            placements = [t.layout.placements[a] for t in call.tensors[:4]]  # grad_out, x, mean, rstd
            for d in {p.dim for p in placements if isinstance(p, Shard) and p.dim < lead}:
                ins = (Shard(d),) * 4 + (R,) * (len(call.tensors) - 4)
                options.append((ins, _masked((Shard(d), Partial("sum"), Partial("sum")), mask)))
            per_axis.append(options + [replicated_option(call)])
        return combine_axes(call, per_axis)


def _group_norm_emit(ctx, call: OpCall, strategy: Strategy, args, kwargs, x_index: int, first: int, op=None):
    """Call with N, C and group made local (arguments first, first + 1 and first + 3)."""
    args = list(args)
    layout = strategy.inputs[x_index]
    args[first] //= layout.shard_factor(0)
    args[first + 1] //= layout.shard_factor(1)
    args[first + 3] //= layout.shard_factor(1)
    return ctx.call(op or call.op, tuple(args), kwargs)


def _group_norm_options(call: OpCall, a: int, outs_batch: tuple, outs_channel: tuple) -> list:
    """Per mesh axis: the (N, C, ...) tensors split on N (per-channel ones replicated), or on
    C in whole groups with the per-channel tensors split too ((N, group) statistics on dim 1)."""
    per_channel = [t.ndim == 1 for t in call.tensors]
    multi = {t.layout.placements[a] for t, c in zip(call.tensors, per_channel, strict=True) if not c}
    single = {t.layout.placements[a] for t, c in zip(call.tensors, per_channel, strict=True) if c}
    options = []
    if Shard(0) in multi:
        options.append((tuple(R if c else Shard(0) for c in per_channel), outs_batch))
    if Shard(1) in multi or Shard(0) in single:
        options.append((tuple(Shard(0) if c else Shard(1) for c in per_channel), outs_channel))
    return options


@attrs.frozen(kw_only=True)
class GroupNorm(Rule):
    """native_group_norm(x, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd).

    mean and rstd are (N, group): split on N, or on the group dim when C is split."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        per_axis = []
        for a in range(call.mesh.ndim):
            options = _group_norm_options(call, a, (Shard(0),) * 3, (Shard(1),) * 3)
            per_axis.append(options + [replicated_option(call)])
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        return _group_norm_emit(ctx, call, strategy, args, kwargs, 0, 3, op=group_norm)


@attrs.frozen(kw_only=True)
class GroupNormBackward(Rule):
    """native_group_norm_backward(grad_out, x, mean, rstd, weight, N, C, HxW, group,
    output_mask) -> (grad_x, grad_weight, grad_bias), each only if asked."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        mask, psum = call.arg(9), Partial("sum")
        per_axis = []
        for a in range(call.mesh.ndim):
            options = _grad_out_partial(call, a, mask)
            options += _group_norm_options(
                call, a, _masked((Shard(0), psum, psum), mask), _masked((Shard(1), Shard(0), Shard(0)), mask)
            )
            per_axis.append(options + [replicated_option(call)])
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        return _group_norm_emit(ctx, call, strategy, args, kwargs, 1, 5, op=group_norm_backward)


def _norm_format(x) -> torch.memory_format:
    """The memory format the CPU group norm kernels take `x` in: the one torch suggests for its
    strides, which the kernel checks it is contiguous in (channels-last where it is laid out so).
    (`is_contiguous(channels_last)` ignores a dim of size 1: a batch of one with channels-last-like
    strides passed it, and the kernel, asking for contiguous, failed.)"""
    return suggest_memory_format(x)


def group_norm(x, *args):
    """aten.native_group_norm of `x` laid out as the kernel requires (contiguous or channels-last;
    a copy only where it is neither). Eager hands it a value as its op made it; a rank's block
    may be a strided view of a whole one (a write at indices of a split dim ends in a slice)."""
    return torch.ops.aten.native_group_norm.default(x.contiguous(memory_format=_norm_format(x)), *args)


def group_norm_backward(grad_out, x, *args):
    """aten.native_group_norm_backward with `grad_out` in `x`'s memory format. The CPU kernel
    reads both with the strides of `x`'s format: a contiguous gradient of a channels-last input
    (which a per-shard program makes where a collective delivers one of them, contiguous, and a
    local op the other) gives garbage. Autograd hands the kernel matching formats; so does this."""
    fmt = _norm_format(x)
    return torch.ops.aten.native_group_norm_backward.default(
        grad_out.contiguous(memory_format=fmt), x.contiguous(memory_format=fmt), *args)


@attrs.frozen(kw_only=True)
class BatchNorm(Rule):
    """native_batch_norm and _native_batch_norm_legit*(x, weight, bias, [running_mean,
    running_var,] [training,] momentum, eps) -> (out, save_mean, save_invstd).

    `training_arg`: position of the training flag (None: always eval).
    """

    training_arg: int | None = None

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, n = call.tensors[0], len(call.tensors)
        training = self.training_arg is not None and call.arg(self.training_arg)
        per_axis = []
        for a in range(call.mesh.ndim):
            p, options = x.layout.placements[a], []
            if p == Shard(1) or any(t.layout.placements[a] == Shard(0) for t in call.tensors[1:]):
                options.append(((Shard(1),) + (Shard(0),) * (n - 1), (Shard(1), Shard(0), Shard(0))))
            if isinstance(p, Shard) and p.dim != 1 and not training:
                options.append(((p,) + (R,) * (n - 1), (p, R, R)))
            per_axis.append(options + [replicated_option(call)])
        return combine_axes(call, per_axis)
