"""`shard`: the user-facing transform, its spec checks and its program cache."""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import dataclasses
import difflib
import functools
import gc
import hashlib
import inspect
import math
import operator
import re
import sys
import types
import weakref
import warnings

import attrs
import torch
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree

from hpfun import auto, fsdp, fuse, lift, log, verify, writeback
from hpfun.capture import (ON_META, TracingWarning, UnliftedTensor, clear_memoized, data_rebinds, same_value, stands_at, trace,
                           tracing, unguarded_draws, user_line)
from hpfun.capture import _at_user_line as capture_at_user_line
from hpfun.collectives import REDUCE_DTYPES
from hpfun.constrain import check_pins
from hpfun.errors import (
    CaptureError, ExecutionError, HpfunError, InternalError, Problem, ShardingError, SpecError, op_name, user_stacklevel,
)
from hpfun.explain import Lowered
from hpfun.fold import fold_contractions
from hpfun.layout import Layout, P, Replicate
from hpfun.exact import refine
from hpfun.execute import run
from hpfun.lower import Program, lower
from hpfun.mesh import Mesh
from hpfun.plan import CostModel, redistribute_seconds
from hpfun.propagate import propagate
from hpfun.rules import REGISTRY
from hpfun.runtime.distributed import VALUE_LINE, runtime_for
from hpfun.schedule import DEFAULT_BUCKET_BYTES
from hpfun.sharded import Sharded, rank_block, redistribute, signature, spent_error, unchecked  # redistribute: hpfun.api's name too
from hpfun.specs import (
    AUTO, Auto, WildcardWarning, bad_spec, broadcast_prefix, container_attributes, input_layouts, is_sharded,
    leaf_layout, leaf_paths, dataclass_items, match_patterns, misfit, only_wildcards, pattern_matches, register_container, register_containers_in,
    spec_tree_problems, specificity,
    split_scalars, tensor_layout, warn_kept_whole, warn_kept_whole_unless,
)
from hpfun.writeback import WriteBack


def shard(f=None, *, mesh: Mesh, in_specs, out_specs=None, state_specs=None, compile: bool = False,
          rng: str = "philox", fallback: str | None = None, reduce_dtype: str = "float32", registry=REGISTRY,
          cost_model: CostModel | None = None, solver: str = "greedy", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
          overlap: bool = True, gather_params=None, memory_budget: int | None = None, donate_state: bool = False,
          donate_argnums=(), auto_time_limit: float = auto.AUTO_TIME_LIMIT):
    """Make a global-view function run sharded over `mesh`.

    `in_specs` is a pytree prefix of the positional arguments (a `P` or None per leaf or
    subtree; None means replicated; a dict of name patterns for a dict argument); keyword
    arguments are bound to their positions first, and left-out parameters in_specs covers take
    their defaults. Keyword-only parameters (and **kwargs) have no spec: a tensor there is
    replicated, a `Sharded` value keeps its layout. `out_specs` likewise for the outputs, or None
    to keep the layouts hpfun chose. Arguments may be global tensors (split by the specs; NumPy
    arrays are read as tensors) or `Sharded` values; tensor outputs are `Sharded`, other outputs
    come back as they are.

    The function may read state it is not given: the parameters, buffers and gradients of
    modules it closes over or reads as globals, an optimizer's state, closed-over and global
    tensors. Each is lifted into an input, read at every call, replicated unless
    `state_specs` (a dict of name patterns, e.g. `{"layers.*.q_proj.weight": P("tp", None)}`)
    says otherwise; gradients and optimizer state follow their parameter. In-place updates
    (`p.add_`, `loss.backward()`, `opt.step()`, BatchNorm's running statistics) are written back
    when the call returns. Python values that decide the trace (a module's training flag, an
    optimizer's weight decay) are part of the cache key; what LR schedulers change (a
    torch.optim optimizer's learning rate, SGD's momentum, Adam's betas: `lift.LIFTED_SCALARS`)
    is an input read at every call; other Python scalars among the arguments are baked into the
    program.

    `compile=True` hands the per-shard program to `torch.compile` (inductor). Random ops draw
    from a counter-based generator whose values do not depend on the mesh or layouts
    (`rng="philox"`); `rng="native"` uses torch's generator per block instead: faster, but
    the values change with the layout. Ops without a sharding rule are an error listing them all,
    unless `fallback="replicate"`: they then run on gathered inputs, with a warning naming each
    op and the bytes it costs.

    Sums of bfloat16 or float16 partial values across ranks (the all-reduce or reduce-scatter that
    resolves a Partial(sum) or Partial(avg) value) are reduced in float32, each rank's partial cast
    up and the result cast back, as FSDP's `reduce_dtype` does (`reduce_dtype="float32"`, twice
    the bytes on the wire); `reduce_dtype="compute"` reduces them in the compute dtype. `lower()`
    shows the dtype each collective moves.

    `registry` is the table of sharding rules propagation looks each op up in: by default the
    built-in `hpfun.rules.REGISTRY` (with what `HPFUN_RULES_PATH`, `hpfun.rules.load` and
    `hpfun.rules.register` added); another `hpfun.rules.registry.Registry`, or any object with
    `lookup(op) -> Rule | None`, tries rules without touching the built-in one. It keys the
    program cache by identity.

    Propagation chooses every op's strategy by one price, in seconds: per collective alpha plus
    its wire bytes over beta (per mesh axis), plus each rank's local work at `flops` per second,
    as `cost_model` (an `hpfun.plan.CostModel`) sets them; `lower().cost()` reports the chosen
    plan under the same model. `solver="greedy"` (the default) walks the graph in order with a
    minimum cut for Partial sums and look-ahead rounds; `solver="exact"` then improves on that by
    an integer program over every op's candidate strategies at once (HiGHS): slower to compile,
    never a dearer plan (the two plans are compared lowered, counting what their buckets save).

    Small collectives of one kind over the same mesh axes that are ready at about the same point
    (data parallel gradients) are fused into flat buffers of at most `bucket_bytes` (25 MiB by
    default, as DDP's buckets; 0 turns bucketing off). With `overlap=True` (the default) each
    collective is issued as soon as its input exists and waited on just before its first use, so
    compute runs while it travels; `lower()` shows the buckets and the issue and wait points.

    `gather_params` (a mesh axis name or a tuple of them; None by default) asks for FSDP's
    schedule (ZeRO-3) over those axes: an input split over them (a parameter) is all-gathered
    just before each use by a matmul, an embedding, a norm or a broadcasting op, once in the
    forward and again in the backward, and freed after; elementwise uses with its own shape
    (the optimizer update) keep the shard, so its gradient is reduce-scattered onto it. The
    gathers are issued one use ahead (prefetch) and bucketed only with those of the same use
    (`hpfun.fsdp`). Without it, propagation picks the cheapest plan, which may move
    activations instead.

    Any spec leaf (in `in_specs`, `state_specs` or `out_specs`) may be `hpfun.AUTO`: the planner
    then chooses that layout with every op's strategy, in one integer program (`hpfun.auto`),
    for the least step time, holding at most `memory_budget` bytes per rank (an int; None: no
    limit) in the lowered program, or raises an error naming the budget that would fit. With
    `gather_params`, an AUTO parameter the step updates is gathered per use over those axes in
    whatever layout is chosen for it (FSDP's schedule when it is split over them). The
    gradient, optimizer state and update of an AUTO lifted tensor take its layout; an AUTO
    output that mirrors an AUTO argument (same structure, shapes and dtypes: `return
    new_params, loss`) comes back in that argument's layout (with out_specs=None an output
    comes back as the plan leaves it, and a next call given it plans again for that layout);
    leaves of repeated layers (`layers.0.wq`, `layers.1.wq`) get the same layout. `lower()`
    lists what was chosen; `lower().auto.explain()` adds each choice's runner-up. AUTO's
    integer programs take at most `auto_time_limit` seconds per compile, all together: past
    it, a plan found that fits is used (the report says whether it was proven the cheapest),
    and otherwise the error says what the last plan found needs.

    `donate_state=True` hands the lifted state a call updates (parameters, gradients, optimizer
    state: what eager would change in place) over to the program on a distributed mesh: each
    block is released when its last use has run, instead of living beside its new value until
    the call returns, as an in-place optimizer step frees it. The memory estimate counts it so.
    Lifted state only is donated (an argument's tensor belongs to the caller), and nothing is
    freed on a simulated mesh (state is written back whole) or with `compile=True`. If the
    call fails after starting, the donated state is lost: each tensor keeps its shape, its
    values are undefined, and the next call says so until new values are loaded into it.

    `donate_argnums` (an int or a tuple of them) does the same for positional arguments, as
    `jax.jit`'s does: a `Sharded` value passed there (the previous step's new parameters and
    optimizer state, handed back) is consumed by the call. Its shards are released to the
    program, which frees each after its last use on a distributed mesh, and the value itself
    is spent: reading it again (`.full()`, another call) is an error. A global tensor there is
    the caller's and is left alone. The memory estimate counts those inputs as freed.

    >>> import hpfun, torch
    >>> mesh = hpfun.Mesh.simulated((2,), ("dp",))
    >>> f = hpfun.shard(lambda x: (x * 2).sum(0), mesh=mesh, in_specs=(hpfun.P("dp"),), out_specs=hpfun.P())
    >>> f(torch.arange(4.0)).full()
    tensor(12.)
    """
    if f is None:
        return functools.partial(shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs, state_specs=state_specs,
                                 compile=compile, rng=rng, fallback=fallback, reduce_dtype=reduce_dtype,
                                 registry=registry, cost_model=cost_model, solver=solver, bucket_bytes=bucket_bytes,
                                 overlap=overlap, gather_params=gather_params, memory_budget=memory_budget,
                                 donate_state=donate_state, donate_argnums=donate_argnums,
                                 auto_time_limit=auto_time_limit)
    if not isinstance(mesh, Mesh):
        raise SpecError(f"mesh must be an hpfun.Mesh, got {type(mesh).__name__}", headline="bad mesh")
    if rng not in ("philox", "native"):
        raise SpecError(f"rng must be 'philox' or 'native', got {rng!r}", headline="bad option")
    if fallback not in (None, "replicate"):
        raise SpecError(f"fallback must be None or 'replicate', got {fallback!r}", headline="bad option")
    if not isinstance(reduce_dtype, str) or reduce_dtype not in REDUCE_DTYPES:
        raise SpecError(f"reduce_dtype must be 'float32' (reduce bfloat16/float16 partial sums in float32) or "
                        f"'compute' (in the program's dtype), got {reduce_dtype!r}", headline="bad option")
    if not callable(getattr(registry, "lookup", None)):
        raise SpecError(f"registry must be a rule registry (an hpfun.rules.registry.Registry, or an object with "
                        f"lookup(op)), got {type(registry).__name__}", headline="bad option")
    if state_specs is not None and not isinstance(state_specs, dict):
        hint = (f"; call it on the model: state_specs={state_specs.__name__}(model)"
                if callable(state_specs) and getattr(state_specs, "__name__", "") == "tp_plan" else "")
        raise SpecError(f"state_specs must be a dict of name patterns to P specs, got {type(state_specs).__name__}"
                        f"{hint}", headline="bad sharding spec")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise SpecError(f"cost_model must be an hpfun.plan.CostModel, got {type(cost_model).__name__}",
                        headline="bad option")
    if cost_model is not None and isinstance(mesh, Mesh) and (unknown := cost_model.unknown_axes(mesh)):
        raise SpecError(f"cost_model's per_axis names {', '.join(map(repr, unknown))}, which the mesh {mesh} has no axis "
                        f"of: name its axes {mesh.axis_names}", headline="bad option")
    if solver not in ("greedy", "exact"):
        raise SpecError(f"solver must be 'greedy' or 'exact', got {solver!r}", headline="bad option")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise SpecError(f"bucket_bytes must be an int >= 0 (0: no bucketing), got {bucket_bytes!r}", headline="bad option")
    if not isinstance(compile, bool):  # compile="no" would read as True
        raise SpecError(f"compile must be True or False, got {compile!r}", headline="bad option")
    if not isinstance(overlap, bool):  # overlap="no" would read as True
        raise SpecError(f"overlap must be True or False, got {overlap!r}", headline="bad option")
    if not isinstance(donate_state, bool):
        raise SpecError(f"donate_state must be True or False, got {donate_state!r}", headline="bad option")
    argnums = (donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums
    if not isinstance(argnums, (tuple, list)) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                    for i in argnums):
        raise SpecError(f"donate_argnums must be an int >= 0 or a tuple of them (positions of the arguments the "
                        f"call consumes), got {donate_argnums!r}", headline="bad option")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                      or memory_budget <= 0):
        raise SpecError(f"memory_budget must be None or an int > 0 (bytes per rank, e.g. 8 << 30), got "
                        f"{memory_budget!r}", headline="bad option")
    if isinstance(auto_time_limit, bool) or not isinstance(auto_time_limit, (int, float)) or \
            not 0 < auto_time_limit < math.inf:
        raise SpecError(f"auto_time_limit must be a number of seconds > 0, got {auto_time_limit!r}",
                        headline="bad option")
    options = Options(compile=bool(compile), rng=rng, fallback=fallback, reduce_dtype=reduce_dtype, registry=registry,
                      cost_model=cost_model or CostModel(), solver=solver, bucket_bytes=bucket_bytes,
                      overlap=bool(overlap), gather_params=fsdp.gather_axes(mesh, gather_params),
                      memory_budget=memory_budget, donate_state=donate_state,
                      donate_argnums=tuple(sorted(set(argnums))), auto_time_limit=float(auto_time_limit))
    return ShardedFunction(f, mesh, in_specs, out_specs, options, state_specs=state_specs)


@attrs.frozen
class Options:
    """Compile options; part of the cache key."""

    compile: bool = False
    rng: str = "philox"
    fallback: str | None = None
    reduce_dtype: str = "float32"  # the dtype bfloat16/float16 partial sums are reduced in: "float32" or "compute"
    # the rules propagation looks ops up in; compared by identity (and left out of the hash):
    # two registries with the same rules today may differ tomorrow
    registry: object = attrs.field(default=REGISTRY, eq=attrs.cmp_using(eq=operator.is_), hash=False)
    cost_model: CostModel = attrs.field(factory=CostModel)  # compared by value: another model plans anew
    solver: str = "greedy"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # cap of a fused collective's buffer; 0: no bucketing
    overlap: bool = True  # issue collectives once their input exists, wait at first use
    gather_params: tuple = ()  # mesh axes parameters are gathered over at each use (FSDP); () none
    memory_budget: int | None = None  # bytes per rank the AUTO layouts must fit in (hpfun.auto)
    donate_state: bool = False  # lifted state the call updates is released to the program (freed at its last use)
    donate_argnums: tuple = ()  # positional arguments the call consumes: their Sharded values' shards are released
    auto_time_limit: float = auto.AUTO_TIME_LIMIT  # seconds AUTO's MILPs may take per compile, together


@attrs.frozen
class _Leaf:
    """What the cache key records of one input leaf (an argument's or a lifted tensor's)."""

    kind: str  # "tensor" (a global tensor or a Sharded value: same program) or "static"
    shape: tuple | None = None
    dtype: torch.dtype | None = None
    layout: Layout | None = None
    value: object = None
    device: torch.device | None = None  # where the program runs; tensors it creates go there
    requires_grad: bool = False  # a lifted parameter: autograd fills its .grad
    strides: tuple | None = None  # a tensor that is not contiguous: its strides, traced with it
    exact: object = None  # a static's `lift.exact_key`: its type and a zero's sign too

    def describe(self) -> str:
        if self.kind == "static":
            return _canonical_repr(self.value)  # (a frozenset's order is each process's own)
        return f"{str(self.dtype).replace('torch.', '')}{list(self.shape)} {self.layout.placements_str()}"


class _Call:
    """One call's inputs: positional and keyword-only arguments, lifted state, and their leaves;
    `key` is the cheap cache key of a cache hit (None where the inputs hold a pytree node type
    other than tuple, list and dict, or a NumPy array), and the pytree spec is built only on a
    miss."""

    __slots__ = ("args", "kwonly", "state", "lifted", "flat", "key", "_tree", "given")

    def __init__(self, args: tuple, kwonly: dict, state: lift.State, lifted: dict, flat: list, key, tree=None,
                 given=None):
        self.args, self.kwonly, self.state = args, kwonly, state
        self.lifted = lifted  # name -> tensor or Sharded value (a block a distributed call left)
        self.flat, self.key, self._tree = flat, key, tree
        self.given = given  # the caller's (args, kwonly) where NumPy arrays were read into new containers

    @property
    def tree(self):
        if self._tree is None:
            self._tree = pytree.tree_flatten(self.inputs, is_leaf=is_sharded)[1]
        return self._tree

    @property
    def inputs(self):
        return (self.args, self.kwonly, self.lifted)

    def paths(self) -> list[str]:
        return input_paths(self.inputs)


def input_paths(inputs) -> list[str]:
    """Every input leaf's path: "args[0]['w1']", "kwargs['mask']", or a lifted tensor's name."""
    args, kwonly, lifted = inputs
    return leaf_paths(args) + leaf_paths(kwonly, "kwargs") + list(lifted)


class _Bound:
    """A sharded method's function for one instance, held on the instance: a copy or pickle of
    the instance does not take it (the copy makes its own, bound to itself)."""

    __slots__ = ("function",)

    def __init__(self, function):
        self.function = function

    def __copy__(self):
        return _Bound(None)

    def __deepcopy__(self, memo):
        return _Bound(None)

    def __reduce__(self):
        return (_Bound, (None,))


def _traced_on(device):
    """The device a function whose tensors are on `device` is traced on: that one, except meta
    (planning only, f.lower on meta tensors), traced as on the CPU, where constants are allowed."""
    return None if device is not None and torch.device(device).type == "meta" else device


class ShardedFunction:
    """A function traced once per input signature and run as one per-shard program."""

    def __init__(self, fn, mesh: Mesh, in_specs, out_specs, options: Options = Options(), state_specs=None):
        self.fn, self.mesh, self.in_specs, self.out_specs, self.options = fn, mesh, in_specs, out_specs, options
        self.state_specs = state_specs
        self._cache: dict = {}
        self._read_split: dict = {}  # id(a program's entry) -> (entry, positions of the state it reads split)
        self._argument_signatures: set = set()  # the argument leaves of each program compiled (distributed)
        self._fingerprints: dict = {}  # id(entry) -> a hash of what the ranks compare for it
        self._fast: dict = {}  # cheap signature -> cache entry: skips spec checks on repeated calls
        self._patterns_seen: set = set()  # state_specs patterns that matched in an earlier call
        self._kept_whole: dict[str, str] = {}  # tensors a wildcard's spec did not fit, warned about once
        self._stage = ""  # what a compile is doing, for an internal error's message
        self._auto: list = []  # (key, entry) of each program with AUTO leaves
        self._static_changes: dict = {}  # a Python value the trace reads -> the values it compiled for
        self._read_variants: dict = {}  # cache key -> the programs compiled for other values read from inputs
        self._read_changes: dict = {}  # where a value is read from the inputs -> compiles its changes caused
        self._lifted_names: frozenset | None = None  # the lifted tensors' names at the last compile
        self._names_ever: set = set()  # every lifted name any compile has seen
        self._state_growth: dict = {}  # a container of lifted tensors -> compiles it held new ones for
        self.trace_count = 0
        self._signature_obj = _signature(fn)
        self._arity = _plain_arity(self._signature_obj, len(in_specs) if isinstance(in_specs, tuple) else None)
        self._roots = lift.RootCache(fn)  # the state the function reaches, found again when its closures change
        if not isinstance(fn, torch.nn.Module):
            functools.update_wrapper(self, fn)

    # -- public ---------------------------------------------------------------------------------

    def __get__(self, obj, objtype=None):
        """`@hpfun.shard(...)` on a method (a trainer's `def step(self, x, y)`, a module's
        `forward`): each instance gets its own sharded function of the bound method, made at first
        use and kept on the instance (so it lives as long as the instance, and a copy of the
        instance makes its own); `in_specs` are for the arguments after `self`, and the state the
        instance holds is lifted by name (`self.model.weight`)."""
        if obj is None:
            return self
        store = getattr(obj, "__dict__", None)
        key = f"__hpfun_shard_{self.__name__ if hasattr(self, '__name__') else id(self)}"
        held = store.get(key) if isinstance(store, dict) else self.__dict__.get("_bound_without_dict", {}).get(id(obj))
        if held is not None and held.function is not None and held.function.fn.__self__ is obj:
            return held.function
        bound = ShardedFunction(types.MethodType(self.fn, obj), self.mesh, self.in_specs, self.out_specs, self.options,
                                self.state_specs)
        if isinstance(store, dict):
            store[key] = _Bound(bound)
        else:  # (an object with __slots__: kept here instead, for the life of this function)
            self.__dict__.setdefault("_bound_without_dict", {})[id(obj)] = _Bound(bound)
        return bound

    # Hidden from torch.compile: a compiled function calling this one (`torch.compile(step)`)
    # runs it as it is, not its capture, rank exchange and seed draw traced by dynamo
    # (`compile=True` compiles the per-shard program instead).
    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        if tracing():  # called inside another sharded function: its code is part of that program
            return self.fn(*args, **kwargs)
        if torch._C._functorch.peek_interpreter_stack() is not None:
            raise SpecError(Problem(f"hpfun.shard({_name(self.fn)})", "was called inside a torch.func transform "
                                    "(grad, vmap, jvp...) applied from outside it: a sharded function's outputs are "
                                    "Sharded values, not tensors those transforms can follow",
                                    "apply the transform inside: shard the function that calls torch.func.grad "
                                    "(hpfun.shard(torch.func.grad(loss), ...))"), headline="bad call")
        call = self._prepare(args, kwargs)
        if self.mesh.runtime == "distributed":  # (a rank whose last program failed while running is out of step)
            runtime_for(self.mesh).check_usable()
        try:
            entry = self._fast.get(call.key)
        except TypeError:  # an unhashable argument: _signature names it
            entry = None
        if entry is None:
            entry = self._program(call)[1]
        elif entry.reads:
            entry = self._for_reads(call, entry)
        if len(self._argument_signatures) > 1:  # (distributed only) ranks could each hit another cached program
            self._check_same_entry(call, entry)
        flat = call.flat
        if entry.written and entry.written[0] < (arguments := len(flat) - len(call.lifted)):
            _check_unaliased(call, entry, arguments)
        tensors = [flat[i] for i in entry.fed_flat] + entry.constants_list
        if entry.on_meta:  # shapes only: what the program makes on the CPU it was traced on is made on meta
            with _OnMeta():
                shards = execute(entry.program, tensors)
        elif not entry.program.donated:
            try:
                shards = execute(entry.program, tensors, self.options.compile)
            except SpecError:
                if spent := spent_error(tensors):  # (each value a call consumed, not only the first read)
                    raise spent from None
                raise
        else:
            released = []
            try:
                shards = execute(entry.program, tensors, self.options.compile, released, entry.spent)
            except BaseException as err:
                if isinstance(err, SpecError) and not released and (spent := spent_error(tensors)):
                    raise spent from None  # (read before anything ran: nothing of this call is consumed)
                writeback.lose(released, err)
                _spend(tensors, entry.spent, err)
                raise
            _spend(tensors, entry.spent)
            del released
        n = entry.n_outputs
        if entry.writes:
            tensors = [flat[i] for i in entry.tensor_pos]
            writeback.apply(entry.writes, [shards[n + j] for j in range(len(entry.writes))], tensors, call.state)
            if entry.creates:  # state now there, which the next call reads (`if "s" not in cache:` takes the
                self._roots.forget()  # other branch in eager): found by a new walk, and traced again
        if self.mesh.runtime == "distributed" and call.lifted:
            split = self._read_split.get(id(entry))
            if split is None or split[0] is not entry:  # (per program, once)
                arguments = len(flat) - len(call.lifted)
                split = self._read_split[id(entry)] = (entry, tuple(
                    i for i in entry.fed_flat if i >= arguments and type(entry.leaves[i].layout) is Layout and
                    not entry.leaves[i].layout.is_replicated and not entry.leaves[i].layout.partial_axes
                    and i not in entry.written))  # (an AUTO leaf's layout is the plan's: not kept here)
            read_split = [(flat[i], entry.leaves[i]) for i in split[1] if type(flat[i]) is not Sharded
                          and writeback.held_block(flat[i]) is None]
            if read_split:  # a module's state read split and left as it was (a frozen weight): each rank keeps its
                owned = writeback.module_state(call.state.roots)  # block; a plain object's tensor (a scheduler's table,
                writeback.keep_blocks([(t, leaf.layout, leaf.shape) for t, leaf in read_split  # which eager code
                                       if id(t) in owned])  # outside reads whole) stays whole
        if entry.cleared:
            writeback.clear(entry.cleared, call.state)
        if entry.effects:
            _replay(entry.effects, call.state.statics)
        results = [unchecked(lay, shape, s, token) for (lay, shape, token), s in zip(entry.outputs, shards[:n], strict=True)]
        if entry.edits:
            results = _put_edits(entry.edits, call, results)
        return entry.unflatten(results)

    def _check_same_entry(self, call: _Call, entry) -> None:
        """A function compiled for arguments of several shapes (batches padded to a few lengths)
        can find a program on each rank for different arguments, where no rank compiles and so
        none compares: at every call the ranks compare a hash of what they run (8 bytes each),
        and a difference is the error a first call's comparison gives."""
        fingerprint = self._fingerprints.get(id(entry))
        if fingerprint is None:  # the arguments, and the program (not every Python value the key holds)
            text = "\n".join([*_describe(call, entry.leaves, statics=False), str(_entry_digest(entry))]).encode()
            fingerprint = self._fingerprints[id(entry)] = int.from_bytes(hashlib.blake2b(text, digest_size=7).digest())
        runtime_for(self.mesh).check_same_entry(fingerprint, lambda: _describe(call, entry.leaves))

    @property
    def traced_function(self):
        """The function this one runs: what a sharded function calling this one traces."""
        return self.fn

    def lower(self, *args, **kwargs) -> Lowered:
        """The per-shard program for these arguments, with layouts and collectives (nothing runs)."""
        call = self._prepare(args, kwargs)
        return self._lowered(call, self._program(call)[1])

    def _lowered(self, call: _Call, entry: "_Entry") -> Lowered:
        tensors = [(path, leaf) for path, leaf in zip(call.paths(), entry.leaves, strict=True) if leaf.kind != "static"]
        fed = [tensors[i] for i in entry.fed]
        constants = [f"constants.{i}" for i in range(len(entry.constants))]
        lowered = Lowered(entry.program, input_paths=[p for p, _ in fed] + constants,
                          input_dtypes=[l.dtype for _, l in fed] + [c.dtype for c in entry.constants],
                          output_paths=entry.output_paths, cost_model=self.options.cost_model,
                          input_groups=[_group(p, call.state, self._signature_obj) for p, _ in fed]
                          + ["constants"] * len(constants), auto=entry.auto)
        return lowered

    # -- one call's inputs ------------------------------------------------------------------------

    def _prepare(self, args, kwargs) -> _Call:
        if kwargs or len(args) not in self._arity:
            n_specs = len(self.in_specs) if isinstance(self.in_specs, tuple) else None
            args, kwonly = _bind(self.fn, self._signature_obj, args, kwargs, n_specs)
        else:  # all parameters given by position: binding changes nothing
            kwonly = {}
        flat, key, given = [], [], None
        try:
            flattened = _flatten((args, kwonly), flat, key)
        except RuntimeError:  # a tensor that has no shape or strides to key on (nested, sparse CSR)
            _refuse_not_dense(leaf_paths(args) + leaf_paths(kwonly, "kwargs"),
                              pytree.tree_leaves((args, kwonly), is_leaf=is_sharded))
            raise
        if not flattened:  # NumPy arrays, or pytree nodes of other types
            register_containers_in((args, kwonly))  # (a dataclass in a dataclass: both seen into)
            given = (args, kwonly)
            args, kwonly = _from_numpy(args, kwonly)
            if args is given[0] and kwonly is given[1]:
                given = None
            flat, key = pytree.tree_leaves((args, kwonly), is_leaf=is_sharded), None
        state = self._roots.state()
        lifted = {}
        if state.slots:
            lifted = state.values(skip_ids={id(x) for x in flat if isinstance(x, torch.Tensor)})
            if self.mesh.runtime == "distributed":
                held = {k: writeback.held_block(v) for k, v in lifted.items() if isinstance(v, torch.Tensor)}
                if key is not None:  # a held block keys by its layout: the tensor's requires_grad keys too
                    key.append(tuple(lifted[k].requires_grad for k, v in held.items() if v is not None))
                lifted = {k: v if held.get(k) is None else held[k] for k, v in lifted.items()}
                if writeback._LOST and (names := writeback.lost(lifted)):
                    raise ExecutionError(Problem(
                        ", ".join(names), "lost: a call that was handed this state (donate_state=True) failed",
                        "end the job and start it again from the last checkpoint: the call failed while its program "
                        "ran, and this mesh runs nothing more" if runtime_for(self.mesh).broken is not None else
                        "load the values again (model.load_state_dict, optimizer.load_state_dict, or a "
                        "checkpoint), then call again"), headline="donated state lost")
            if key is not None:
                try:
                    _flatten(lifted, flat, key)
                except RuntimeError:
                    _refuse_not_dense(list(lifted), list(lifted.values()))
                    raise
            else:
                flat += lifted.values()
        if key is not None:
            key = (tuple(key), tuple(state.statics.items()))
        return _Call(args, kwonly, state, lifted, flat, key, given=given)

    # -- compile and cache --------------------------------------------------------------------------

    def _program(self, call: _Call):
        leaves, key = self._signature(call)
        entry = self._cache.get(key)
        if entry is None:  # a call handing an AUTO program's results back, in the layouts it chose, runs it too
            entry = next((e for k, e in self._auto if _chose(k, e, key)), None)
        if entry is None:
            if self.mesh.runtime == "distributed":
                runtime_for(self.mesh).check_same_program(_describe(call, leaves, statics=False))
                self._argument_signatures.add(tuple(leaves[:len(call.flat) - len(call.lifted)]))
            _refuse_not_dense(call.paths(), call.flat)
            self._note_changed_statics(call, key)
            self._note_new_shapes(call, key)
            self._note_new_state(call)
            entry = self._compile_everywhere(call, leaves)
            if entry.written:
                _check_written_state_unaliased(call, entry)
            self._cache[key] = entry
            if entry.auto is not None:
                self._auto.append((key, entry))
        if call.key is not None and _hashable(call.key):
            self._fast[call.key] = entry
        if entry.reads:
            entry = self._for_reads(call, entry, key, leaves)
        return entry.program, entry

    def _for_reads(self, call: _Call, entry: "_Entry", key=None, leaves=None) -> "_Entry":
        """The program of this signature that is right for the values this call's inputs give the
        reads its trace made (`capture.InputRead`: `labels.max() >= vocab_size`), compiled if none is."""
        inputs = [call.flat[i] for i in entry.tensor_pos]
        distributed = self.mesh.runtime == "distributed"
        if _all_hold(entry.reads, inputs) and not distributed:
            return entry
        if key is None:
            leaves, key = self._signature(call)
        variants = self._read_variants.setdefault(key, [entry])
        chosen = next((i for i, other in enumerate(variants)
                       if _all_hold(other.reads, [call.flat[i] for i in other.tensor_pos])), -1)
        if distributed and not runtime_for(self.mesh).same_everywhere(chosen):
            chosen = -1  # the ranks' values read differ: every rank compiles, and the compile fails them all
            # together (a rank whose check raised, the others with it), not one rank alone out of step
        if chosen >= 0:
            return variants[chosen]
        changed: dict = {}  # where -> (was, now) of its first read that changed: one count per compile
        for r in entry.reads:
            try:
                now = r.evaluate(inputs)
            except (IndexError, RuntimeError, ValueError) as err:  # (its steps fail on these inputs: `InputRead.holds`)
                now = f"<{type(err).__name__}>"
            if not same_value(now, r.value):
                changed.setdefault(r.where, (r.value, now))
        for where, (was, now) in changed.items():
            self._read_changes[where] = seen = self._read_changes.get(where, 0) + 1
            if seen == RETRACE_WARNING_AFTER:
                fn = _name(self.fn)
                shaped = isinstance(was, tuple) and bool(was) and (was[0] == "tensor" or isinstance(was[0], tuple))
                fix = ("keep the shape and mask the values instead (F.cross_entropy(..., ignore_index=-100), "
                       "torch.where(mask, x, 0), or a weighted sum divided by mask.sum())" if shaped else
                       "compute it outside the sharded function, or with tensor ops (torch.where) instead of Python")
                what = "the True positions of a mask (or a nonzero, unique)" if shaped else \
                    f"a value ({_clipped(was)} -> {_clipped(now)})"
                warnings.warn(
                    f"hpfun.shard({fn}) compiled a new program {seen} times because {what} the function reads "
                    f"from its inputs changed ({where.strip()}): the program is traced for the value read, and "
                    f"every new value compiles again (seconds each). Fix: {fix}.", RetraceWarning, stacklevel=user_stacklevel())
        if self.mesh.runtime == "distributed":
            runtime_for(self.mesh).check_same_program(_describe(call, leaves, statics=False))
        new = self._compile_everywhere(call, leaves)
        variants.append(new)
        return new

    def _note_changed_statics(self, call: _Call, key) -> None:
        """A compile whose signature differs from the last one of the same arguments only in
        Python values (the trace's reads, or Python numbers passed as arguments): count it per
        value, and warn once per value that keeps changing (a scheduler stepping a hyperparameter
        hpfun does not lift, or a learning rate passed as a float, compiles a program per step)."""
        tree, leaves, statics, *rest = key
        last = next((k for k in reversed(self._cache) if k[0] == tree and list(k[3:]) == rest
                     and _same_but_values(k[1], leaves)), None)
        if last is None:
            return
        before = lift.expand_statics(dict(last[2]))
        changed = [(name, before[name], value) for name, value in lift.expand_statics(dict(statics)).items()
                   if name in before and before[name] != value]
        changed += [(path, was.value, now.value) for path, was, now in zip(call.paths(), last[1], leaves, strict=True)
                    if now.kind == "static" and was != now]
        for name, was, value in changed:  # counted by the values compiled for: train/eval flipping, two
            values = self._static_changes.setdefault(name, {_value_key(was)})  # values, is no warning
            new = _value_key(value) not in values
            values.add(_value_key(value))
            seen = len(values) - 1
            if new and seen == RETRACE_WARNING_AFTER:
                warnings.warn(_retrace_message(self, name, was, value, seen), RetraceWarning, stacklevel=user_stacklevel())

    def _note_new_state(self, call: _Call) -> None:
        """A compile for lifted state holding tensors the last compile's did not, counted per
        container: a list the function appends its losses to grows at every call, and each
        tensor in it is an input. Warn once, when one container has grown for the third time."""
        names, before = frozenset(call.lifted), self._lifted_names
        self._lifted_names = names
        if before is None:
            self._names_ever = set(names)
            return
        added = sorted(names - before - self._names_ever)  # (a gradient back after zero_grad, a parameter
        self._names_ever |= names  # unfrozen again: nothing grew)
        for container in dict.fromkeys(name.rpartition(".")[0] for name in added):
            self._state_growth[container] = seen = self._state_growth.get(container, 0) + 1
            if seen == RETRACE_WARNING_AFTER:
                fn = _name(self.fn)
                new = [name for name in added if name.rpartition(".")[0] == container]
                warnings.warn(
                    f"hpfun.shard({fn}) compiled a new program {seen} times because {container or 'the state'} "
                    f"holds new tensors (last: {', '.join(new[:3])}): every tensor in a module, optimizer, or dict "
                    "or list the function reaches is an input of the program, so a container the function adds "
                    "tensors to at every call (a log of losses) makes a new program at every call. Keep such a log "
                    "outside: return the tensor and append it after the call "
                    "(`loss = step(x); history.append(loss)`).", RetraceWarning, stacklevel=user_stacklevel())

    def _note_new_shapes(self, call: _Call, key) -> None:
        """A compile for new shapes of the same arguments (each batch padded to its own length):
        warn once when the function has compiled RETRACE_SHAPES_WARNING_AFTER of them."""
        tree, leaves, *rest = key
        same = [k for k in self._cache if k[0] == tree and k[3:] == tuple(rest[1:]) and _same_but_values(k[1], leaves)
                and any(a.kind == "tensor" and a.shape != b.shape for a, b in zip(k[1], leaves))]
        if len(same) + 1 != RETRACE_SHAPES_WARNING_AFTER:
            return
        last = same[-1][1]
        changed = [f"{path} {list(now.shape)} (was {list(was.shape)})" for path, was, now in
                   zip(call.paths(), last, leaves, strict=True) if now.kind == "tensor" and was.shape != now.shape]
        fn = _name(self.fn)
        warnings.warn(f"hpfun.shard({fn}) compiled {len(same) + 1} programs for the same arguments in new shapes "
                      f"(last: {', '.join(changed[:3])}): each shape is a program, traced and compiled once (seconds "
                      "each) and kept. Pad inputs to a few fixed shapes (batches bucketed by length).",
                      RetraceWarning, stacklevel=user_stacklevel())

    def _signature(self, call: _Call):
        problems: list[Problem] = []
        layouts = input_layouts(self.mesh, self.in_specs, call.args, problems)
        layouts += [None if not isinstance(x, (torch.Tensor, Sharded)) else
                    leaf_layout(self.mesh, path, x, None, problems)
                    for path, x in zip(leaf_paths(call.kwonly, "kwargs"), pytree.tree_leaves(call.kwonly, is_leaf=is_sharded),
                                       strict=True)]
        layouts += self._state_layouts(call, problems)
        problems += spec_tree_problems(self.out_specs, "outputs", self.mesh)
        problems += [_argument_problem(path, x) for path, x in zip(call.paths(), call.flat, strict=True)
                     if not _is_tensor(x) and (not _hashable(x) and not lift.is_config_argument(x) or _not_a_value(x))]
        if problems:
            raise SpecError(problems)
        grads = {name for name, slot in call.state.slots.items() if slot.requires_grad}
        names = [None] * (len(call.flat) - len(call.lifted)) + list(call.lifted)
        leaves = tuple(_leaf(x, layout, name in grads) for x, layout, name in zip(call.flat, layouts, names, strict=True))
        key = (call.tree, leaves, tuple(call.state.statics.items()), _dict_keys(call.inputs[:2]), self.mesh,
               self.options)
        try:
            hash(key)
        except TypeError as err:
            raise SpecError(f"non-tensor arguments must be hashable (they are baked into the program): {err}") from None
        return leaves, key

    def _state_layouts(self, call: _Call, problems: list) -> list:
        """Lifted tensors' layouts: by state_specs name patterns; gradients and optimizer state
        follow their parameter; a block a distributed call left keeps its layout."""
        names = list(call.lifted)
        may_miss = set(self._patterns_seen)
        if pending := _pending_state_prefixes(call.state):  # its state's names appear at its first step:
            may_miss.update(p for p in self.state_specs or {}  # a pattern that could name them is checked from then on
                            if isinstance(p, str) and _may_name_state(p, pending))
        if gradless := _pending_gradients(call.state):  # likewise gradients, at the first backward
            may_miss.update(p for p in self.state_specs or {}
                            if isinstance(p, str) and any(pattern_matches(p, name) for name in gradless))
        decided_by: dict[str, str] = {}
        kept_whole: dict[str, str] = {}
        specs = match_patterns(self.state_specs or {}, names, problems, "state_specs", self.mesh, may_miss=may_miss,
                               matched_by=decided_by, aliases=_tied_names(call.state, set(names)),
                               hint=_optimizer_names_hint(call.state))
        self._patterns_seen.update(p for p in (self.state_specs or {})
                                   if isinstance(p, str) and any(pattern_matches(p, n) for n in names))
        out = []
        for name, x in call.lifted.items():
            spec = specs.get(name)
            by_wildcard = spec is not None and only_wildcards(self.state_specs, name)
            if by_wildcard and spec is not AUTO and getattr(x, "ndim", None) == 0:
                spec = None  # a 0-d value (a learning rate, a scale) a wildcard caught: nothing to split
            follows = call.state.slots[name].follows if name in call.state.slots else None
            # a gradient or optimizer state no pattern names follows its parameter; so does one named
            # by a pattern that names its parameter too, less specifically than the parameter's own
            # (`"*"` beside a pattern keeping one parameter whole; not `"opt.*"`, which is about state)
            if follows in specs and _same_shape(call.lifted.get(follows), x) and \
                    (name not in specs or pattern_matches(decided_by[name], follows)
                     and specificity(decided_by[follows]) > specificity(decided_by[name])):
                spec = specs[follows]
                # and its parameter's reason: a wildcard's spec the parameter cannot take keeps both whole
                by_wildcard = only_wildcards(self.state_specs, follows)
                if spec is AUTO and isinstance(x, torch.Tensor):  # takes its parameter's choice
                    out.append(Auto(follows, self.mesh))
                    continue
            if by_wildcard and (why := misfit(self.mesh, x, spec)):  # a plan for many tensors, not this one
                if follows not in kept_whole and follows not in self._kept_whole:  # state follows its parameter
                    kept_whole[name] = f"{tuple(x.shape)}: {why}"
                spec = None
            out.append(leaf_layout(self.mesh, name, x, spec, problems))
        fresh = {n: why for n, why in kept_whole.items() if n not in self._kept_whole}
        if fresh and not problems:  # (with problems the call raises: no warning beside the error)
            self._kept_whole.update(fresh)
            warn_kept_whole("state_specs", fresh, state=True)
        return out

    def _compile_everywhere(self, call: _Call, leaves) -> "_Entry":
        """`_compile`, and on a distributed mesh one exchange after it, made by every rank whether
        its compile succeeded or raised: the ranks compare what they read while tracing and what
        they planned, and where one failed (an error its data alone gives), the others fail with it
        instead of going on to collectives it will not join (which would pair each later call of
        one rank with the next call of another)."""
        if self.mesh.runtime != "distributed":
            return self._compile(call, leaves)
        try:
            entry = self._compile(call, leaves)
        except Exception:
            runtime_for(self.mesh).agree_on_compile(None, [])
            raise
        runtime_for(self.mesh).agree_on_compile(  # (where the plans differ, the Python values deciding them too)
            _entry_digest(entry), [f"{place}: {r.value!r}" for place, r in zip(_read_places(entry.reads), entry.reads)],
            lambda: _plan_lines(entry.program) + [f"{VALUE_LINE}{line}" for line in
                                                  _constant_lines(entry) + _describe(call, leaves)[len(leaves):]])
        return entry

    def _compile(self, call: _Call, leaves, fitting: "auto.Fitting | None" = None) -> "_Entry":
        grad_args = [path for path, x in zip(call.paths(), call.flat[:len(call.flat) - len(call.lifted)])
                     if type(x) is not Sharded and isinstance(x, torch.Tensor) and x.requires_grad]
        if grad_args:
            warnings.warn(f"{', '.join(grad_args[:3])}{' ...' if len(grad_args) > 3 else ''} require grad, but a "
                          "sharded function's outputs are not connected to autograd outside it (backward() on them "
                          "fails), and inside it they are plain inputs (requires_grad False: backward() leaves their "
                          ".grad None): compute gradients inside the function with torch.func.grad with respect to "
                          "them, or loss.backward() on lifted parameters", stacklevel=user_stacklevel())
        # graph modules write their Python code when first run or read, not at every pass's
        # recompile(): at 8 layers of a Llama each recompile costs 0.2-0.4 s, and planning runs none
        self._stage = "capturing"
        try:
            with _use_lazy_graph_module(True), _collector_paused():
                return self._compile_graph(call, leaves, fitting)
        except (HpfunError, KeyboardInterrupt):
            raise
        except Exception as err:  # anything else is hpfun's own failure: said so, the cause kept
            if getattr(err, "hpfun_raised_by_the_code", False):  # the function's own check: the caller's
                raise
            first = (str(err).strip().splitlines() or [""])[0][:300]
            name = getattr(self.fn, "__qualname__", repr(self.fn))
            whose = "hpfun" if self.options.registry is REGISTRY else "hpfun or in the rules of the registry passed"
            raise InternalError(Problem(f"hpfun.shard({name})", f"{type(err).__name__} while {self._stage}: {first}",
                                        f"this is a bug in {whose}, not in your function: please report it with this "
                                        "traceback (HPFUN_DEBUG=1 adds the program); fallback='replicate' or other "
                                        "specs may avoid it")) from err

    def _check_patterns_after_trace(self, call: _Call, traced: "_Traced", updated: set) -> None:
        """A state_specs pattern excused before the trace because it could name an optimizer's
        state not made yet, matching no name once the trace made what it makes (an optimizer
        that updated its parameters without making state, plain SGD, never will; an AdamW's
        first step made its moments) is an error, as any pattern that matches nothing: it was
        never checked again while the program ran from the cache (the plan silently not applied)."""
        patterns = [p for p in self.state_specs or {} if isinstance(p, str) and p not in self._patterns_seen]
        names = [*call.lifted, *traced.new_state, *_pending_gradients(call.state)]  # (a first backward's too)
        missing = [p for p in patterns if not any(pattern_matches(p, n) for n in names)]
        if not missing:
            return
        stepped = {id(root.value) for root in call.state.roots if isinstance(root.value, torch.optim.Optimizer) and
                   any(call.state.param_names.get(id(p)) in updated for g in root.value.param_groups for p in g["params"])}
        pending = [prefix for root in call.state.roots if isinstance(root.value, torch.optim.Optimizer)
                   and id(root.value) not in stepped for prefix in _pending_state_prefixes(call.state)
                   if prefix.startswith(lift._join(root.name, "state") + ".")]
        problems: list = []
        match_patterns({p: self.state_specs[p] for p in missing if not _may_name_state(p, pending)}, names, problems,
                       "state_specs", self.mesh, aliases=_tied_names(call.state, set(names)),
                       hint=_optimizer_names_hint(call.state))
        if problems:
            raise SpecError(problems)

    def _compile_graph(self, call: _Call, leaves, fitting: "auto.Fitting | None" = None) -> "_Entry":
        _check_grad_shapes(call)
        self.trace_count += 1
        tensor_pos = [i for i, l in enumerate(leaves) if l.kind != "static"]
        traced = _Traced()
        gm_inputs = [(leaves[i].shape, leaves[i].dtype, leaves[i].strides) for i in tensor_pos]
        device = _traced_on(next((leaves[i].device for i in tensor_pos), None))
        # values the trace may read: the arguments', and lifted state's that is not a parameter (a
        # counter buffer: AveragedModel's `n_averaged == 0`); a parameter's read would replay the
        # step's arithmetic on whole values at every call
        arguments = len(call.flat) - len(call.lifted)  # (lifted state comes last)
        readable = [(ON_META if isinstance(x, torch.Tensor) and x.device.type == "meta" else x)
                    if isinstance(x, (torch.Tensor, Sharded)) and (i < arguments or not leaves[i].requires_grad)
                    else None for i, x in ((i, call.flat[i]) for i in tensor_pos)]  # (a Sharded one read whole)
        for attempt in range(2):
            try:
                captured = trace(functools.partial(self._run_substituted, call, tensor_pos, traced), gm_inputs, device,
                                 requires_grad=[leaves[i].requires_grad for i in tensor_pos], readable=readable)
                break
            except UnliftedTensor as err:
                if attempt == 0 and clear_memoized():  # (a tensor a functools.lru_cache kept from an eager call:
                    traced = _Traced()  # made again inside the trace, as a constant of the program)
                    continue
                n_arguments = len(call.flat) - len(call.lifted)  # the arguments' leaves: what pytrees do not go into
                arguments = list(zip(call.paths()[:n_arguments], call.flat[:n_arguments]))
                attributes = [(_attribute_path(path, k), container) for path, _, container, held, *own  # (a
                              in _argument_containers(call.args, call.kwonly) if own  # UserDict's `batch.scale`)
                              for k, v in held.items() if isinstance(v, torch.Tensor)]
                raise lift.unlifted_tensor_error(call.state, str(err), arguments, attributes, err.tensor) from None
        paths = call.paths()
        self._check_patterns_after_trace(call, traced, {paths[tensor_pos[j]] for j in captured.mutated})
        _check_configs_unchanged(call, leaves)
        gm = captured.gm  # (on a distributed mesh, the ranks compare what they read after compiling)
        self._stage = "planning the layouts"
        check_pins(gm, self.mesh)  # every pin's problems together, at the user's lines
        fold_contractions(gm)
        paths = call.paths()
        names = [paths[i] for i in tensor_pos]
        lifted_index = {name: j for j, name in enumerate(names) if name in call.lifted}
        input_layouts_ = [leaves[i].layout for i in tensor_pos]
        writes = self._write_targets(call, traced, captured, names, lifted_index, input_layouts_, tensor_pos, leaves)
        donated_args = _donated_arguments(self.options.donate_argnums, call, names, writes)  # checked before planning
        fed = _prune_unused_state(gm, len(tensor_pos), {lifted_index[n] for n in lifted_index}, captured.mutated)
        in_layouts = [input_layouts_[j] for j in fed] + [Layout.replicated(self.mesh)] * len(captured.constants)
        out_layouts, out_paths = _output_layouts(self.mesh, self.out_specs, traced.out_example, traced.out_tensors)
        out_layouts += [None] * len(traced.edit_tensors)  # (in the layouts hpfun chose, as out_specs=None keeps)
        out_paths += [f"{edit.where()} (put in the caller's {edit.kind()})" for edit in traced.edits
                      for _ in range(edit.tensors)]
        out_layouts += [w.layout for w in writes]
        out_paths += [f"{w.name} (written back)" for w in writes]
        in_names = [names[j] for j in fed] + [f"constants.{i}" for i in range(len(captured.constants))]
        chosen = None
        if any(isinstance(l, Auto) for l in in_layouts + out_layouts) or AUTO in out_layouts:
            if fitting is None:  # (a Fitting when a budget is given, else only AUTO's deadline)
                hint = "" if self.options.gather_params else (", or gather_params (FSDP's gathers per use of a split "
                                                               "parameter, freed after it)")
                fitting = auto.Fitting(self.options.memory_budget, hint, auto.Deadline(self.options.auto_time_limit))
            try:
                in_layouts, out_layouts, writes, chosen = self._choose(
                    call, traced, gm, in_layouts, out_layouts, in_names, out_paths, writes,
                    fitting.planning, fitting.deadline)
            except ShardingError as err:
                if fitting.budget is not None and getattr(err, "out_of_time", False) \
                        and (fitting.peaks or fitting.least is not None):
                    # (planned below memory_budget after a plan that did not fit it: said with the budget given)
                    raise fitting.error(out_of_time=True) from err
                if fitting.budget is None or getattr(err, "least", None) is None:
                    raise
                fitting.infeasible(err)  # planned again at the least memory a plan needs, or raised
                return self._compile_graph(call, leaves, fitting)
        else:
            if self.options.memory_budget is not None:
                warnings.warn(f"{_name(self.fn)}: memory_budget={self.options.memory_budget} bounds the layouts "
                              "hpfun.AUTO chooses, and no spec of this call is AUTO: the plan is not held to it (give "
                              "hpfun.AUTO specs, or see lower(...).memory() for this plan's estimate)", stacklevel=user_stacklevel())
            grads = {w.name for w in writes}  # (parameters whose gradients it writes: gathered, updated or not)
            graded = frozenset(k for k, j in enumerate(fed) if names[j] in call.lifted and f"{names[j]}.grad" in grads)
            fsdp.gather_parameters(gm, self.mesh, in_layouts, self.options.gather_params, graded)
            stages: list = []  # under solver="exact": (the walk's annotation, the exact stage's or None)
            walked = _graph_copy(gm) if self.options.solver == "exact" else None
            propagate(gm, self.mesh, in_layouts, registry=self.options.registry, fallback=self.options.fallback,
                      reduce_dtype=self.options.reduce_dtype, outputs=out_layouts,  # reaching out_specs is priced too
                      cost_model=self.options.cost_model,
                      refine_with=None if walked is None else functools.partial(_refine_keeping_walk, stages))
        program = self._lower_annotated(gm, out_layouts, out_paths, in_names)
        if chosen is None and stages and stages[0][1] is not None:
            program = self._cheaper_bucketed(program, stages[0], walked, out_layouts, out_paths, in_names)
        if captured.seed is not None:
            program = attrs.evolve(program, seed=captured.seed)
        if self.options.donate_state or donated_args:
            updated = {w.input for w in writes if w.input is not None and names[w.input] in call.lifted}
            donated = updated if self.options.donate_state else set()
            program = attrs.evolve(program, donated=tuple(i for i, j in enumerate(fed) if j in donated | donated_args))
        if chosen is not None and fitting.budget is not None:  # the lowered program's estimate too
            chosen = fitting.check(program, chosen)
            if chosen is None:  # over the budget: planned again with the excess taken off
                return self._compile_graph(call, leaves, fitting)
        entry = _Entry(program, tuple(leaves), tuple(fed), captured.constants, traced.out_tree, traced.out_statics,
                       len(out_layouts) - len(writes), tuple(writes), tuple(traced.cleared), tuple(out_paths), chosen,
                       tuple((i, names[j]) for i, j in enumerate(fed) if j in donated_args), traced.effects,
                       captured.reads, traced.edits)
        if level := log.level():  # HPFUN_DEBUG, read at each compile
            log.log_compile(getattr(self.fn, "__qualname__", repr(self.fn)), gm, self._lowered(call, entry), level)
        return entry

    def _lower_annotated(self, gm, out_layouts, out_paths, in_names) -> Program:
        """The per-shard program of `gm`, annotated by propagation."""
        fuse.rejoin(gm, self.mesh, self.options.registry)
        checked = verify.enabled()  # HPFUN_VERIFY=1 or HPFUN_DEBUG: hpfun's own invariants
        if checked:
            verify.verify_annotation(gm, self.mesh)
        self._stage = "lowering the per-shard program"
        program = lower(gm, self.mesh, out_layouts, out_paths, rng=self.options.rng,
                        input_names=in_names, reduce_dtype=self.options.reduce_dtype,
                        bucket_bytes=self.options.bucket_bytes, overlap=self.options.overlap,
                        op_by_op=not self.options.compile)
        if checked:
            verify.verify_program(program)
        return program

    def _cheaper_bucketed(self, program: Program, stages: tuple, walked, out_layouts, out_paths, in_names) -> Program:
        """`solver="exact"`: the exact stage's plan (lowered: `program`) or the walk's, whichever
        costs less once bucketing is counted. Both solvers price each collective with its own
        alpha; the scheduler then fuses ready collectives of one kind into buckets, one alpha
        each, which favours the walk's many gradient all-reduces (a data-parallel step) over the
        exact stage's fewer activation moves. So the walk's plan is lowered too and the two are
        compared by their whole price (local work and communication) less what their buckets
        save; the exact plan is kept only where strictly cheaper, as `lower().cost()` reports."""
        walk, exact = stages
        copy, nodes = walked
        attrs.evolve(walk, plans={nodes[n]: plan for n, plan in walk.plans.items()}).write(copy)
        walk_program = self._lower_annotated(copy, out_layouts, out_paths, in_names)
        model = self.options.cost_model or CostModel()

        def price(annotation, lowered):  # (both price resolving a Partial output without out_specs, which
            return annotation.price - _bucket_saving(lowered, model) - _unresolved_outputs(  # stays Partial)
                lowered, out_layouts, model, self.options.reduce_dtype)
        return program if price(exact, program) < price(walk, walk_program) else walk_program

    def _choose(self, call, traced, gm, in_layouts, out_layouts, in_names, out_paths, writes, budget, deadline):
        """AUTO layouts chosen (`hpfun.auto`) under `budget` and `gm` annotated: (input layouts,
        output layouts, write-backs in their layouts, the AutoPlan)."""
        auto.gather_parameters(gm, self.mesh, in_layouts, self.options.gather_params)  # FSDP's pins, relative to AUTO
        n = len(out_layouts) - len(writes)
        flags = [l is AUTO for l in out_layouts[:n]]
        if any(flags):
            arg_layouts = input_layouts(self.mesh, self.in_specs, call.args, [])
            ties = auto.output_ties(traced.out_example, flags, call.args, arg_layouts)
            out_layouts = [t if f else l for l, f, t in zip(out_layouts[:n], flags, ties, strict=True)] + out_layouts[n:]
        o = self.options
        ins, outs, plan = auto.choose(gm, self.mesh, in_layouts, out_layouts, in_names, out_paths, registry=o.registry,
                                      fallback=o.fallback, reduce_dtype=o.reduce_dtype, cost_model=o.cost_model,
                                      budget=budget, deadline=deadline)
        writes = [attrs.evolve(w, layout=layout) for w, layout in zip(writes, outs[n:], strict=True)]
        return ins, outs, writes, plan

    def _run_substituted(self, call: _Call, tensor_pos, traced: "_Traced", *fakes):
        """The function on fake stand-ins: arguments, and lifted state swapped in where it lives."""
        full = list(call.flat)
        for i, fake in zip(tensor_pos, fakes, strict=True):
            full[i] = fake
        args, kwonly, lifted = pytree.tree_unflatten(full, call.tree)
        args, kwonly = _shared_as_given((call.args, call.kwonly), (args, kwonly), {})  # (`f(xs, xs)`: one list)
        swap = {}
        attributes_before: list = []  # (flat index, a lifted tensor, its stand-in, the attributes it had before the trace)
        for i, fake in zip(tensor_pos, fakes, strict=True):
            real = call.flat[i]
            swap[id(real)] = fake
            if type(real) is not Sharded and isinstance(real, torch.Tensor):  # (its address, read as eager reads it)
                stands_at(fake, real)
            # (a block a distributed call left stands for its tensor, which holds the hooks and attributes)
            owner = _held_owner(real)
            if isinstance(owner, torch.Tensor) and (owner._backward_hooks or getattr(owner, "_post_accumulate_grad_hooks", None)):
                _hooks_onto(owner, fake)
            if isinstance(owner, torch.Tensor) and type(owner) is not Sharded and owner.__dict__:  # `p.no_decay = True`,
                for key, value in owner.__dict__.items():  # read by a custom loop: the stand-in has it too
                    if key not in fake.__dict__:
                        setattr(fake, key, value)
            if i >= len(call.flat) - len(call.lifted) and isinstance(owner, torch.Tensor) and type(owner) is not Sharded:
                attributes_before.append((i, owner, fake, dict(fake.__dict__)))  # (lifted state: what the step sets
                # on it is compared after)
            if isinstance(real, Sharded) and real.layout.mesh.runtime == "distributed":
                swap[id(real.shards[0])] = fake  # a block a distributed call left stands for the module's tensor
        grads = {id(call.state.slots[slot.follows].read()): lifted[name] for name, slot in call.state.slots.items()
                 if name in lifted and name.endswith(".grad") and slot.follows in call.state.slots}
        for name, _, _, held in call.state.aliases:  # a gradient that is a tensor lifted at another place (`p.grad =
            if name.endswith(".grad") and name[:-5] in call.state.slots and held in swap:  # buf` at an earlier call)
                grads[id(call.state.slots[name[:-5]].read())] = swap[held]
        scalars = {name: lifted[name] for name, slot in call.state.slots.items() if slot.scalar and name in lifted}
        # (a scheduler's counters: a change is an error; read before the substitution keys dicts and
        # sets by stand-ins, so that a refused trace sets them back keyed by the tensors)
        objects = lift.ObjectValues(call.state.opaque, lift.held_sets(call.state.roots),
                                    [g for root in call.state.roots if isinstance(root.value, torch.optim.Optimizer)
                                     for g in root.value.param_groups],
                                    [entries for root in call.state.roots if isinstance(root.value, torch.optim.Optimizer)
                                     for entries in root.value.state.values()])
        substitution = lift.Substitution(call.state, swap, grads, scalars, fn=self.fn)
        given = _argument_containers(args, kwonly)  # (what the function puts in them is put in the caller's)
        stored_over: list = []  # (module-held values the function replaced by tensors: `_undo_effects`)
        try:
            with lift.ScalarSigns(substitution.signs, substitution.floats) if substitution.traces_optimizer \
                    else contextlib.nullcontext(), unguarded_draws(self.fn, call.state.opaque), \
                    _scheduler_steps() as stepped, _sync_batch_norm_as_batch_norm(), \
                    _parameters_set_to_themselves(substitution.stands_for_parameter), data_rebinds(frozenset(map(id, fakes))):
                out = self.fn(*args, **kwonly)
            traced.argument_edits(given)
            assigned, new_state = substitution.assigned()
        except BaseException:  # what it set in the objects it reads (a GradScaler's lazy scale) is set back too
            objects.undo()
            raise
        finally:  # (also when the function raised: what it set in modules is set back, and that error stays)
            substitution.restore()
            # submodules the step moved, put back before the Python values are compared by place (a swapped module's
            # numbers and training flag, read at the other's place, were replayed onto the module moved away)
            moves, refused = substitution.moved_modules()
            try:
                statics_after = lift.statics(call.state.roots)
            except Exception:  # noqa: BLE001 - read again below, where its own error may show
                statics_after = None
            if statics_after is not None:
                traced.effects = _undo_effects(call.state.statics, statics_after, call.state.roots, stored_over)
        # a lifted tensor frozen or unfrozen inside (`p.requires_grad_(False)`): set by every call, as eager's
        # (a block a distributed call left: its module's tensor, which holds the flag)
        # (an argument's stand-in takes no gradient: its caller's flag stays as it was)
        arguments = len(call.flat) - len(call.lifted)  # (lifted state comes last)
        flags = [(None, real, fake.requires_grad) for i, fake in zip(tensor_pos, fakes, strict=True)
                 if i >= arguments and isinstance(real := _held_owner(call.flat[i]), torch.Tensor) and type(real) is not Sharded
                 and real.is_leaf and fake.is_leaf and fake.requires_grad != real.requires_grad]
        # a parameter the step replaced by one it made frozen (`m.w = nn.Parameter(w, requires_grad=False)`): the
        # new tensor written back at every call takes that flag, not the old parameter's
        stand_ins = set(map(id, fakes))
        flags += [(None, _SlotFlag(slot), value.requires_grad) for name, value in assigned.items()
                  if isinstance(value, torch.nn.Parameter) and id(value) not in stand_ins
                  and (slot := call.state.slots.get(name)) is not None
                  and isinstance(old := slot.read(), torch.nn.Parameter) and old.requires_grad != value.requires_grad]
        traced.effects = (*traced.effects, *flags)
        paths = call.paths()
        hooked = [paths[i] for i, fake in zip(tensor_pos, fakes, strict=True)
                  if isinstance(real := call.flat[i], torch.Tensor) and type(real) is not Sharded
                  and any(len(getattr(fake, k, None) or {}) > len(getattr(real, k, None) or {})
                          for k in ("_backward_hooks", "_post_accumulate_grad_hooks"))]
        if hooked:
            raise CaptureError([Problem(path, "gets a gradient hook registered inside the sharded function: the "
                                        "program runs it, but cannot keep it on the tensor, where eager's calls add "
                                        "one more each time", "register the hook once, outside the sharded function "
                                        "(the trace runs the tensor's hooks), or transform the gradient inside")
                                for path in hooked], headline="hooks registered inside the function")
        if refused:
            raise CaptureError([Problem(*entry) for entry in refused], headline="the function moves submodules "
                               "where a cached call cannot")
        set_on = _attributes_set(attributes_before, paths)
        # a number, string or flag the step sets on a lifted tensor under a public name (`p.seen += 1`, `p.marked =
        # True`): set again by every call, as eager's are (such attributes key the program: a counter compiles again
        # at each call); a private one keys nothing (a library's bookkeeping), and a tensor cannot be put there
        # a weak reference to a lifted tensor (pyro's PyroParam tags its value with `unconstrained = weakref.ref(p)`):
        # every call sets one to the tensor the stand-in stood for
        owners = {id(fake): owner for _, owner, fake, _ in attributes_before}
        set_on = [(*e[:4], _WeakTo(owners[id(e[4]())])) if type(e[4]) is weakref.ref and id(e[4]()) in owners else e
                  for e in set_on]
        replayed = [e for e in set_on if not e[2].startswith("_") and (e[4] is _UNSET or lift._is_scalar(e[4])
                                                                       or type(e[4]) is _WeakTo)]
        if refused_attributes := [e for e in set_on if e not in replayed]:
            substitution.put_back()
            problems = []
            for path, _, key, how, new in refused_attributes:
                private = new is _UNSET or lift._is_scalar(new)  # (else an object: a tensor, a list of them)
                problems.append(Problem(
                    f"{path}.{key}", f"{how} by the function, a Python attribute of a lifted tensor " +
                    ("under a private name, which does not key the program: a cached call would run with the first "
                     "call's value" if private else f"holding a {type(new).__name__}: a traced program cannot put it "
                     "there") + " (eager's calls set it every time)",
                    "keep it in a module attribute or buffer, which hpfun writes back" +
                    (", or give the attribute a public name (no leading underscore), which keys the program and which "
                     "every call sets as eager's does" if private else "")))
            raise CaptureError(problems, headline="the function sets attributes of lifted tensors")
        traced.effects = (*traced.effects, *((None, _TensorAttribute(owner, key), new) for _, owner, key, _, new in replayed))
        traced.effects = (*traced.effects, *((lift._join(root, lift.VALUES), m, None) for root, m in moves.items()))
        if statics_after is None:
            statics_after = lift.statics(call.state.roots)
        # (what the function's effects set: by their statics key, and a module-held object's number by its name,
        # which the function may read by name too, `self.stats.calls += 1`: set by every call as the module's values)
        set_by_effects = {key for key, _, _ in traced.effects} | {name for _, name, _ in traced.effects if type(name) is str}
        changed = [k for k, v in statics_after.items() if not _same_static(call.state.statics.get(k, v), v)
                   and k not in substitution.set_aside and type(v) is not lift.ModuleValues and k not in set_by_effects]
        moved = objects.changed()
        if moved:
            objects.restore()
        if changed or moved:  # (the trace is refused below: it leaves the function's dicts and lists as they were)
            objects.restore_containers()
        deeper = [(name, obj, places) for name, obj, *_ in objects.objects if obj is not None
                  if (places := lift.fakes_inside(obj, name, 1))]
        for path, leaf in pytree.tree_flatten_with_path((call.args, call.kwonly))[0]:  # an object passed in
            if not isinstance(leaf, (torch.Tensor, Sharded)) and not lift._is_scalar(leaf):
                name = f"{'args' if path[0].idx == 0 else 'kwargs'}{pytree.keystr(path[1:])}"
                if places := lift.fakes_inside(leaf, name):
                    deeper.append((name, leaf, places))
        reached = {id(obj) for _, obj, *_ in objects.objects}
        schedulers = [(name, obj) for name, obj, *_ in objects.objects if id(obj) in stepped]
        schedulers += [("a scheduler held by a module or object", obj)  # (`model.sched`)
                       for obj, _ in stepped.held if id(obj) in stepped and id(obj) not in reached]
        if schedulers:
            objects.restore()  # (a scheduler stepped: said as such, whatever else its step changed or stored)
            objects.restore_containers()
            stepped.restore()
            values = {id(obj): values for _, obj, values in moved}
            raise CaptureError([Problem(f"{name} (a {type(obj).__name__}){stepped[id(obj)]}", (
                "changed " + ", ".join(f"{attr} from {_short(was)} to {_short(now)}"
                                       for attr, was, now in values[id(obj)][:3]) if values.get(id(obj)) else
                "was stepped") + " while the function was traced", _SCHEDULER_FIX) for name, obj in schedulers],
                               headline="the function changes Python state")
        if deeper:
            raise CaptureError([Problem(f"{name} (a {type(obj).__name__})", "the function stored tensors it made inside "
                                        f"it ({', '.join(p[len(name):] for p in places[:4])}"
                                        f"{', ...' if len(places) > 4 else ''}), where hpfun cannot write them back: it "
                                        "holds the trace's placeholders now, so make a new one",
                                        ("pass use_cache=False, or return the cache's key and value tensors and pass "
                                         "them to the next call" if type(obj).__name__.endswith("Cache") else
                                         "return the tensors as outputs instead, or keep them in a module or a dict "
                                         "the function closes over: hpfun writes those back after every call"))
                                for name, obj, places in deeper],
                               headline="the function stores tensors where hpfun cannot write them back")
        if leaked := objects.leaked():
            scalers = [name + "." for name, obj, *_ in objects.objects if obj is not None and lift.is_grad_scaler(obj)]
            raise CaptureError([Problem(where, "holds a tensor the function made, in an object hpfun does not lift (it "
                                        "walks modules, optimizers, and tensors, dicts and lists closed over or global)"
                                        ": the program cannot put it there at every call",
                                        lift.GRAD_SCALER_FIX if where.startswith(tuple(scalers)) else
                                        "keep it in a module (a buffer or attribute), an optimizer's state, or a dict "
                                        "the function closes over or reads as a global: hpfun writes those back after "
                                        "every call, and reads them at the next") for where in leaked],
                               headline="the function stores a tensor where hpfun cannot write it back")
        if left := substitution.left_over():
            for values, name, old in stored_over:  # (taken out: what the place held before, put back)
                values.set(name, old)
            substitution.put_back()  # (a refused call leaves the modules and what the function reaches as they were)
            raise CaptureError(Problem(", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else ""),
                                       "holds a tensor the function made, where hpfun cannot write it back (an "
                                       "object a module holds, a list inside a list, an optimizer or module made inside the function, a parameter "
                                       "group added, a global rebound): a cached call would leave the first call's "
                                       "placeholders there; they were taken out",
                                       "make optimizers, modules and param groups before the first call, outside the "
                                       "sharded function; keep tensors the step makes in a module's attribute or "
                                       "buffer, a list a module holds, or a dict closed over, or return them"),
                               headline="the function stores a tensor where hpfun cannot write it back")
        if changed or moved:
            side_effect = "a traced program cannot repeat Python side effects: make this change outside the sharded function"
            for root in call.state.roots:  # a number the trace changed, set back (`D["n"] += 1` beside a tensor in
                was = call.state.statics.get(root.name)  # D: the call is refused, and leaves it as it was)
                if root.name in changed and root.value is lift._SCALAR and root.write is not None and \
                        isinstance(was, lift.Exact):
                    root.write(was.value)

            def static_changed(k):
                opt = next((r.value for r in call.state.roots if isinstance(r.value, torch.optim.Optimizer)
                            and k.startswith(f"{r.name}.param_groups." if r.name else "param_groups.")), None)
                if opt is not None:  # a counter the optimizer keeps in its group (timm's Adan, Lookahead)
                    return lift.changed_state(k, opt, call.state.statics[k], statics_after[k])
                names = {id(t): name for name, slot in call.state.slots.items()
                         if isinstance(t := slot.read(), torch.Tensor)}
                return Problem(k, f"changed from {_short(call.state.statics[k], 200, names)} to "
                               f"{_short(statics_after[k], 200, names)} while the function was traced", side_effect)
            raise CaptureError([static_changed(k) for k in changed] +
                               [Problem(f"{name} (a {type(obj).__name__})" + _stepped_at(self.fn, name, obj),
                                        "changed " + ", ".join(
                                   f"{attr} from {_short(was)} to {_short(now)}" for attr, was, now in values[:3]) +
                                   " while the function was traced",
                                   _SCHEDULER_FIX if isinstance(obj, _SCHEDULERS) else side_effect)
                                for name, obj, values in moved],
                               headline="the function changes Python state")
        outputs = traced.record(out, assigned, new_state, lifted, {id(f): j for j, f in enumerate(fakes)},
                                {name for name, *_ in call.state.aliases},  # (and the places, optimizer state keys
                                dict(call.state.statics.get(lift._ALIASES, ())))  # too, held one before)
        substitution.put_numbers()  # (after the record's refusals: the numbers the step made are put, or the next step
        # skips its setup of the state)
        return outputs

    def _write_targets(self, call, traced, captured, names, lifted_index, layouts, tensor_pos, leaves) -> list:
        """Where each extra output goes, and the layout it is produced in."""
        writes = []
        first: dict = {}  # id of a tensor the step assigned -> the index of its first write
        for name, value in traced.assigned:
            same_as = first.setdefault(id(value), len(writes))
            same_as = None if same_as == len(writes) else same_as  # (`self.a = self.b = t`: one tensor at both)
            moved = traced.moved.get(name)  # (`s.a = s.b`: the input's own tensor)
            shape = tuple(value.shape)
            follows = call.state.slots[name].follows if name in call.state.slots else traced.new_state[name][1]
            layout = _write_layout(self.mesh, shape, layouts, lifted_index, name, follows, call)
            if name in call.state.slots:
                writes.append(WriteBack(layout, shape, name, slot=name, same_as=same_as, moved=moved))
            else:
                opt, param, key = traced.new_state[name]
                if opt is None:  # a tensor the step put into a module
                    writes.append(WriteBack(layout, shape, name, place=key, same_as=same_as, moved=moved))
                else:
                    writes.append(WriteBack(layout, shape, name, optimizer=opt, param=param, key=key, same_as=same_as,
                                            moved=moved))
        for j in captured.mutated:
            x = call.flat[tensor_pos[j]]
            layout = layouts[j]
            if self.mesh.runtime == "distributed" and isinstance(x, torch.Tensor) and j not in lifted_index.values():
                layout = Layout.replicated(self.mesh)  # every rank's own global tensor gets the full value
            writes.append(WriteBack(layout, leaves[tensor_pos[j]].shape, names[j], input=j))
        return writes


_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_SCHEDULER_FIX = ("step the scheduler after the call (`loss = train_step(x, y); scheduler.step()`): its step is Python "
                  "arithmetic on its own counters, which a traced program would repeat with the values of the trace, "
                  "while the learning rate it sets is an input hpfun reads at every call")

RETRACE_WARNING_AFTER = 3  # compiles caused by changes of one Python value before RetraceWarning
RETRACE_SHAPES_WARNING_AFTER = 8  # programs for new shapes of the same arguments before RetraceWarning


class RetraceWarning(UserWarning):
    """A sharded function keeps compiling: a Python value its trace reads keeps changing, or its
    arguments keep coming in new shapes."""


def _name(fn) -> str:
    """A sharded function's name for messages."""
    return getattr(fn, "__qualname__", type(fn).__name__)


def _clipped(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _plan_digest(program: Program) -> int:
    """A hash of what a program runs (ranks compare it after compiling: `agree_on_compile`): each
    value by what it is computed from (its op, arguments and theirs, down to the inputs), the
    collectives and the ops with effects in the order they run, and the layouts at its ends.
    Independent ops traced in another order hash alike: a model that loops over a set of strings
    (transformers' ModernBERT and Gemma-3 make their rotary tables per `set(layer_types)`) traces
    them in each process's hash order, and ranks had refused programs that differ in that alone."""
    made: dict = {}  # node -> the hash of how its value is made
    values, ordered = [], []

    def of(a):
        return made[a] if isinstance(a, torch.fx.Node) else a

    for node in program.module.graph.nodes:  # (an object's address differs between processes: left out)
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), of)
        name = node.name if node.op in ("placeholder", "get_attr") else ""  # (inputs by place, in order)
        text = _ADDRESS.sub("", f"{node.op} {name} {op_name(node.target)} {args} {kwargs}")
        made[node] = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        values.append(made[node])
        if node.op == "output" or "hpfun_collective" in node.meta or _has_effects(node):
            ordered.append(made[node])
    h = hashlib.blake2b(digest_size=7)
    h.update(" ".join(ordered).encode())
    h.update(" ".join(sorted(values)).encode())
    h.update(repr((program.input_layouts, program.output_layouts)).encode())
    return int.from_bytes(h.digest())


def _has_effects(node: torch.fx.Node) -> bool:
    """An op whose place in the program matters beside its inputs: one that writes an input, draws
    random numbers or runs a collective."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return node.op == "call_function" and not getattr(target, "__module__", "").startswith("_operator")
    return target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags or \
        target.namespace in ("_c10d_functional", "c10d_functional", "c10d")


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _entry_digest(entry: "_Entry") -> int:
    """`_plan_digest` of the entry's program and the values of the tensors the function made
    from data (`torch.tensor(a_list)`: fed to the program as inputs, so not in its code): ranks
    whose Python values differ there would run one program on different numbers."""
    h = hashlib.blake2b(str(_plan_digest(entry.program)).encode(), digest_size=7)
    for line in _constant_lines(entry):
        h.update(line.encode())
    return int.from_bytes(h.digest())


def _constant_lines(entry: "_Entry") -> list[str]:
    """One line per tensor the function made from data: its dtype, shape and a hash of its bytes."""
    lines = []
    for i, c in enumerate(entry.constants):
        if isinstance(c, torch.Tensor) and c.device.type != "meta":
            data = c.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            lines.append(f"the tensor the function made from data (constant {i}): {str(c.dtype).removeprefix('torch.')}"
                         f"{list(c.shape)}, values {hashlib.blake2b(data, digest_size=6).hexdigest()}")
    return lines


def _plan_lines(program: Program) -> list[str]:
    """One line per step of a program, its op and the user's line (where ranks' plans differ)."""
    lines = []
    for node in program.module.graph.nodes:
        if node.op == "call_function":
            line = user_line(node.meta.get("stack_trace")) if node.meta.get("stack_trace") else ""
            args = _ADDRESS.sub("", ", ".join([*map(str, node.args), *(f"{k}={v}" for k, v in node.kwargs.items())]))
            args = args if len(args) <= 160 else args[:157] + "..."
            lines.append(f"{op_name(node.target)}({args}){f' (from {line})' if line else ''}")
    return lines + [f"inputs in {', '.join(map(str, program.input_layouts))}",
                    f"outputs in {', '.join(map(str, program.output_layouts))}"]


def _same_static(a, b) -> bool:
    """Whether a Python value read before and after a trace is the same (a NaN is itself)."""
    try:
        return same_value(a, b)
    except Exception:  # (a value whose == is not a bool: compared as before)
        return not (a != b)


def _value_key(value):
    """A Python value as a set member (by its repr where it cannot hash: it keys a cache, so it mostly does)."""
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return (type(value), value)


def _same_but_values(cached: tuple, leaves: tuple) -> bool:
    """Whether two signatures' leaves agree but for the values of Python numbers among them and
    the shapes of tensors (the same arguments: a decode loop changes both, a position and a
    cache's length, and each counts toward its warning)."""
    return len(cached) == len(leaves) and all(
        a == b or a.kind == b.kind == "static" or a.kind == b.kind == "tensor" and a.dtype == b.dtype
        and a.layout == b.layout for a, b in zip(cached, leaves))


def _retrace_message(f: ShardedFunction, name: str, before, now, times: int) -> str:
    fn = _name(f.fn)
    if isinstance(before, _Config) and isinstance(now, _Config) and repr(before) == repr(now) and \
            (found := lift.class_difference(before.key, now.key)):  # (the config's class's values changed)
        subject = f"{name}, a class," if before.text.startswith("<class ") else f"the class of {name}"
        return (f"hpfun.shard({fn}) compiled a new program {times} times because {subject} changed "
                f"(last {found[0]} -> {found[1]}): what a config's class holds keys the program as the config's "
                "own values do (its methods may read them), and every new value compiles again (seconds each, and "
                "every program stays cached). A counter the function never reads (instances counted on the class) "
                "belongs outside the class (a module-level itertools.count); a value it reads that changes every "
                "call belongs in a tensor argument.")
    changed = f"{name} changed (last {before!r} -> {now!r})"
    held = [v.value if type(v) is lift.Exact else v for v in (before, now)]
    if type(held[0]) is type(held[1]) is lift.LibraryValues and (diff := held[0].changes(held[1])):  # (by attribute)
        owner = name.removesuffix(".<values>")
        changed = ", ".join(f"{owner}.{k} changed (last {_short(a, 80)} -> {_short(b, 80)})" for k, a, b in diff[:3])
    head = (f"hpfun.shard({fn}) compiled a new program {times} times because {changed}: a Python number the "
            "function reaches (read, or held beside what it reads: hpfun cannot tell which a trace read) is baked "
            "into the program, and every new value compiles "
            "again (seconds each, and every program stays cached).")
    if re.search(r"param_groups\.\d+\.lr$", name):
        return head + (" A learning rate a scheduler changes every step belongs in a tensor, which hpfun reads at "
                       "every call: torch.optim.AdamW(params, lr=torch.tensor(1e-3)) (schedulers update it in place).")
    if name.startswith(("args[", "kwargs[")):
        return head + (f" A value that changes every call belongs in a tensor, which hpfun reads at every call "
                       f"without compiling again: pass torch.tensor({now!r}) for {name} (a 0-d tensor, "
                       "replicated).")
    return head + (" If it changes every call, pass it as a tensor argument or keep it in a tensor; if the function "
                   "never reads it (a counter of the object's own), keep it out of what the function reaches (on "
                   "an object the model does not hold, or in a private attribute `_name` of an object a module "
                   "holds directly).")


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused while a program is compiled. Tracing and
    planning allocate millions of small objects that stay alive to the end, and each collection
    walks all of them again: at 32 GPT layers the collector took a fifth of the first call. What
    compiling leaves as garbage in cycles is collected as usual once it is back on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _hooks_onto(real: torch.Tensor, stand_in: torch.Tensor) -> None:
    """A parameter's own gradient hooks (`p.register_hook(lambda g: g.clamp(-c, c))`, a
    post-accumulate hook) on its stand-in too: the trace's backward runs them, as eager's does."""
    for hook in (real._backward_hooks or {}).values():
        if stand_in.requires_grad:
            stand_in.register_hook(hook)
    for hook in (getattr(real, "_post_accumulate_grad_hooks", None) or {}).values():
        if stand_in.requires_grad and stand_in.is_leaf:
            stand_in.register_post_accumulate_grad_hook(hook)


def _all_hold(reads, inputs: list) -> bool:
    """Whether every read gives the value it gave the trace. Each is evaluated, none skipped:
    reading state a distributed call left split gathers it (a collective), and every rank must
    make the same collectives, whatever its own values."""
    return all([r.holds(inputs) for r in reads])


def _undo_effects(before: dict, after: dict, roots, stored: list) -> tuple:
    """Python values of modules the trace changed (`self.max_seq_len_cached = n` in a forward,
    `model.eval()` in an evaluation step): set back to what they were, so that tracing changes
    nothing, and returned as (statics key, name, new value) to be set by every call of the
    program (`_replay`), as eager would; for training flags, (key, the module tree, its flags).
    A value replaced by tensors the trace made (`self.rec.last = y.sum()` where it held None) is
    no Python value: left for the check of what the trace left behind, which refuses it, and
    added to `stored` as (values, name, old value), to be set back then."""
    trees = {lift.training_key(r.name): r.value for r in roots if isinstance(r.value, torch.nn.Module)}
    effects = []
    for key, was in before.items():
        now = after.get(key)
        if type(was) is lift.ModuleValues and type(now) is lift.ModuleValues and was != now:
            for name, old, new in was.changes(now):
                if new is lift._MISSING and lift.holds_trace_tensors(held := was.current(name)) or \
                        lift.holds_trace_tensors(new):  # (a record of a dict subclass: `self.last = Rec(t=y)`)
                    stored.append((was, name, old))
                    continue
                was.set(name, old)
                effects.append((key, name, new if new is not lift._MISSING else held))
        elif key in trees and type(was) is tuple and type(now) is tuple and len(was) == len(now) and was != now:
            _set_flags(trees[key], was)
            effects.append((key, trees[key], now))
    return tuple(effects)


def _set_flags(tree: torch.nn.Module, flags: tuple) -> None:
    for module, flag in zip(tree.modules(), flags, strict=True):
        module.training = flag


def _replay(effects: tuple, statics: dict) -> None:
    for key, name, value in effects:
        if type(name) is lift.ModuleMoves:  # (after the values: a move clears an attribute of the name it takes)
            name.replay(statics[key])
        elif isinstance(name, torch.nn.Module):
            _set_flags(name, value)
        elif isinstance(name, torch.Tensor):  # a lifted tensor's requires_grad the function set
            name.requires_grad_(value)
        elif type(name) in (_SlotFlag, _TensorAttribute):
            name.set(value)
        else:
            statics[key].set(name, value)


class _SlotFlag:
    """The requires_grad flag of whatever tensor a lifted slot holds after the write-back."""

    def __init__(self, slot):
        self.slot = slot

    def set(self, flag: bool) -> None:
        if isinstance(t := self.slot.read(), torch.Tensor) and t.is_leaf:
            t.requires_grad_(flag)


_NOT_HELD = object()  # (a stand-in no place held)


class _Traced:
    """What the trace of the function left besides its graph: the outputs' structure, and what
    it assigned to lifted slots."""

    effects: tuple = ()  # (statics key, name, value) of each Python value of a module it changed
    edits: tuple = ()  # ArgumentEdit: what the function put in the dicts and lists it was given
    edit_tensors: tuple = ()  # their tensors, program outputs after the function's own
    moved: dict = {}  # name -> input index of a lifted tensor the step put at another place (`record`)

    def argument_edits(self, given: list) -> None:
        """What the function put in the dicts and lists passed to it (sentence-transformers'
        forward stores its embeddings in the features dict it is given): each is written into
        the caller's container after every call, as eager leaves it (the caller's was left as
        it was, silently)."""
        edits, tensors = [], []
        for path, at, container, before, *attributes in given:
            kind = "object" if attributes else "list" if type(container) is list or isinstance(
                container, collections.UserList) else "dict" if isinstance(container, collections.abc.MutableMapping) \
                else "object"
            if kind == "list":
                changed = [(i, v) for i, v in enumerate(container) if i >= len(before) or v is not before[i]]
                removed = () if len(container) >= len(before) else (len(container),)
            else:
                now = dict(container.items()) if kind == "dict" else container_attributes(container) if attributes \
                    else dataclass_items(container)
                changed = [(k, v) for k, v in now.items() if k not in before or v is not before[k]]
                removed = tuple(k for k in before if k not in now)
            for key, value in changed:
                where = path + pytree.keystr(({"list": pytree.SequenceKey, "dict": pytree.MappingKey,
                                               "object": pytree.GetAttrKey}[kind](key),))
                leaves, tree = pytree.tree_flatten(value)
                if hidden := [leaf for leaf in leaves if isinstance(leaf, (torch.nn.Module, torch.optim.Optimizer))
                              or not isinstance(leaf, torch.Tensor) and _tensors_inside(leaf)]:
                    warnings.warn(f"hpfun.shard: the function puts a {type(hidden[0]).__name__} holding tensors in "
                                  f"{where}, an argument, which hpfun cannot pass back to the caller's: it is left as "
                                  "it was (return the value instead)", TracingWarning, stacklevel=2)
                    continue
                if attributes and any(isinstance(leaf, torch.Tensor) for leaf in leaves):  # (a UserDict's attribute is
                    warnings.warn(f"hpfun.shard: the function puts a tensor in {where}, an attribute of a "  # no input:
                                  f"{type(container).__name__} argument, which hpfun hands over as a value, not an "
                                  "input (a later call would get this call's tensor): it is left as it was (put the "
                                  "tensor under a key, or return it)", TracingWarning, stacklevel=2)
                    continue  # a later call would read this one's tensor as a constant)
                statics = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
                tensors += [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
                edits.append(ArgumentEdit(path, at, key, tree, statics, len(leaves) - len(statics), container=kind))
            if removed:
                edits.append(ArgumentEdit(path, at, None, None, {}, 0, removed=removed, container=kind))
        self.edits, self.edit_tensors = tuple(edits), tuple(tensors)

    def record(self, out, assigned: dict, new_state: dict, stand_ins: dict, stand_in_ids: dict, aliases=(),
               shared: dict | None = None) -> list:
        flat, self.out_tree = pytree.tree_flatten(out)
        while any([register_container(type(v)) for v in flat if _is_container(v)]):  # a dataclass of results
            flat, self.out_tree = pytree.tree_flatten(out)  # (nested ones registered level by level)
        out, flat = _without_caches(out, flat, self.out_tree)
        self.out_example = out
        self.out_statics = {i: v for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)}
        self.out_tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        self.new_state = new_state  # name -> (optimizer, parameter, key) of an optimizer's first state
        self.assigned, self.cleared = [], []
        shared = shared or {}  # an optimizer state's key holding another's tensor before the call -> that key
        for name, value in assigned.items():
            before = stand_ins.get(name)
            if (value is before and name not in aliases and name not in shared) or (
                    name not in stand_ins and id(value) in stand_in_ids and not name.endswith(".grad") and (
                    name not in new_state or name in shared and value is stand_ins.get(shared[name], _NOT_HELD))):
                continue  # untouched (in-place updates come back through functionalization; a key of an optimizer's
                # state holding the tensor it held: `st["keep"]` still `st["m"]`, not re-pointed to `st["v"]`)
            if isinstance(value, torch.Tensor):
                self.assigned.append((name, value))
            elif (before is not None or name in aliases or name in shared) and (
                    value is None or value is lift.REMOVED or lift._is_scalar(value)):
                # emptied (zero_grad), or a tensor slot set to a Python number (HF's dynamic rotary embedding
                # resets `max_seq_len_cached` to an int): set so by every call
                self.cleared.append((name, value))
        _refuse_shared_state(self.assigned, stand_ins, stand_in_ids, new_state)
        # a lifted tensor put at another place (`s.a = s.b`, a swap): that tensor itself, not a copy of its value
        # (not one appended to a list, or put in a container made anew: a copy, as before, and the list's next
        # read is of tensors of its own)
        self.moved = {name: stand_in_ids[id(v)] for name, v in self.assigned if id(v) in stand_in_ids
                      and not (type(place := new_state.get(name, (None, None, None))[2]) is tuple
                               and place[:1] in (("append",), ("part",)))}
        return self.out_tensors + list(self.edit_tensors) + [v for _, v in self.assigned]


def _refuse_shared_state(assigned: list, stand_ins: dict, inputs: set, new_state: dict) -> None:
    """Optimizer state a step stores as a view of other state (`st["v"] = p.view(-1)` of a parameter,
    `st["m2"] = buf.view(-1)` of a tensor it stores too): hpfun writes each place back as a tensor
    of its own, and the next step's write through one would not reach the other (the numbers
    drifted from eager's, silently). Refused, naming both places; so is one tensor stored in a list
    or dict of an optimizer's state and at another place too (`st["d"] = {"a": st["m"]}`: the
    list or dict is put anew at every call). (One tensor stored at two other places is written
    back as one tensor, `WriteBack.same_as`; a tensor moved from place to place is an input: it
    keeps its identity.)"""
    state = {id(v): name for name, v in stand_ins.items() if isinstance(v, torch.Tensor)}
    made = {id(value): name for name, value in reversed(assigned)}
    problems = []
    for name, value in assigned:
        if id(value) in inputs or new_state.get(name, (None, None))[:2] == (None, None):
            continue  # (a module's or an object's: a cache made anew at every call, `self.w_t = self.weight.t()`)
        first = made[id(value)]
        place = new_state.get(name, (None, None, None))[2]
        if first != name and (type(place) is tuple and place[:1] == ("part",) or type(
                other := new_state.get(first, (None, None, None))[2]) is tuple and other[:1] == ("part",)):
            problems.append(Problem(name, f"holds the tensor {first} holds (the step stored one tensor at both)"))
        elif (base := value._base) is not None and (held := state.get(id(base), made.get(id(base)))) is not None:
            problems.append(Problem(name, f"holds a view of {held} (the step stored a view of it)"))
    if problems:
        raise CaptureError([attrs.evolve(p, what=p.what + ": hpfun writes each place back as a tensor of its own, so a "
                                         "later write through one would not reach the other", fix="keep the tensor at "
                                         "one place and read it from there, or store a copy (`.clone()`)")
                            for p in problems], headline="the function stores one tensor at several places")


def _without_caches(out, flat: list, tree):
    """`out` with a transformers model's cache (past_key_values, made unasked by default) as
    None, and a warning naming it: it holds the trace's stand-ins, and it is a by-product the
    caller rarely wants back. Other objects holding tensors are an error (`_output_layouts`)."""
    dropped = []
    for i, (path, leaf) in enumerate(pytree.tree_flatten_with_path(out)[0]):
        if type(leaf).__module__.startswith("transformers.") and type(leaf).__name__.endswith("Cache") \
                and _tensors_inside(leaf):
            dropped.append(i)
            warnings.warn(f"outputs{pytree.keystr(path)} is a {type(leaf).__name__} (a model's past_key_values): "
                          "hpfun returns tensors only inside tuples, lists, dicts and classes registered with "
                          "torch.utils._pytree, so it comes back as None. Call the model with use_cache=False (it "
                          "then makes none), or return what you need of its output (out.loss, out.logits).",
                          UserWarning, stacklevel=2)
    if not dropped:
        return out, flat
    flat = [None if i in dropped else v for i, v in enumerate(flat)]
    return pytree.tree_unflatten(flat, tree), flat


@attrs.frozen(eq=False)
class _Entry:
    """A compiled program and how a call's inputs and outputs map onto it."""

    program: Program
    leaves: tuple
    fed: tuple  # which tensor inputs the program reads (state it never touches is not fed)
    constants: tuple  # tensors the function made from data, fed after the inputs
    out_tree: object
    out_statics: dict  # position among the output leaves -> a non-tensor output, as returned
    n_outputs: int  # the function's tensor outputs; the program's further outputs are written back
    writes: tuple
    cleared: tuple  # (slot, None or a Python value) of slots the function emptied (zero_grad) or set to a number
    output_paths: tuple
    auto: object = None  # the hpfun.auto.AutoPlan of a program with AUTO leaves
    spent: tuple = ()  # (program input, path) of each donated argument leaf (donate_argnums)
    effects: tuple = ()  # Python values of modules the function sets, set again at every call (`_replay`)
    reads: tuple = ()  # capture.InputReads: values read from the inputs that the program is right for
    edits: tuple = ()  # ArgumentEdit: what the function puts in the containers it is given, after its outputs

    # derived once, for cache-hit calls
    tensor_pos: tuple = attrs.field(init=False)  # flat input positions of the tensor leaves
    fed_flat: tuple = attrs.field(init=False)  # flat input positions of the fed tensors
    constants_list: list = attrs.field(init=False)
    outputs: tuple = attrs.field(init=False)  # (layout, global shape, signature) per tensor output
    _build: object = attrs.field(init=False)  # the outputs' structure from its leaves, or None
    # writes state into a place that held none (a new key, attribute), or puts a lifted tensor at a gradient's
    # place (`p.grad = state["ema"]`: a place no walk watches, which the next walk finds shared)
    creates: bool = attrs.field(init=False)
    on_meta: bool = attrs.field(init=False)  # called with meta tensors: run on meta (`_OnMeta`)
    written: tuple = attrs.field(init=False)  # flat positions of the inputs the function writes in place, in order

    def __attrs_post_init__(self):
        program, n = self.program, self.n_outputs
        tensor_pos = tuple(i for i, leaf in enumerate(self.leaves) if leaf.kind != "static")
        object.__setattr__(self, "tensor_pos", tensor_pos)
        object.__setattr__(self, "fed_flat", tuple(tensor_pos[i] for i in self.fed))
        object.__setattr__(self, "constants_list", list(self.constants))
        outputs = tuple((lay, tuple(shape), signature(lay, shape, dtype)) for lay, shape, dtype in
                        zip(program.output_layouts[:n], program.output_shapes[:n], program.output_dtypes[:n], strict=True))
        object.__setattr__(self, "outputs", outputs)
        object.__setattr__(self, "_build", _builder(self.out_tree))
        object.__setattr__(self, "written", tuple(sorted(tensor_pos[w.input] for w in self.writes if w.input is not None)))
        # (read by the program: a meta skeleton's own parameters, replaced by functional_call, are not)
        object.__setattr__(self, "on_meta", any(self.leaves[i].device is not None and
                                                torch.device(self.leaves[i].device).type == "meta" for i in self.fed_flat))
        object.__setattr__(self, "creates", any(w.place is not None and w.place[0] != "append"
                                                and not (w.place[0] == "part" and w.place[1][0] == "append")
                                                or w.moved is not None and w.slot is not None and w.slot.endswith(".grad")
                                                for w in self.writes))

    def unflatten(self, results: list):
        if self.out_statics:
            it = iter(results)
            results = [self.out_statics[i] if i in self.out_statics else next(it) for i in range(self.out_tree.num_leaves)]
        if self._build is None:
            return pytree.tree_unflatten(results, self.out_tree)
        return self._build(results)


def _builder(spec):
    """A function building the value `spec` describes from the list of its leaves (faster than
    `pytree.tree_unflatten`: one expression, written once per program); None where `spec`
    holds a node other than a tuple, a list or a dict."""
    keys: list = []
    leaves = iter(range(spec.num_leaves))

    def expression(node) -> str | None:
        if node.is_leaf():
            return f"r[{next(leaves)}]"
        kids = [expression(child) for child in node.children()]
        if None in kids:
            return None
        if node.type is tuple:
            return "(" + "".join(k + ", " for k in kids) + ")"
        if node.type is list:
            return "[" + ", ".join(kids) + "]"
        if node.type is dict:
            keys.extend(node.context)
            first = len(keys) - len(kids)
            return "{" + ", ".join(f"k[{first + i}]: {kid}" for i, kid in enumerate(kids)) + "}"
        return None

    body = expression(spec)
    return None if body is None else eval(f"lambda r, k=k: {body}", {"k": tuple(keys)})


def _donated_arguments(argnums: tuple, call: _Call, names: list[str], writes) -> set[int]:
    """The tensor inputs (positions in `names`) of the positional arguments `argnums` names."""
    if not argnums:
        return set()
    problems = [Problem(f"donate_argnums={i}", f"the call has {len(call.args)} positional arguments",
                        "name the position of an argument the function is given")
                for i in argnums if i >= len(call.args)]
    found = {j for j, name in enumerate(names) if name.startswith("args[") and int(name[5:name.index("]")]) in argnums}
    problems += [Problem(names[w.input], "is donated and modified in place",
                         "donate an argument or update it in place, not both") for w in writes if w.input in found]
    if problems:
        raise SpecError(problems, headline="bad donate_argnums")
    return found


def _write_layout(mesh: Mesh, shape: tuple, layouts: list, lifted_index: dict, name: str, follows, call) -> Layout:
    """An assigned slot keeps the layout it was read in; a new gradient or optimizer state takes
    its parameter's; anything else is replicated."""
    for source in (name, follows):
        if source in lifted_index and tuple(call.lifted[source].shape) == shape:
            return layouts[lifted_index[source]]
    return Layout.replicated(mesh)


@contextlib.contextmanager
def _parameters_set_to_themselves(stands_for_parameter):
    """`model.weight -= lr * model.weight.grad` (in place, then the same tensor set back on the
    module): torch's Module.__setattr__ refuses a tensor that is not a Parameter where a
    parameter is, and the trace's stand-in is not one; set to itself, nothing changes. The
    stand-in of a lifted Parameter put at a parameter's place (`pd["u"], pd["v"] = pd["v"],
    pd["u"]`) goes there as the Parameter it stands for would: a ParameterDict or ParameterList
    wraps no Parameter anew, where it wrapped the stand-in, and the step's swap came back as two
    new tensors, with the optimizer's state keyed to neither."""
    module, containers = torch.nn.Module, (torch.nn.ParameterDict, torch.nn.ParameterList)
    own = module.__setattr__
    own_items = {c: vars(c)["__setitem__"] for c in containers}

    def setattr_(self, name, value):
        params = self.__dict__.get("_parameters")
        if params is not None and name in params and (params[name] is value or stands_for_parameter(value)):
            params[name] = value
            return
        own(self, name, value)

    def setitem(container):
        def setitem_(self, key, value):
            if not stands_for_parameter(value):
                return own_items[container](self, key, value)
            if container is torch.nn.ParameterDict:
                self._keys[key] = None
                return setattr(self, self._key_to_attr(key), value)
            return setattr(self, str(self._get_abs_string_index(key)), value)
        return setitem_

    module.__setattr__ = setattr_
    for c in containers:
        c.__setitem__ = setitem(c)
    try:
        yield
    finally:
        module.__setattr__ = own
        for c in containers:
            c.__setitem__ = own_items[c]


@contextlib.contextmanager
def _sync_batch_norm_as_batch_norm():
    """nn.SyncBatchNorm traced as the BatchNorm it is over the global batch: hpfun's batch norm of
    a split batch already sums its statistics over the ranks, and SyncBatchNorm's own forward
    refuses a CPU tensor once a process group runs (a gloo job failed where a simulated mesh ran)."""
    sync = torch.nn.SyncBatchNorm
    own = vars(sync)["forward"]
    sync.forward = torch.nn.modules.batchnorm._BatchNorm.forward
    try:
        yield
    finally:
        sync.forward = own


@contextlib.contextmanager
def _scheduler_steps():
    """id(scheduler) -> ' at file:line: code' of the user's call that first stepped it, while the
    function is traced (in a helper too: SequentialLR steps its own schedulers as well)."""
    stepped = _Stepped()
    classes = {torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau}
    classes |= {c for base in list(classes) for c in _subclasses(base)}
    originals = {c: vars(c)["step"] for c in classes if "step" in vars(c)}

    def watched(original):
        @functools.wraps(original)
        def step(sched, *args, **kwargs):
            if id(sched) not in stepped:
                stepped[id(sched)] = capture_at_user_line()
                inner = [s for v in vars(sched).values() for s in (v if type(v) in (list, tuple) else [v])
                         if isinstance(s, tuple(classes))]  # SequentialLR's own, which it may update not by step
                for s in [sched, *inner]:
                    if all(s is not held for held, _ in stepped.held):
                        stepped.held.append((s, {k: (v, copy.copy(v) if type(v) in (list, dict) else None)
                                                 for k, v in vars(s).items()}))
            return original(sched, *args, **kwargs)
        return step

    for c, original in originals.items():
        setattr(c, "step", watched(original))
    try:
        yield stepped
    finally:
        for c, original in originals.items():
            setattr(c, "step", original)


class _Stepped(dict):
    """id(scheduler) -> the line that stepped it; `held`: each one's attributes before."""

    def __init__(self):
        super().__init__()
        self.held: list = []

    def restore(self) -> None:
        """Every stepped scheduler as it was (SequentialLR's own schedulers too)."""
        for sched, before in self.held:
            d = vars(sched)
            d.clear()
            for k, (v, items) in before.items():
                if items is not None:
                    v.clear()
                    v.update(items) if type(v) is dict else v.extend(items)
                d[k] = v


def _subclasses(cls) -> list:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _stepped_at(fn, name: str, obj) -> str:
    """' at file:line: code' where the function's own source calls `<name>.step(` on a
    scheduler (the change is found after the trace, by comparing its counters), else ''."""
    if not isinstance(obj, _SCHEDULERS):
        return ""
    try:
        lines, first = inspect.getsourcelines(inspect.unwrap(fn))
        filename = inspect.getsourcefile(inspect.unwrap(fn))
    except (OSError, TypeError):
        return ""
    last = name.rsplit(".", 1)[-1]
    calls = (f"{last}.step(", f"['{last}'].step(", f'["{last}"].step(')  # (held in a dict: `held["s"].step()`)
    for i, line in enumerate(lines):
        if any(call in line for call in calls):
            return f" at {filename}:{first + i}: {line.strip()}"
    return ""


def _tied_names(state: lift.State, names: set) -> dict:
    """Each other name of a lifted tensor (a tied weight's second place: GPT-2's `lm_head.weight`,
    lifted as `transformer.wte.weight`; a second key of optimizer state holding it) -> the name it
    is lifted under."""
    out = {}
    for root in state.roots:
        if isinstance(root.value, torch.nn.Module):
            for kind in ("named_parameters", "named_buffers"):
                for name, t in getattr(torch.nn.Module, kind)(root.value, remove_duplicate=False):  # (torch's:
                    # a subclass's override may not take remove_duplicate, torchrl's LossModule's)
                    full = lift._join(root.name, name)
                    lifted = state.param_names.get(id(t))
                    if full not in names and lifted in names and lifted != full:
                        out[full] = lifted
    for name, first in state.statics.get(lift._ALIASES, ()):  # (a further place or key of optimizer state holding
        if name not in names and first in names:  # one: `st["ema"] = st["exp_avg_sq"]`, `self.c = self.a`)
            out.setdefault(name, first)
    return out


def _optimizer_names_hint(state: lift.State) -> str:
    """Where patterns name optimizer state: the optimizers' own names (in a tuple or a dict,
    `opt.0`, `opt.1`...), which their state's names start with."""
    found = [root.name for root in state.roots if isinstance(root.value, torch.optim.Optimizer)]
    made = ("; a tensor the step itself makes at its first call (in a dict it fills, `mom.setdefault(p, ...)`) "
            "has no name before that call: make it before the first call to give it a spec")
    if not found:  # (ZeRO-1's `*.exp_avg` given to a forward/backward of accumulation over calls too)
        return ("; this function reaches no optimizer, so a pattern for optimizer state (`*.exp_avg`, "
                "`*.momentum_buffer`) names nothing here: give it to the sharded function that steps the optimizer"
                + made)
    return (f"; the optimizer{'s are' if len(found) > 1 else ' is'} named {', '.join(found)}: "
            f"{'their' if len(found) > 1 else 'its'} state is named {found[0]}.state.<parameter>.<key>" + made)


def _pending_state_prefixes(state: lift.State) -> list[str]:
    """`<optimizer>.state.<parameter>` of each parameter an optimizer the function reaches has
    no state for yet (torch.optim makes it at the first step): the names its state will have,
    but for the key."""
    out = []
    for root in state.roots:
        opt = root.value
        if isinstance(opt, torch.optim.Optimizer):
            out += [f"{lift._join(root.name, 'state')}.{state.param_names[id(p)]}" for g in opt.param_groups
                    for p in g["params"] if p not in opt.state and id(p) in state.param_names]
    return out


def _pending_gradients(state: lift.State) -> list[str]:
    """`<parameter>.grad` of each lifted parameter without a gradient yet (a first backward
    makes it): names a pattern for gradients (`"*.grad"`) will match from then on."""
    return [f"{name}.grad" for name, slot in state.slots.items() if slot.requires_grad
            and getattr(slot.read(), "grad", None) is None]


def _may_name_state(pattern: str, prefixes: list[str]) -> bool:
    """Whether `pattern` could match some `<prefix>.<key>` (a state key not known yet): its last
    dotted part stands for the key, what comes before it must match a prefix (or its tail)."""
    head, dot, _ = pattern.rpartition(".")
    return bool(prefixes) and (not dot or any(pattern_matches(head, prefix) or pattern_matches(pattern, prefix + ".x")
                                              for prefix in prefixes))  # (none pending: it names nothing, an error)


def _group(path: str, state: lift.State, signature: inspect.Signature | None) -> str:
    """What an input is, for the memory report: a lifted tensor's kind, or the parameter name
    of the argument it is in ("args[0]['w1']" of `step(params, x)`: "params")."""
    slot = state.slots.get(path)
    if slot is not None:
        if slot.requires_grad:
            return "parameters"
        if slot.follows is not None:
            return "gradients" if path.endswith(".grad") else "optimizer state"
        groups = tuple(f"{r.name}.param_groups." for r in state.roots if isinstance(r.value, torch.optim.Optimizer))
        # (a float lr or beta read as a tensor, or a tensor one the group holds)
        return "optimizer state" if slot.scalar or path.startswith(groups) else "buffers"
    if path.startswith("kwargs["):
        return path[len("kwargs['"):].split("'", 1)[0]
    if path.startswith("args[") and signature is not None:
        i = int(path[len("args["):].split("]", 1)[0])
        params = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if i < len(params):
            return params[i].name
        var = next((p for p in signature.parameters.values() if p.kind == p.VAR_POSITIONAL), None)
        if var is not None:
            return f"{var.name}[{i - len(params)}]"
    return path.split("[", 1)[0] if path.startswith("args[") else path


def _chose(auto_key: tuple, entry: "_Entry", key: tuple) -> bool:
    """Whether a call keyed `key` is one the AUTO program `entry` (keyed `auto_key`) serves: the
    same but for AUTO leaves given in the layouts the program chose for them (in any layout, for
    those it does not read: a gradient zero_grad empties first)."""
    if auto_key[0] != key[0] or auto_key[2:] != key[2:] or len(auto_key[1]) != len(key[1]):
        return False
    chosen = {i: entry.program.input_layouts[j] for j, i in enumerate(entry.fed_flat)}
    return all(a == b or isinstance(a.layout, Auto) and b.kind == "tensor"
               and attrs.evolve(a, layout=chosen.get(i, b.layout)) == b
               for i, (a, b) in enumerate(zip(auto_key[1], key[1], strict=True)))


def _same_shape(a, b) -> bool:
    return a is not None and b is not None and tuple(a.shape) == tuple(b.shape)


def _graph_copy(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict]:
    """A copy of `gm` to annotate and lower apart from it, and its node for each of `gm`'s (the
    nodes' meta copied shallowly: the fake values are shared, an annotation is each copy's own)."""
    graph, nodes = torch.fx.Graph(), {}
    output = graph.output(graph.graph_copy(gm.graph, nodes))
    old = gm.graph.output_node()
    output.meta = dict(old.meta)
    nodes[old] = output
    groups: dict = {}  # a fused op's group (`hpfun.fuse`) names its nodes: the copy's are its own
    for node in graph.nodes:
        if (group := node.meta.get("hpfun_group")) is not None:
            if id(group) not in groups:
                moved = functools.partial(torch.fx.node.map_arg, fn=lambda n: nodes.get(n, n))
                groups[id(group)] = attrs.evolve(
                    group, args=moved(group.args), kwargs=moved(group.kwargs), nodes=[nodes[n] for n in group.nodes],
                    output=None if group.output is None else nodes[group.output],
                    probes=[None if p is None else (nodes[p[0]], p[1]) for p in group.probes])
            node.meta["hpfun_group"] = groups[id(group)]
    return torch.fx.GraphModule(gm, graph), nodes


def _refine_keeping_walk(stages: list, graph, walk):
    """The exact stage (`hpfun.exact.refine`), recording the walk's annotation beside its result."""
    refined = refine(graph, walk)
    stages.append((walk, refined))
    return refined


def _unresolved_outputs(program: Program, wanted: list, model: CostModel, reduce_dtype: str) -> float:
    """Seconds the planner charged for resolving the Partial sums of outputs given no out_specs,
    which the program returns as they are (`.full()` sums them): not run, so not paid."""
    outputs = program.module.graph.output_node().args[0]
    seconds = []
    for want, layout, node in zip(wanted, program.output_layouts, outputs, strict=True):
        if want is None and layout is not None and layout.partial_axes and "hpfun_global" in node.meta:
            shape, dtype = node.meta["hpfun_global"]  # (per axis, as propagation prices it)
            seconds += [redistribute_seconds(layout, layout.with_placement(a, Replicate()), shape, dtype, model,
                                             reduce_dtype)[0] for a in layout.partial_axes]
    return math.fsum(seconds)


def _bucket_saving(program: Program, model: CostModel) -> float:
    """Seconds the program's buckets save under `model`: one alpha per collective that rides in
    another's launch."""
    return math.fsum((len(b.members) - 1) * model.link(b.axes)[0] for b in program.buckets)


def _prune_unused_state(gm: torch.fx.GraphModule, n_inputs: int, lifted: set, mutated) -> list[int]:
    """Lifted state the program never reads nor writes is not an input (a module whose
    parameters the function passes through functional_call, for one); the inputs kept."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][:n_inputs]
    kept = []
    for j, node in enumerate(placeholders):
        if j in lifted and not node.users and j not in mutated:
            gm.graph.erase_node(node)
        else:
            kept.append(j)
    gm.recompile()
    return kept


def _output_layouts(mesh: Mesh, out_specs, out_example, out_tensors) -> tuple[list, list[str]]:
    """A layout per tensor output (None: keep the chosen one), and the outputs' paths."""
    flat = pytree.tree_leaves(out_example)
    bare = len(flat) == 1 and flat[0] is out_example  # a function returning one tensor: its output is outputs[0]
    root = "outputs[0]" if bare else "outputs"
    paths = leaf_paths(out_example, root)
    tensor_paths = [p for p, v in zip(paths, flat, strict=True) if isinstance(v, torch.Tensor)]
    hidden = [Problem(p, f"is a value of type {type(v).__name__} holding tensors ({', '.join(i.lstrip('.') for i in inside[:4])}), which hpfun cannot see: they "
                      "would come back as the trace's stand-ins", f"return tensors in tuples, lists and dicts, or "
                      f"register {type(v).__name__} as a pytree node (torch.utils._pytree.register_dataclass)")
              for p, v in zip(paths, flat, strict=True) if (inside := _tensors_inside(v))]
    if hidden:
        raise CaptureError(hidden, headline="the function returns tensors inside other objects")
    if out_specs is None:
        return [None] * len(out_tensors), tensor_paths
    problems: list[Problem] = []
    kept: dict = {}
    if isinstance(out_specs, (tuple, list)) and not bare:
        problems += split_scalars(out_specs, out_example, root, "out_specs")
    per_leaf = broadcast_prefix(out_specs, out_example, problems, root=root, mesh=mesh, kept=kept)
    layouts = []
    for path, value, spec in zip(paths, flat, per_leaf, strict=True):
        if not isinstance(value, torch.Tensor):
            continue
        if (bad := bad_spec(path, spec, mesh)) is not None:
            problems.append(bad)
            layouts.append(None)
            continue
        if spec is AUTO:  # hpfun.auto ties it to the argument it mirrors, if any
            layouts.append(AUTO)
            continue
        layouts.append(tensor_layout(mesh, path, tuple(value.shape), spec or P(), problems,
                                     "pick out_specs whose axes divide the output, or None to keep hpfun's layout"))
    if problems:
        raise SpecError(problems)
    warn_kept_whole_unless(kept, problems)
    return layouts, tensor_paths


def _tensors_inside(x, depth: int = 4) -> list[str]:
    """Where a non-tensor output holds tensors: the paths to them through its attributes, and
    the lists, tuples and dicts they hold ("layers[0].keys"), or "elements" of a set."""
    if isinstance(x, (set, frozenset)):
        return ["elements"] if any(isinstance(v, torch.Tensor) for v in x) else []
    if isinstance(x, torch.Tensor) or depth == 0:
        return []
    if isinstance(x, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(x)]
    elif isinstance(x, dict):
        items = [(f"[{k!r}]", v) for k, v in x.items()]
    elif isinstance(getattr(x, "__dict__", None), dict) and not isinstance(x, (type, torch.nn.Module)):
        items = [(f".{k}", v) for k, v in vars(x).items()]
    else:
        return []
    found = []
    for name, v in items:
        found += [name] if isinstance(v, torch.Tensor) else [name + sub for sub in _tensors_inside(v, depth - 1)]
    return found


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    except (TypeError, ValueError):  # a builtin without a signature: positional arguments only
        return None


def _bind(fn, signature, args: tuple, kwargs: dict, n_specs: int | None = None) -> tuple[tuple, dict]:
    """Keyword arguments moved to their positions (so in_specs, by position, covers them), and
    left-out parameters that a tuple of `n_specs` in_specs covers given their defaults;
    keyword-only ones (and **kwargs) are returned apart. A call the signature refuses is an
    error naming the signature, not a spec mismatch later."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if signature is None:
        if kwargs:
            raise SpecError(f"{name} takes keyword arguments {sorted(kwargs)}, but its signature cannot be inspected",
                            headline="bad arguments")
        return args, {}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        params = signature.parameters.values()
        unknown = [k for k in kwargs if k not in signature.parameters or signature.parameters[k].kind is
                   inspect.Parameter.POSITIONAL_ONLY] if not any(p.kind is p.VAR_KEYWORD for p in params) else []
        if unknown:  # (as Python says it: a misspelled keyword, not the argument it left out)
            close = difflib.get_close_matches(unknown[0], list(signature.parameters), n=1)
            err = f"got an unexpected keyword argument {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        raise SpecError(f"{name}{signature}: {err}", headline="bad arguments") from None
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = [i + 1 for i, p in enumerate(positional) if p.name in bound.arguments]
    n = max(given + [min(n_specs or 0, len(positional))])
    out = [bound.arguments.get(p.name, p.default) for p in positional[:n]]
    kwonly = {}
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            out += list(bound.arguments.get(p.name, ()))
        elif p.kind is p.KEYWORD_ONLY and p.name in bound.arguments:
            kwonly[p.name] = bound.arguments[p.name]
        elif p.kind is p.VAR_KEYWORD:
            kwonly.update(bound.arguments.get(p.name, {}))
    return tuple(out), kwonly


def _from_numpy(args: tuple, kwonly: dict) -> tuple[tuple, dict]:
    """NumPy arrays among the arguments are read as tensors (`torch.as_tensor`: sharing their
    memory, float64 stays float64); one torch cannot hold is an error naming its path."""
    np = sys.modules.get("numpy")
    if np is None or not any(isinstance(leaf, np.ndarray) for leaf in pytree.tree_leaves((args, kwonly))):
        return args, kwonly  # (the caller's own containers kept: what the function puts in them is put there)
    problems: list[Problem] = []

    def convert(path, x):
        if not isinstance(x, np.ndarray):
            return x
        try:
            return torch.as_tensor(x)
        except TypeError:
            problems.append(Problem(path, f"is a NumPy array of dtype {x.dtype}, which a tensor cannot hold",
                                    "pass a numeric or bool array (or a tensor); other values as Python objects"))
            return x

    args = pytree.tree_map_with_path(lambda p, x: convert("args" + pytree.keystr(p), x), args)
    kwonly = pytree.tree_map_with_path(lambda p, x: convert("kwargs" + pytree.keystr(p), x), kwonly)
    if problems:
        raise SpecError(problems, headline="bad arguments")
    return args, kwonly


def _describe(call: _Call, leaves, statics: bool = True) -> list[str]:
    """One line per input leaf, and with `statics` per Python value deciding the trace (globals
    and closed-over values the reachable code names), for ranks to compare.

    Ranks must pass the same arguments. A Python value may differ between processes and not
    matter (a library's per-process session id the step never reads): the ranks compare those
    through the programs they plan (`agree_on_compile`, `_check_same_entry`), and the values are
    listed only to say why where the programs differ. Sets are listed sorted: their order is
    each process's own (string hashes are randomized per process)."""
    lines = [f"{path}: {leaf.describe()}" for path, leaf in zip(call.paths(), leaves, strict=True)]
    if not statics:
        return lines
    # (not the Python values modules hold: a rank's own number there is the user's business)
    return lines + [f"{k}: {_canonical_repr(v)}" for k, v in call.state.statics.items()
                    if type(v) is not lift.ModuleValues]


def _canonical_repr(value, depth: int = 0) -> str:
    """`repr`, with the elements of sets (also inside lists, tuples and dicts) sorted."""
    if depth > 8:
        return repr(value)
    if isinstance(value, (set, frozenset)):
        items = sorted(_canonical_repr(v, depth + 1) for v in value)
        return f"{type(value).__name__}({{{', '.join(items)}}})"
    if type(value) in (list, tuple):
        items = [_canonical_repr(v, depth + 1) for v in value]
        return f"[{', '.join(items)}]" if type(value) is list else f"({', '.join(items)}{',' * (len(items) == 1)})"
    if type(value) is dict:
        return "{" + ", ".join(f"{_canonical_repr(k, depth + 1)}: {_canonical_repr(v, depth + 1)}"
                               for k, v in value.items()) + "}"
    return repr(value)


class _OnMeta(TorchDispatchMode):
    """A program called with meta tensors runs on meta: it was traced as on the CPU (meta
    tensors are planned there, `_traced_on`), so the tensors it makes (`torch.arange(n,
    device=x.device)`) and the constants it holds are CPU tensors, moved to meta as each op
    takes them (nothing is computed or allocated, as eager on meta)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = torch.device("meta")
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t if t.device.type == "meta" else t.to("meta"),
                                            (args, kwargs))
        return func(*args, **kwargs)


def execute(program: Program, tensors: list, compile: bool = False, released: list | None = None,
            spent: tuple = ()) -> list[tuple]:
    """Run a program on its mesh's runtime with global tensors or `Sharded` values as inputs;
    per output, the shards this process holds. With `released` (a list, filled here), the
    program's donated inputs are handed over on a distributed mesh: each tensor holding one
    gives up its storage before the program runs, which then frees it after its last use; a
    donated argument's `Sharded` value (`spent`: (input, path) pairs) gives up its shards."""

    def blocks(coords, device):
        orders = program.input_orders or (None,) * len(tensors)
        out = [rank_block(x, lay, coords, device, order)
               for x, lay, order in zip(tensors, program.input_layouts, orders, strict=True)]
        if released is not None:
            _donate(program, tensors, out, released, spent)
        return out

    boxed = released is not None and bool(program.donated) and program.mesh.runtime == "distributed" and not compile
    return run(program, blocks, compile, boxed=boxed)


def _donate(program: Program, tensors: list, blocks: list, released: list, spent: tuple = ()) -> None:
    """Hand the donated inputs' storage over to `blocks` (the only references left to it):
    each holding tensor of lifted state keeps its identity, empty until its new value is
    written back; a donated argument's `Sharded` value is spent. A tensor that shares its
    storage (a view, a block of a flat buffer) or is also fed undonated keeps it."""
    if program.mesh.runtime != "distributed":
        return
    _spend(tensors, spent)
    donated = set(program.donated)
    arguments = {i for i, _ in spent}
    kept = {id(_owner(x)) for i, x in enumerate(tensors) if i not in donated}
    for i in program.donated:
        if i in arguments:
            continue
        owner = _owner(tensors[i])
        if (not isinstance(owner, torch.Tensor) or id(owner) in kept or owner._base is not None
                or owner.untyped_storage().nbytes() != owner.numel() * owner.element_size()):
            continue
        blocks[i] = blocks[i].detach()
        released.append((owner, tuple(owner.shape)))
        kept.add(id(owner))  # the same tensor fed twice is released once
        with torch.no_grad():
            owner.data = torch.empty(0, dtype=owner.dtype, device=owner.device)


def _owner(x):
    return x.shards[0] if isinstance(x, Sharded) else x


def _spend(tensors: list, spent: tuple, err: BaseException | None = None) -> None:
    """Mark the donated arguments' `Sharded` values spent (a global tensor is the caller's)."""
    names = []
    for i, path in spent:
        x = tensors[i]
        if isinstance(x, Sharded):
            x._spend(path)
            names.append(path)
    if err is not None and names:
        err.add_note(f"hpfun: the call failed after consuming its donated arguments (donate_argnums): "
                     f"{', '.join(names)}; their values are lost.")


def _flatten(tree, flat: list, key: list) -> bool:
    """`tree`'s leaves appended to `flat` in pytree order (Sharded values as leaves), and to
    `key` what the program cache keys on: the structure, each tensor's shape, dtype, device,
    requires_grad and (when not contiguous) strides, each Sharded value's signature, other
    values as they are. Tuples, lists and dicts only (False for another pytree node or a NumPy
    array: the general path takes those), walked as `pytree.tree_flatten` walks them."""
    kind = type(tree)
    if kind is tuple or kind is list:
        key.append((kind, len(tree)))
    elif kind is dict:  # (a key other than a string by type and zero's sign: {0.0: a} and {-0.0: a} are two)
        key.append((dict, *(k if type(k) is str else lift.exact_key(k) for k in tree)))
        tree = tree.values()
    else:
        return _flatten_leaf(tree, flat, key)
    for x in tree:
        if type(x) is Sharded:  # the common leaf, inline
            flat.append(x)
            key.append(x.token if x.token is not None else x.signature())
        elif not _flatten(x, flat, key):
            return False
    return True


def _dict_keys(tree, depth: int = 8) -> tuple:
    """The keys other than strings of the dicts in `tree`, by `exact_key` (the pytree structure
    compares them by ==: {0.0: a} and {-0.0: a} were one program), and the classes of the user's
    containers in it (a dataclass or a NamedTuple of theirs: what its class holds, a ClassVar or
    a method, keys the program as a config's class does; `lift.class_key`)."""
    if depth and isinstance(tree, dict):
        return tuple((lift.exact_key(k) if type(k) is not str else k, _dict_keys(v, depth - 1)) for k, v in tree.items())
    if depth and isinstance(tree, (tuple, list)):
        inner = tuple(_dict_keys(v, depth - 1) for v in tree)
        return inner if type(tree) in (tuple, list) or not lift.is_user_class(type(tree)) else \
            (lift.class_key(type(tree)), inner)
    if depth and dataclasses.is_dataclass(tree) and not isinstance(tree, type) and lift.is_user_class(type(tree)):
        return lift.class_key(type(tree)), tuple(_dict_keys(getattr(tree, f.name, None), depth - 1)
                                                 for f in dataclasses.fields(tree))
    return ()


def _flatten_leaf(x, flat: list, key: list) -> bool:
    kind = type(x)
    if kind is Sharded:
        key.append(x.signature())
    elif isinstance(x, torch.Tensor):  # (first: lifted parameters are most leaves, and no container)
        key.append((x.shape, x.dtype, x.device, x.requires_grad) if x.is_contiguous() else
                   (x.shape, x.dtype, x.device, x.requires_grad, x.stride()))
    elif kind in pytree.SUPPORTED_NODES or isinstance(x, (tuple, Sharded)) or _is_numpy(x) or \
            _is_container(x) and register_container(kind):
        return False  # a namedtuple, an OrderedDict, a registered class, a subclass, a BatchEncoding...
    elif lift.is_config_argument(x):  # its values, read into the program, key it
        key.append(("config", kind, lift.object_key(x)))
    else:
        key.append(("static", lift.exact_key(x)))
    flat.append(x)
    return True


def _is_container(x) -> bool:
    """A dataclass instance, a mapping that is not a dict, or a UserList (`register_container`)."""
    return (isinstance(x, (collections.abc.Mapping, collections.UserList)) or dataclasses.is_dataclass(x)) \
        and not isinstance(x, type)


def _is_numpy(x) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def _plain_arity(signature: inspect.Signature | None, n_specs: int | None) -> range:
    """How many positional arguments a call may give, with no keyword arguments, for binding
    to change nothing (`_bind` returns them as they are): every required parameter given, none
    that in_specs covers left to its default; empty when binding may change any call."""
    if signature is None:
        return range(0)
    params = signature.parameters.values()
    if any(p.kind is p.VAR_POSITIONAL or p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in params):
        return range(0)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    return range(max(required, min(n_specs or 0, len(positional))), len(positional) + 1)


def _is_tensor(x) -> bool:
    return isinstance(x, (torch.Tensor, Sharded))


def _short(x, n: int = 60, names: dict | None = None) -> str:
    """`x` for a message, cut at `n` characters: a tensor as its name (`names`: id -> name) or
    its shape and dtype, not its values, also inside sets, tuples, lists and dicts."""
    text = _render(x, names or {})
    return text if len(text) <= n else text[:n - 3] + "..."


def _render(x, names: dict) -> str:
    if x is lift._MISSING:
        return "nothing (not set)"
    if type(x) is lift.Exact:
        x = x.value
    if isinstance(x, torch.Tensor):
        if id(x) in names:
            return names[id(x)]
        kind = "Parameter" if isinstance(x, torch.nn.Parameter) else "tensor"
        return f"{kind}(shape {tuple(x.shape)}, {str(x.dtype).removeprefix('torch.')})"
    if isinstance(x, (set, frozenset)):
        return "{" + ", ".join(sorted(_render(v, names) for v in x)) + "}" if x else "an empty set"
    if type(x) in (tuple, list):
        inner = ", ".join(_render(v, names) for v in x)
        return f"({inner},)" if type(x) is tuple and len(x) == 1 else (f"({inner})" if type(x) is tuple else f"[{inner}]")
    if type(x) is dict:
        return "{" + ", ".join(f"{_render(k, names)}: {_render(v, names)}" for k, v in x.items()) + "}"
    return repr(x)


def _check_unaliased(call: _Call, entry, arguments: int) -> None:
    """An argument the function writes in place must not share memory with another input: the
    program reads every input as it was at the call, so the other would miss the write that
    eager PyTorch lets it see (`f(x, x)` with `x.mul_(2)`)."""
    flat, paths, problems = call.flat, None, []
    tensors = [(i, x) for i, x in enumerate(flat) if isinstance(x, (torch.Tensor, Sharded))]
    for i in entry.written:
        x = flat[i]
        if i >= arguments or not isinstance(x, (torch.Tensor, Sharded)):
            continue
        if any(torch._debug_has_internal_overlap(t) == 1 for t in (x.shards if type(x) is Sharded else (x,))):
            paths = paths or call.paths()
            problems.append(Problem(paths[i], "has elements that share memory (an expand() or another stride-0 view), "
                                    "and the function writes it in place: its new values cannot be written back "
                                    "into it", "pass a tensor that owns its elements (`x.clone()` or "
                                    "`x.contiguous()`)"))
            continue
        if _no_elements(x):  # (an empty tensor shares no element with any: its storage's address is 0)
            continue
        storage = _storage(x)
        for j, y in tensors:
            if j != i and not _no_elements(y) and _storage(y) == storage:
                paths = paths or call.paths()
                problems.append(Problem(f"{paths[i]} and {paths[j]}", f"share memory, and the function writes "
                                        f"{paths[i]} in place: the program reads each input as it was at the call, so "
                                        f"{paths[j]} would not see the write as it does in eager PyTorch",
                                        "pass tensors that do not share memory (`x.clone()` for one of them)"))
    if problems:
        raise SpecError(problems, headline="an argument written in place shares memory")


def _no_elements(x) -> bool:
    return math.prod(x.global_shape if type(x) is Sharded else x.shape) == 0


def _storage(x) -> int:
    """Where a tensor's elements live (a Sharded value's: its first shard's, the same object
    passed twice sharing it)."""
    return (x.shards[0] if type(x) is Sharded else x).untyped_storage().data_ptr()


def _byte_range(x: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of its storage a tensor's elements span: [first, last + 1)."""
    if x.numel() == 0:
        return None
    start = x.storage_offset() * x.element_size()
    return start, start + (sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True)) + 1) * x.element_size()


def _check_written_state_unaliased(call: _Call, entry) -> None:
    """At a program's first call: an input the function writes in place (lifted state too: a
    global counter, a parameter an optimizer updates) must not overlap another input the program
    reads (a view of it held in another global, `row = model.weight[0]`), which it would read
    as it was at the call where eager sees the write. Checked by the bytes each spans of its
    storage: parameters laid out side by side in one buffer do not overlap."""
    flat, by_storage = call.flat, {}
    for i in dict.fromkeys([*entry.fed_flat, *entry.written]):
        x = flat[i]
        if type(x) is Sharded or not isinstance(x, torch.Tensor) or x.device.type == "meta":
            continue
        span = _byte_range(x)
        if span is not None:
            by_storage.setdefault(x.untyped_storage().data_ptr(), []).append((i, span))
    fed, problems, paths = set(entry.fed_flat), [], None
    arguments = len(flat) - len(call.lifted)  # (two arguments: checked at every call, `_check_unaliased`)
    for group in (g for g in by_storage.values() if len(g) > 1):
        for i, (a0, a1) in group:
            if i not in entry.written:
                continue
            for j, (b0, b1) in group:
                if j != i and j in fed and a0 < b1 and b0 < a1 and not (i < arguments and j < arguments):
                    paths = paths or call.paths()
                    problems.append(Problem(f"{paths[i]} and {paths[j]}", f"share memory, and the function writes "
                                            f"{paths[i]} in place: the program reads each input as it was at the "
                                            f"call, so {paths[j]} would not see the write as it does in eager PyTorch",
                                            "read the written tensor itself inside the function (not a view of it "
                                            "made outside), or keep a copy (`.clone()`)"))
    if problems:
        raise SpecError(problems, headline="inputs share memory with an input written in place")


def _check_configs_unchanged(call: _Call, leaves) -> None:
    """A config object argument the trace changed (a counter it incremented) would change once,
    not at every call: refused, as a changed global is."""
    problems = []
    for path, x, leaf in zip(call.paths(), call.flat, leaves, strict=False):
        if not isinstance(leaf.value, _Config) or lift.object_key(x) == leaf.value.key:
            continue
        key, now_key = leaf.value.key, lift.object_key(x)
        named = all(type(k) is tuple and len(k) == 2 and type(k[1]) is tuple for k in (key, now_key))  # (an
        before, found = dict(key[1]) if named else {}, len(problems)  # object's values by name; not a function's)
        for name, was, now in lift.class_changes(key, now_key, x):  # (`type(c).n += 1`: named, and set back)
            problems.append(Problem(f"{path}: {name}", f"changed from {_short(was)} to {_short(now)} while the "
                                    "function was traced", "a traced program cannot repeat Python side effects: make "
                                    "this change outside the sharded function, or pass the value as a tensor and "
                                    "return its new value"))
        for name, now in now_key[1] if named else ():
            if before.get(name, now) != now:
                problems.append(Problem(f"{path}.{name}", f"changed from {_short(before[name])} to {_short(now)} while "
                                        "the function was traced", "a traced program cannot repeat Python side "
                                        "effects: make this change outside the sharded function, or pass the value "
                                        "as a tensor and return its new value"))
                if isinstance(before[name], lift.Exact):
                    setattr(x, name, before[name].value)  # as it was: the call that changed it is refused
        if len(problems) == found:  # an attribute added or removed
            problems.append(Problem(path, "changed while the function was traced", "a traced program cannot repeat "
                                    "Python side effects: make this change outside the sharded function"))
    if problems:
        raise CaptureError(problems, headline="the function changes Python state")


def _not_a_value(x) -> bool:
    """An argument hpfun cannot bake into a program: state (lifted only when the function
    reaches it itself) or an iterator (the trace would consume it)."""
    return isinstance(x, (torch.nn.Module, torch.optim.Optimizer, collections.abc.Iterator))


def _refuse_not_dense(paths: list, leaves: list) -> None:
    """A SpecError naming every sparse, nested or other non-strided tensor among the inputs:
    hpfun splits dense tensors (checked where a call compiles, and where one cannot be keyed)."""
    problems = []
    for path, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor):
            continue
        masked = type(x).__name__ == "MaskedTensor"
        if x.is_nested or x.layout is not torch.strided or x.is_quantized or masked:
            kind = ("a nested" if x.is_nested else "a quantized" if x.is_quantized else "a masked" if masked
                    else f"a {str(x.layout).removeprefix('torch.')}")
            fix = ("pad it into a dense tensor (torch.nested.to_padded_tensor) and pass a mask" if x.is_nested else
                   "dequantize it (`.dequantize()`) or keep the float tensor" if x.is_quantized else
                   "pass its data and its mask as two tensors (`.get_data()`, `.get_mask()`) and mask inside"
                   if masked else "use a dense tensor instead (`.to_dense()`)")
            problems.append(Problem(path, f"is {kind} tensor: hpfun splits dense (strided) tensors only", fix))
    if problems:
        raise SpecError(problems)


def _argument_problem(path: str, x) -> Problem:
    if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
        kind = "an nn.Module" if isinstance(x, torch.nn.Module) else "an optimizer"
        return Problem(path, f"is {kind} ({type(x).__name__}) passed as an argument: hpfun lifts the modules and "
                       "optimizers the function closes over or reads as globals, not arguments",
                       "close over it instead: `@hpfun.shard(...) def step(x): loss = model(x) ...` with `model` "
                       "defined outside (a factory: `def make_step(model, opt): @hpfun.shard(...) def step(x): ...`)")
    if isinstance(x, collections.abc.Iterator):
        return Problem(path, f"is an iterator ({type(x).__name__}): the trace would consume it, and later calls "
                       "would not see its values", "pass a list or a tuple (or the tensors it yields)")
    if _holds_tensors(x, 3):  # (a graph library's batch object: `step(data)`)
        return Problem(path, f"is a {type(x).__name__} holding tensors, which hpfun does not read as a container "
                       "(it reads tensors in dicts, lists, tuples, dataclasses, Mappings and UserLists)",
                       "pass its tensors as arguments (`step(data.x, data.edge_index)`), or a dict of them, or close "
                       "over the object (the tensors it holds are then read at every call)")
    return Problem(path, f"is {_short(x)}, which is not hashable: a value that is not a "
                   "tensor is baked into the program and keys its cache",
                   "pass a tensor, or a hashable value (a tuple, a frozenset)")


def _holds_tensors(x, depth: int) -> bool:
    """Whether `x` holds a tensor within `depth` levels of attributes, dicts and lists."""
    if isinstance(x, torch.Tensor):
        return True
    if depth <= 0 or lift._is_scalar(x) or isinstance(x, (str, bytes, type)):
        return False
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else \
        (lift._own_dict(x) or {}).values()
    return any(_holds_tensors(v, depth - 1) for v in list(items)[:64])


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _leaf(x, layout, requires_grad: bool = False) -> _Leaf:
    if isinstance(x, Sharded):
        return _Leaf("tensor", x.global_shape, x.dtype, x.layout, device=_run_device(x.layout.mesh, x.shards[0]),
                     requires_grad=requires_grad and (x.dtype.is_floating_point or x.dtype.is_complex))
    if isinstance(x, torch.Tensor):
        return _Leaf("tensor", tuple(x.shape), x.dtype, layout, device=_run_device(layout.mesh, x),
                     requires_grad=requires_grad and x.requires_grad and (x.dtype.is_floating_point or x.dtype.is_complex),
                     strides=None if x.is_contiguous() else tuple(x.stride()))
    if lift.is_config_argument(x):
        return _Leaf("static", value=_Config(lift.object_key(x), _config_text(x)))
    return _Leaf("static", value=x, exact=lift.exact_key(x))  # (1, 1.0 and True equal, and trace three programs)


@attrs.frozen
class ArgumentEdit:
    """A value the function put in a dict or list passed to it, at `key` of the container the
    keys `at` reach from the arguments (`path` names it), rebuilt from `tree` with its tensors
    (program outputs, Sharded as returned ones are) and `statics`; or the keys it removed."""

    path: str
    at: tuple  # ("args", i, key, ...) or ("kwargs", name, key, ...)
    key: object
    tree: object
    statics: dict
    tensors: int
    removed: tuple = ()
    container: str = "dict"  # "dict" (or another mapping), "list", or "object" (a dataclass's attributes)

    def where(self) -> str:
        if self.key is None:
            return self.path
        return self.path + pytree.keystr((pytree.GetAttrKey(self.key) if self.container == "object"
                                          else pytree.MappingKey(self.key),))

    def kind(self) -> str:
        return self.container


def _read_places(reads) -> list[str]:
    """Each read's `_read_place`, a repeated one numbered (two reads on one line, one line read
    at every turn of a loop): the ranks' lines are compared place by place."""
    places = [_read_place(r.where) for r in reads]
    seen: dict = {}
    out = []
    for place in places:
        seen[place] = seen.get(place, 0) + 1
        out.append(place if places.count(place) == 1 else f"{place} (read {seen[place]})")
    return out


def _read_place(where: str) -> str:
    """'the value read at file:line (code)' for a read's ' at file:line: code', with no ': ' in
    it (the ranks' lines are split there into place and value)."""
    place, _, code = where.strip().removeprefix("at ").partition(": ")
    return f"the value read at {place}" + (f" ({code.replace(': ', ':')})" if code else "")


def _attribute_path(path: str, attr: str) -> str:
    return path + pytree.keystr((pytree.GetAttrKey(attr),))


def _argument_containers(args: tuple, kwonly: dict) -> list:
    """(path, keys reaching it, container, a copy of its items) of every dict, list, other
    mutable mapping (transformers' BatchEncoding) and dataclass instance (its attributes) among
    the arguments the function gets, nested ones too (paths as `call.paths()` names them; an
    attribute's key in `at` is a `GetAttrKey`)."""
    out, seen = [], set()

    def walk(x, path: str, at: tuple, depth: int) -> None:
        if depth > 8 or id(x) in seen:
            return
        if not isinstance(x, (tuple, torch.Tensor, str, bytes, type)):
            seen.add(id(x))
        if isinstance(x, (collections.UserList, collections.UserDict)) or isinstance(x, dict) and type(x) is not dict \
                and lift._own_dict(x) is not None:  # (its attributes, set as a dataclass's; a dict subclass's too)
            out.append((path, at, x, container_attributes(x), True))
        if type(x) is list or isinstance(x, collections.UserList):  # (a UserList: appended to as a list)
            out.append((path, at, x, list(x)))
            items = [(pytree.SequenceKey(k), k, v) for k, v in enumerate(x)]
        elif isinstance(x, collections.abc.MutableMapping):
            out.append((path, at, x, dict(x.items())))
            items = [(pytree.MappingKey(k), k, v) for k, v in x.items()]
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):  # a dataclass: its attributes (slots too)
            held = dataclass_items(x)
            out.append((path, at, x, held))
            items = [(pytree.GetAttrKey(k), pytree.GetAttrKey(k), v) for k, v in held.items()]
        elif type(x) is tuple:
            items = [(pytree.SequenceKey(k), k, v) for k, v in enumerate(x)]
        elif isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple: its fields (the dicts they hold)
            items = [(pytree.GetAttrKey(k), pytree.GetAttrKey(k), v) for k, v in zip(x._fields, x)]
        else:
            return
        for key, step, v in items:
            walk(v, path + pytree.keystr((key,)), (*at, step), depth + 1)

    for i, a in enumerate(args):
        walk(a, f"args[{i}]", ("args", i), 0)
    for k, v in kwonly.items():
        walk(v, f"kwargs[{k!r}]", ("kwargs", k), 0)
    return out


def _shared_as_given(given, rebuilt, seen: dict):
    """`rebuilt` (the arguments as the trace gets them, rebuilt from their leaves) with a dict or
    list the caller passed in several places one object in all of them, as the caller's is: an
    edit through one is seen through the other, as in eager."""
    if dataclasses.is_dataclass(given) and not isinstance(given, type) and type(rebuilt) is type(given) \
            and not isinstance(given, collections.abc.Mapping):  # (`f(x, st, st)`: one object, edits through either)
        if id(given) in seen:
            return seen[id(given)]
        seen[id(given)] = rebuilt
        for name, value in dataclass_items(given).items():
            if hasattr(rebuilt, name):
                object.__setattr__(rebuilt, name, _shared_as_given(value, getattr(rebuilt, name), seen))
        return rebuilt
    if isinstance(given, (dict, list)):
        if id(given) in seen:
            return seen[id(given)]
        seen[id(given)] = rebuilt
        if isinstance(given, dict) and isinstance(rebuilt, dict) and given.keys() == rebuilt.keys():
            for key in given:
                rebuilt[key] = _shared_as_given(given[key], rebuilt[key], seen)
        elif type(given) is list and type(rebuilt) is list and len(given) == len(rebuilt):
            rebuilt[:] = [_shared_as_given(g, r, seen) for g, r in zip(given, rebuilt, strict=True)]
        return rebuilt
    if type(given) is tuple and type(rebuilt) is tuple and len(given) == len(rebuilt):
        return tuple(_shared_as_given(g, r, seen) for g, r in zip(given, rebuilt, strict=True))
    return rebuilt


def _argument_at(call: _Call, at: tuple):
    """The caller's container the keys `at` reach."""
    args, kwonly = call.given or (call.args, call.kwonly)  # (the caller's own, where NumPy arrays were read)
    x = args if at[0] == "args" else kwonly
    for key in at[1:]:
        x = getattr(x, key.name) if isinstance(key, pytree.GetAttrKey) else x[key]
    return x


def _put_edits(edits: tuple, call: _Call, results: list) -> list:
    """Put what the function put in its argument containers in the caller's (their tensors
    the results after the function's own outputs); the function's own results."""
    k = len(results) - sum(edit.tensors for edit in edits)
    own, it = results[:k], iter(results[k:])
    targets = [_argument_at(call, edit.at) for edit in edits]  # (each found before any edit moves it)
    for edit, container in zip(edits, targets, strict=True):
        if edit.removed:
            if edit.container == "list":
                del container[edit.removed[0]:]
            elif edit.container == "object":
                for key in edit.removed:
                    if hasattr(container, key):
                        delattr(container, key)
            else:
                for key in edit.removed:
                    container.pop(key, None)
            continue
        leaves = [edit.statics[i] if i in edit.statics else next(it) for i in range(edit.tree.num_leaves)]
        value = pytree.tree_unflatten(leaves, edit.tree)
        if edit.container == "object":
            setattr(container, edit.key, value)
        elif edit.container == "list" and edit.key >= len(container):
            container.append(value)
        else:
            container[edit.key] = value
    return own


def _check_grad_shapes(call: _Call) -> None:
    """A gradient of another shape than its parameter (left from before the parameter was
    resized) cannot be given to the trace's stand-in: refused by name before tracing."""
    lifted = call.lifted
    if stale := [name for name, slot in call.state.slots.items() if name in lifted and name.endswith(".grad")
                 and slot.follows in lifted and isinstance(lifted[name], (torch.Tensor, Sharded))
                 and tuple(lifted[name].shape) != tuple(lifted[slot.follows].shape)]:
        raise SpecError([Problem(name, f"has shape {tuple(lifted[name].shape)} where its parameter has "
                                 f"{tuple(lifted[name[:-len('.grad')]].shape)} (a gradient left from before the "
                                 "parameter was resized: resize_token_embeddings keeps the Parameter and swaps "
                                 "its data), which a trace cannot give the parameter",
                                 "set it to None before the call (opt.zero_grad() or model.zero_grad())")
                         for name in stale], headline="gradients of another shape than their parameters")


def _attributes_set(before: list, paths: list) -> list:
    """(path, lifted tensor, attribute, how, new value or _UNSET) of each Python attribute the
    function set, changed or deleted on a lifted tensor's stand-in (`p.seen += 1`, `p.snap =
    p.detach().clone()`); torch's own hook lists are checked apart."""
    out = []
    for i, owner, fake, was in before:
        now = fake.__dict__
        for key in [k for k in now if k not in was] + [k for k in was if now.get(k, _UNSET) is not was[k]]:
            if key in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                continue
            how = "set" if key not in was else "deleted" if key not in now else f"changed from {_short(was[key])}"
            out.append((paths[i], owner, key, how, now.get(key, _UNSET)))
    return out


class _TensorAttribute:
    """A Python attribute of a lifted tensor that every call sets (or deletes) as the trace did."""

    def __init__(self, tensor: torch.Tensor, key: str):
        self.tensor, self.key = tensor, key

    def set(self, value) -> None:
        if value is _UNSET:
            self.tensor.__dict__.pop(self.key, None)
        else:
            setattr(self.tensor, self.key, weakref.ref(value.tensor) if type(value) is _WeakTo else value)


@attrs.frozen(eq=False)
class _WeakTo:
    """The value of a tensor attribute the function set to a weak reference to a lifted tensor:
    each call sets a new weak reference to it."""

    tensor: torch.Tensor


_UNSET = object()


def _held_owner(x):
    """The tensor a block a distributed call left stands for (the module's, which holds its
    flags and hooks); `x` itself otherwise."""
    return x.shards[0] if isinstance(x, Sharded) and x.layout.mesh.runtime == "distributed" else x


def _config_text(x) -> str:
    """A config object as ranks compare it and messages show it: its repr, or where its class
    has none of its own (`object.__repr__` names the address, each process's own) its class
    and the values it holds."""
    return _config_value_text(x, 0)


def _config_value_text(x, depth: int) -> str:
    if depth > 6:
        return "..."
    if isinstance(x, (set, frozenset)):
        return f"{type(x).__name__}({{{', '.join(sorted(_config_value_text(v, depth + 1) for v in x))}}})"
    if type(x) in (list, tuple):
        inner = ", ".join(_config_value_text(v, depth + 1) for v in x)
        return f"[{inner}]" if type(x) is list else f"({inner}{',' * (len(x) == 1)})"
    if type(x) is dict:
        return "{" + ", ".join(f"{_config_value_text(k, depth + 1)}: {_config_value_text(v, depth + 1)}"
                               for k, v in x.items()) + "}"
    if type(x).__repr__ is object.__repr__ or isinstance(x, types.SimpleNamespace):  # (SimpleNamespace's repr
        held = getattr(x, "__dict__", None)  # shows a set as it is ordered in this process)
        values = ", ".join(f"{k}={_config_value_text(v, depth + 1)}" for k, v in held.items()) \
            if isinstance(held, dict) else "..."
        return f"{type(x).__qualname__}({values})"
    return repr(x)


@attrs.frozen
class _Config:
    """A config object argument in a cache key: equal by the values it holds (`lift.object_key`),
    which the program has read; shown as the object."""

    key: object
    text: str = attrs.field(eq=False)

    def __repr__(self) -> str:
        return self.text


def _run_device(mesh: Mesh, x: torch.Tensor) -> torch.device:
    """A distributed program runs on its ranks' device (inputs are moved there); a simulated
    one where its inputs are."""
    return runtime_for(mesh).device if mesh.runtime == "distributed" else x.device
