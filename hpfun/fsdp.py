"""`shard(..., gather_params="dp")`: the FSDP / ZeRO-3 schedule, chosen by the user.

Parameters, gradients and optimizer state split over the data-parallel axis are ordinary specs
(`P("dp", None)`). Left to itself, propagation picks the cheapest plan for them, which at a
small batch is to move the activations (an all-to-all of the batch, a reduce-scatter of the
product) rather than the weights: cheaper in bytes, but not what scales, and not what the user
asked for. `gather_params` names the axes over which parameters are instead gathered where they
are used, FSDP's way:

- each use of a parameter by a matmul, an embedding, a norm, a broadcasting add (a bias)...
  reads a copy gathered over those axes just before it, freed after: one all-gather per use
  site, so the forward and the backward each gather (memory holds one gathered layer at a
  time, as FSDP frees the weight after the forward and gathers it again for the backward).
  Successive uses share one copy where nothing between them gathers another parameter (the
  last layer's forward and backward) or where what does recurs around them (the steps of an
  unrolled loop: an LSTM gathers once per pass, not per time step: `_share`);
  a backward that reads the parameter only for its shape (a norm's bias; a weight where no
  input gradient is made, as in a first layer) gets a zero stand-in and gathers nothing;
- a use by an elementwise op whose other operands have the parameter's shape (or are 0-d) —
  the optimizer update, weight decay, Adam's moments — keeps the shard: ZeRO's update runs on
  the shard, and the gradient, a Partial sum over the gather axes, is pinned to the shard's
  spec where the update first reads it (found through the casts and views between the backward
  and the update: torch's foreach AdamW on bfloat16 parameters reads each gradient through three
  float32 casts): one reduce-scatter per gradient, issued as soon as the
  backward has made it and bucketed only with gradients the same op makes (a norm's weight and
  bias), so the whole gradient is freed during the backward. With parameters replicated and the
  optimizer state split (ZeRO-1/2), nothing is gathered and the gradients are reduce-scattered
  onto the state's shard the same way, in buckets up to `bucket_bytes` (DeepSpeed's ZeRO-2
  buckets); the new parameters are gathered back by their out_specs.

Which inputs are parameters is read off the graph, not names: every input whose layout splits
it over a gather axis and that the program updates (an output computed from it elementwise, as
an optimizer's update is; optimizer state too, whose uses all keep the shard). A batch of data
split over the same axis is read, never updated: it is left to propagation (and so is a
parameter of a step that does not update it: a forward-only program). The pass rewrites
the captured global graph before propagation: each gathering use gets an `hpfun::constrain`
node pinning the input's spec minus the gather axes, placed right before the use (views between
the parameter and the use, `w.t()`, are cloned per use; dtype casts stay before the gather, as
FSDP gathers in the compute dtype). Each such node carries `node.meta["hpfun_fsdp"]`, the name
of the op using it: lowering gives every use its own gather (never shared with another use) and
tags its collective with that name; `hpfun.schedule` issues those gathers at most one use ahead
(FSDP's prefetch) and buckets them only with the gathers of the same use.
"""

from __future__ import annotations

import bisect
import operator

import torch

from hpfun.constrain import _constrain, _encode
from hpfun.errors import SpecError
from hpfun.layout import Layout, P
from hpfun.mesh import Mesh

aten = torch.ops.aten
prims = torch.ops.prims

META = "hpfun_fsdp"  # on a policy gather (the global graph's constrain node, the lowered collective): its use's name

# same-shape copies followed to the use; the gather goes after them (a cast to the compute dtype
# gathers fewer bytes, as FSDP's mixed precision does)
_CASTS = frozenset([aten._to_copy.default, aten.clone.default, prims.convert_element_type.default])
# ops that read only the shape (or copy) of their input: they keep the shard
_LIKE = frozenset([aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
                   aten.rand_like.default, aten.randn_like.default, aten.copy.default])
# backward ops that read an operand's values only for one of their outputs: op -> (position of
# its output_mask, {operand position: the output needing its values, or None: never (shape only)})
_SHAPE_ONLY = {
    aten.native_layer_norm_backward.default: (7, {5: 0, 6: None}),  # weight for grad_input; bias never
    aten.native_group_norm_backward.default: (9, {4: 0}),
    aten.native_batch_norm_backward.default: (9, {2: 0}),
    aten.convolution_backward.default: (10, {2: 0}),  # weight for grad_input
}


def gather_axes(mesh: Mesh, gather_params) -> tuple[str, ...]:
    """The `gather_params` option as a tuple of mesh axis names (empty: no policy), checked."""
    if gather_params is None or gather_params is False:
        return ()
    if gather_params is True:
        raise SpecError(f"gather_params=True does not say which axes parameters are split over: name them, e.g. "
                        f"gather_params={mesh.axis_names[0]!r} (the mesh has axes {list(mesh.axis_names)})",
                        headline="bad option")
    axes = (gather_params,) if isinstance(gather_params, str) else gather_params
    if not isinstance(axes, (tuple, list)) or not axes or not all(isinstance(a, str) for a in axes):
        raise SpecError(f"gather_params must be None (or False), a mesh axis name or a tuple of them, got {gather_params!r}",
                        headline="bad option")
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise SpecError(f"gather_params names {', '.join(map(repr, unknown))}, but the mesh {mesh} has axes "
                        f"{list(mesh.axis_names)}", headline="bad option")
    if len(set(axes)) != len(axes):
        raise SpecError(f"gather_params names an axis twice: {gather_params!r}", headline="bad option")
    return tuple(axes)


def gather_parameters(gm: torch.fx.GraphModule, mesh: Mesh, in_layouts: list[Layout], axes: tuple[str, ...],
                      graded: frozenset = frozenset()) -> int:
    """Rewrite the captured global graph so every gathering use of an input split over `axes`
    reads a copy pinned to its spec minus `axes` (an `hpfun::constrain` node right before the
    use); returns how many such copies were inserted. `graded`: the positions of the inputs that
    are parameters whose gradients the program writes, gathered even where it does not update
    them (a forward and backward whose optimizer steps after the call, or accumulates over calls)."""
    if not axes:
        return 0
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    wanted = {mesh.axis_index(a) for a in axes}
    inserted = 0
    updated: dict = {}  # input updated on its shard -> its spec
    for i, (node, layout) in enumerate(zip(placeholders, in_layouts, strict=True)):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or layout is None or layout.partial_axes:
            continue
        split = {a for d in range(val.ndim) for a in layout.shard_axes(d)}
        if not split & wanted or not (i in graded or _updated(node, val.numel())):
            continue
        updated[node] = P.from_layout(layout, val.ndim)
    inserted += rewrite_uses(graph, {param: _without(spec, axes) for param, spec in updated.items()})
    inserted += _pin_gradients(graph, updated, per_op=inserted > 0)
    if inserted:
        graph.lint()
        gm.recompile()
    return inserted


def _without(spec: P, axes: tuple[str, ...]) -> P:
    return P(*[tuple(a for a in spec.axes(d) if a not in axes) or None for d in range(len(spec.dims))])


def rewrite_uses(graph: torch.fx.Graph, specs: dict) -> int:
    """Give the gathering uses of each parameter in `specs` (param -> the spec it is gathered
    to) a gathered copy, shared by successive uses where `_share` says; returns how many copies."""
    uses = {param: _uses(graph, param, param.meta["val"].numel()) for param in specs}
    groups = _share(graph, {param: [consumer for consumer, _, _ in u] for param, u in uses.items()})
    return sum(_rewrite(graph, param, spec, uses[param], groups[param]) for param, spec in specs.items())


def _uses(graph: torch.fx.Graph, param: torch.fx.Node, numel: int) -> list:
    """The ops that read `param`'s values whole, each as (consumer, operand it reads, chain of
    views from `param` to that operand), in graph order; a use reading only its shape is handed a
    stand-in on the way (`_stand_in`)."""
    uses: list[tuple[torch.fx.Node, torch.fx.Node, list]] = []

    def walk(node, chain):
        for user in list(node.users):
            if _follows(user, node):
                walk(user, chain + [user])
            elif _shape_only(user, node):
                _stand_in(graph, user, node, chain)
            elif user.op == "call_function" and not _keeps_shard(user, node, numel):
                uses.append((user, node, chain))

    walk(param, [])
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(uses, key=lambda use: order[use[0]])


def _share(graph: torch.fx.Graph, consumers: dict) -> dict:
    """Which uses of each parameter read one gathered copy: param -> {consumer: its first
    consumer in the group}. Successive uses share a copy (it is held between them) when nothing
    between them is another parameter's use, or when every parameter used between them is used
    in a neighbouring gap too: the body of a loop unrolled by tracing (a recurrent layer's steps,
    a layer applied again) gathers once per pass, as FSDP gathers once per module call, where
    the forward and backward of distinct layers in between keep their own gathers."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    events = sorted((order[c], param) for param, cs in consumers.items() for c in set(cs))
    at = [pos for pos, _ in events]
    out = {}
    for param, cs in consumers.items():
        cs = sorted(set(cs), key=order.__getitem__)
        gaps = []  # the other parameters used between successive uses
        for a, b in zip(cs, cs[1:]):
            lo, hi = bisect.bisect_right(at, order[a]), bisect.bisect_left(at, order[b])
            gaps.append({q for _, q in events[lo:hi]} - {param})
        group = {}
        first = None
        for i, c in enumerate(cs):
            if i == 0 or not _joins(gaps, i - 1):
                first = c
            group[c] = first
        out[param] = group
    return out


def _joins(gaps: list, i: int) -> bool:
    """Whether the uses on either side of gap `i` share a copy (`_share`)."""
    around = set().union(*gaps[max(i - 1, 0):i], *gaps[i + 1:i + 2])
    return gaps[i] <= around


def _rewrite(graph: torch.fx.Graph, param: torch.fx.Node, spec: P, uses: list, group: dict) -> int:
    gathered: dict = {}  # (first consumer of the group, the casts before it) -> its constrain node
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = set()
    for consumer, operand, chain in uses:
        if (consumer, operand) in done:
            continue
        done.add((consumer, operand))
        k = 0
        while k < len(chain) and chain[k].target in _CASTS:
            k += 1
        base = chain[k - 1] if k else param
        # uses casting alike (autocast casts the weight again at every step of a loop) share the
        # copy gathered after the first one's casts
        casts = tuple((c.target, c.meta["val"].dtype) for c in chain[:k])
        first = group[consumer]
        if (first, casts) not in gathered and base is not param and order[base] > order[first]:
            first = consumer  # a cast made later: gathered at its use
        if (first, casts) not in gathered:
            with graph.inserting_before(first):
                pin = graph.create_node("call_function", _constrain, (base, _encode(spec)),
                                        name=f"gather_for_{first.name}")
            pin.meta.update(val=base.meta["val"], stack_trace=first.meta.get("stack_trace"))
            pin.meta[META] = first.name
            gathered[(first, casts)] = pin
        with graph.inserting_before(consumer):
            value = gathered[(first, casts)]
            for view in chain[k:]:
                copy = graph.node_copy(view, lambda a, v=view, prev=value: prev if a is v.args[0] else a)
                value = copy
        consumer.replace_input_with(operand, value)
    for view in reversed(list(dict.fromkeys(v for _, _, chain in uses for v in chain))):
        if not view.users:  # every use of it now reads its own copy
            graph.erase_node(view)
    return len(gathered)


def _shape_only(user: torch.fx.Node, operand: torch.fx.Node) -> bool:
    """Whether `user` reads `operand` only for its shape and dtype: a norm's bias in its backward,
    or a weight in a backward that makes no input gradient (a first layer's: the batch needs
    none). Such a use gathers nothing (FSDP gathers a parameter only where its values are read)."""
    entry = _SHAPE_ONLY.get(user.target)
    if entry is None or user.kwargs:
        return False
    mask_at, positions = entry
    mask = user.args[mask_at] if len(user.args) > mask_at else None
    places = [i for i, a in enumerate(user.args) if a is operand]
    return bool(places) and isinstance(mask, (list, tuple)) and all(
        i in positions and (positions[i] is None or not mask[positions[i]]) for i in places)


def _stand_in(graph: torch.fx.Graph, user: torch.fx.Node, operand: torch.fx.Node, chain: list) -> None:
    """Hand `user` a zero of `operand`'s shape and dtype, expanded from one element (no bytes, no
    gather), in place of `operand`; views and casts left unread are dropped."""
    val = operand.meta["val"]
    with graph.inserting_before(user):
        zero = graph.call_function(aten.zeros.default, ([],), {"dtype": val.dtype, "device": val.device})
        zero.meta.update(val=val.new_zeros(()), stack_trace=user.meta.get("stack_trace"))
        stand_in = graph.call_function(aten.expand.default, (zero, list(val.shape)))
        stand_in.meta.update(val=zero.meta["val"].expand(val.shape), stack_trace=user.meta.get("stack_trace"))
    user.replace_input_with(operand, stand_in)
    for view in reversed(chain):
        if view.users:
            break
        graph.erase_node(view)


def _pin_gradients(graph: torch.fx.Graph, updated: dict, per_op: bool) -> int:
    """Pin what the updates read from outside them (the gradient, made by the backward pass) to
    the updated input's spec: the Partial sum is reduce-scattered onto the shard, once per
    gradient. (Propagation alone resolves it to replicated, an all-reduce, and takes the rank's
    block after: a pointwise op offers the splits its inputs have, and a Partial input has none.)
    The update region is every value computed from an updated input by elementwise ops of its
    shape; a value entering it is traced back through elementwise ops of one operand
    (`0.1 * g`, `g * g`) to the value they all come from, and that value is pinned.

    With `per_op` (parameters are gathered: ZeRO-3) each pin is tagged with the op that made the
    gradient, so its reduce-scatter buckets only with that op's other gradients and the whole
    gradient is freed during the backward, as FSDP's per-unit reduce-scatter frees it; else
    (ZeRO-1/2) the reduce-scatters bucket as any collective, up to `bucket_bytes`."""
    region: dict = {}  # node -> the spec of the input it updates
    dtypes: dict = {}  # node -> that input's dtype (None where inputs of two dtypes meet)
    frontier = [(node, spec, node.meta["val"].dtype) for node, spec in updated.items()]
    while frontier:
        node, spec, dtype = frontier.pop()
        if node in region:
            if region[node] != spec:
                region[node] = None  # two inputs of different specs meet: pin nothing here
            if dtypes[node] != dtype:
                dtypes[node] = None
            continue
        region[node], dtypes[node] = spec, dtype
        numel = _numel(_shape(node))
        frontier += [(u, spec, dtype) for u in node.users if u.op == "call_function" and
                     (_keeps_shard(u, node, numel) or u.target in _CASTS and _shape(u) == _shape(node))]
    pins: dict = {}  # the value pinned -> spec
    memo: dict = {}
    for node, spec in region.items():
        if node.op != "call_function" or spec is None:
            continue
        for arg in node.all_input_nodes:
            if arg in region or _shape(arg) != _shape(node):
                continue
            root = _root(arg, region, memo, dtypes[node])
            if root.op != "call_function" or root in region:
                continue
            pins[root] = spec if pins.get(root, spec) == spec else None
    count = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for root, spec in pins.items():
        if spec is None:
            continue
        # right before the first use (the update, after the backward): the reduce-scatter is then
        # issued once the gradient exists and waited on only there
        with graph.inserting_before(min(root.users, key=order.__getitem__)):
            pin = graph.create_node("call_function", _constrain, (root, _encode(spec)), name=f"scatter_{root.name}")
        pin.meta.update(val=root.meta["val"], stack_trace=root.meta.get("stack_trace"))
        if per_op:  # bucketed only with the gradients the same op makes (a norm's weight and bias)
            producer = root
            while _passes(producer):  # the op under a view of its result
                producer = producer.args[0]
            producer = producer.args[0] if producer.target is operator.getitem else producer
            pin.meta[META] = f"gradients of {producer.name}"
        root.replace_all_uses_with(pin, delete_user_cb=lambda user, pin=pin: user is not pin)
        count += 1
    return count


def _root(node: torch.fx.Node, region: dict, memo: dict, dtype) -> torch.fx.Node:
    """The value `node` is computed from by elementwise ops of its shape whose operands all
    come from that one value (`0.01 * g * g`: g), through casts and views that keep the shape
    (`g.float()`, `g.view(g.shape)`, an alias), or `node` itself.

    An optimizer reading a bfloat16 gradient through several float32 casts of it (torch's
    foreach AdamW on bfloat16 parameters casts it once for `exp_avg`, twice for `exp_avg_sq`)
    has one root, the bfloat16 gradient, reduce-scattered once. A cast down to the parameter's
    dtype is passed too (an embedding's gradient summed in float32 and cast to bfloat16): a
    Partial sum does not pass a narrowing cast, so the pin goes before it, and the shard is cast.
    A cast widening into the parameter's `dtype` is not passed: float32 master weights computing
    in bfloat16 get the float32 cast of the bfloat16 gradient (autograd's), reduced as it is."""
    key = (node, dtype)
    if key in memo:
        return memo[key]
    memo[key] = node
    if node.op != "call_function" or node in region:
        return node
    target = node.target
    if _passes(node):
        source = node.args[0]
        val, before = node.meta["val"], source.meta["val"]
        widens_into = val.dtype == dtype and before.dtype.itemsize < val.dtype.itemsize
        if not widens_into:
            memo[key] = _root(source, region, memo, dtype)
    elif target in _PERMUTES:
        source = _unpermuted(node)
        if source is not None:
            memo[key] = _root(source, region, memo, dtype)
    elif isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        operands = [a for a in node.all_input_nodes if _shape(a) != ()]
        if operands and all(_shape(a) == _shape(node) for a in operands):
            roots = {_root(a, region, memo, dtype) for a in operands}
            if len(roots) == 1:
                memo[key] = roots.pop()
    return memo[key]


_PERMUTES = frozenset([aten.permute.default, aten.t.default, aten.transpose.int])


def _unpermuted(node: torch.fx.Node):
    """The nearest value `node` is, through a chain of transposes (and same-shape views) that
    compose to the identity, or None. Functionalization regenerates a gradient written in place
    (`clip_grad_norm_`'s `_foreach_mul_` on `p.grad`, a view of the backward's transposed matmul)
    as its base's transposes applied again: `w.grad.T.T` is `w.grad`'s values, and a
    reduce-scatter pinned there would come after the clip, which then reads the Partial whole."""
    order = list(range(len(_shape(node) or ())))  # node's dim i is source's dim order[i]
    source = node
    while True:
        target = source.target if source.op == "call_function" else None
        if target is aten.permute.default:
            order = [source.args[1][i] % len(order) for i in order]
        elif target is aten.transpose.int:
            a, b = (d % len(order) for d in source.args[1:3])
            swap = {a: b, b: a}
            order = [swap.get(i, i) for i in order]
        elif target is aten.t.default:
            order = [{0: 1, 1: 0}.get(i, i) if len(order) == 2 else i for i in order]
        elif not (target in _SAME and _passes(source)):
            return None
        source = source.args[0]
        if order == sorted(order) and _shape(source) == _shape(node):
            return source


# views that, at the same shape, are the same values (a gradient's alias, `g.view(g.shape)`)
_SAME = frozenset([aten.alias.default, aten.detach.default, aten.view.default, aten._unsafe_view.default,
                   aten.reshape.default, aten.expand.default, aten.lift_fresh.default])


def _passes(node: torch.fx.Node) -> bool:
    """A copy (a cast) or a view of its first argument with the same shape and values: a
    gradient's root is looked for through it."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.target not in _CASTS and node.target not in _SAME:
        return False
    val, source = node.meta.get("val"), node.args[0].meta.get("val")
    return isinstance(val, torch.Tensor) and isinstance(source, torch.Tensor) and val.shape == source.shape


def _updated(param: torch.fx.Node, numel: int) -> bool:
    """Whether the program updates `param`: an output is computed from it by elementwise ops
    of its shape (an optimizer's update, an in-place write functionalized). That is what tells a
    parameter (or optimizer state) from a batch of data split over the same axis."""
    seen, frontier = {param}, [param]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "output" and node is not param:  # returned as it came in: not updated
                return True
            if user not in seen and (_keeps_shard(user, node, numel) or
                                     user.target in _CASTS and _shape(user) == _shape(node)):
                seen.add(user)
                frontier.append(user)
    return False


def _follows(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """A view of `node`, or a same-shape copy of it (a cast): followed to the op that uses it."""
    if user.op != "call_function" or not user.args or user.args[0] is not node:
        return False
    if user.target in _CASTS:
        return _shape(user) == _shape(node)
    target = user.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view and isinstance(user.meta.get("val"), torch.Tensor)


def _keeps_shard(user: torch.fx.Node, operand: torch.fx.Node, numel: int) -> bool:
    """An elementwise op (or one reading only the shape) whose tensor operands all have the
    operand's shape or are 0-d, on the whole parameter: the update, weight decay, moments."""
    target = user.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target not in _LIKE and torch.Tag.pointwise not in target.tags:
        return False
    shape = _shape(operand)
    if shape is None or _numel(shape) != numel:
        return False
    tensors = [a for a in user.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    return all(_shape(a) == shape or _shape(a) == () for a in tensors) and _shape(user) == shape


def _shape(node: torch.fx.Node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
