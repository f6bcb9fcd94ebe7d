"""Writing state back: what a call changed in place, applied when it returns, as eager would.

A program's outputs beyond the function's own are written back after each call: into an
argument modified in place (a global tensor gets the full value; a `Sharded` argument its new
shards), into lifted state (a module's parameter or buffer, a gradient, an optimizer's state),
and into places the function assigned (a first `.grad`, an optimizer's first state).

On a simulated mesh the full value is written back. On a distributed mesh lifted state stays
sharded between calls: each rank's tensor holds its block (`tensor.data` is replaced, so a
parameter stays the same object an optimizer knows), and a registry remembers its layout and
global shape, so the next call reads it as the block it is. `gather_state` brings the full
values back.
"""

from __future__ import annotations

import itertools
import weakref

import attrs
import torch
from torch.utils import _pytree as pytree

from hpfun import lift
from hpfun.errors import ExecutionError, Problem
from hpfun.layout import Layout
from hpfun.runtime.distributed import runtime_for
from hpfun.sharded import Sharded, local_block, signature, unchecked


class _Blocks:
    """tensor -> entry: lifted state a distributed call left sharded (layout, global shape,
    data pointer), or donated state a failed call lost (version, data pointer). Keyed by id with a weak reference to the tensor (read at every call for every
    lifted tensor, so a plain dict lookup; torch's WeakIdKeyDictionary builds a key object
    per lookup); an entry goes when its tensor is freed."""

    def __init__(self):
        self._entries: dict = {}  # id -> (weak reference, entry)

    def get(self, x):
        found = self._entries.get(id(x))
        return found[1] if found is not None and found[0]() is x else None

    def __setitem__(self, x, entry) -> None:
        key = id(x)
        entries = self._entries
        found = entries.get(key)
        if found is not None and found[0]() is x:  # a block written back into the same tensor again
            entries[key] = (found[0], entry)
            return

        def gone(ref):  # only this tensor's entry: its id may be another's by now
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        self._entries[key] = (weakref.ref(x, gone), entry)

    def pop(self, x, default=None):
        found = self._entries.get(id(x))
        if found is None or found[0]() is not x:
            return default
        del self._entries[id(x)]
        return found[1]

    def __len__(self) -> int:
        return len(self._entries)


_LOCAL = _Blocks()


def held_block(x: torch.Tensor) -> Sharded | None:
    """`x` as the Sharded value it holds a block of, if a distributed call left it so (and it
    still holds that block: replacing its data makes it a plain tensor again)."""
    entry = _LOCAL.get(x)
    if entry is None:
        return None
    layout, shape, ptr, local, token = entry
    if x.data_ptr() != ptr or x.shape != local:
        _LOCAL.pop(x)
        return None
    return unchecked(layout, shape, (x,), token)  # its local shape checked just above


# tensor -> (version, data pointer): donated state a failed call lost
_LOST = _Blocks()


def lose(released: list, err: BaseException) -> None:
    """A call that was handed state (`donate_state=True`) failed before writing new values
    back: each tensor gets storage of its shape again, with undefined values, and is recorded
    as lost until something is written into it; `err` says so."""
    if not released:
        return
    for owner, shape in released:
        entry = _LOCAL.get(owner)
        with torch.no_grad():
            owner.data = torch.empty(shape, dtype=owner.dtype, device=owner.device)
        if entry is not None:  # still the block it was: its layout stays known
            _hold(owner, entry[0], entry[1])
        _LOST[owner] = (owner._version, owner.data_ptr())
    err.add_note(f"hpfun: this call was handed {len(released)} tensors of lifted state (donate_state=True) and "
                 "failed before writing their new values back: their values are lost. Load them again (e.g. "
                 "model.load_state_dict, or a checkpoint) before the next call; on a distributed mesh, which a "
                 "failed program retires, restart the job from the last checkpoint.")


def lost(values) -> list[str]:
    """Names among `values` (name -> lifted value) of donated state a failed call lost, and
    nothing has been written into since."""
    names = []
    for name, x in values.items():
        x = x.shards[0] if isinstance(x, Sharded) else x
        found = _LOST.get(x) if isinstance(x, torch.Tensor) else None
        if found is None:
            continue
        if (x._version, x.data_ptr()) != found:  # new values loaded since
            _LOST.pop(x)
            continue
        names.append(name)
    return names


# tensor -> data pointer: lifted state a distributed call left whole (a replicated layout)
_WHOLE = _Blocks()


def _hold(x: torch.Tensor, layout: Layout, shape: tuple) -> None:
    if layout.is_replicated:
        _LOCAL.pop(x, None)
        _WHOLE[x] = x.data_ptr()
    else:  # (its block's shape and its signature's token, made once: read at every call)
        shape = tuple(shape)
        _LOCAL[x] = (layout, shape, x.data_ptr(), layout.local_shape(shape), signature(layout, shape, x.dtype))


@attrs.frozen
class WriteBack:
    """Where one extra output of a program goes.

    `input`: the index of a flat input (argument leaf or lifted tensor) the function modified
    in place; otherwise `slot`: the name of the lifted slot the function assigned; for an
    optimizer's first state, `optimizer`, `param` and `key`; for a tensor the function put into
    a module that did not hold it (a cache made in a forward), its `place`."""

    layout: Layout
    shape: tuple
    name: str  # what is written: an argument's path or a lifted slot's name
    input: int | None = None
    slot: str | None = None
    optimizer: str | None = None
    param: str | None = None
    key: str | None = None
    place: tuple | None = None  # a tensor the step put into a module: where (`lift.put`)
    same_as: int | None = None  # the write whose tensor this place gets too (the step stored one tensor at both)
    moved: int | None = None  # the input whose tensor the step put at this place (`s.a = s.b`): that tensor itself


def apply(writes, shards_per_output, inputs: list, state) -> None:
    """Write every extra output back: in-place updates first, then assignments (a gradient
    must meet its parameter's new block)."""
    order, replicated, first_state = _order(writes)
    if _SHAPES_SEEN.get(id(writes)) is not writes:
        _check_shapes(writes, shards_per_output)
    targets, sources, scalars = [], [], []  # whole state updated in place: copied in one foreach call
    scalar_names = state.scalar_names if state is not None else ()
    held = _LOCAL._entries
    owned = None  # on a distributed mesh, the ids of modules' and optimizers' state (`module_state`)
    kept = None  # and with the tensors modules keep as attributes (an assigned slot's owner)
    taken: set = set()  # ids of the program's blocks given to a slot: one output written to two slots (two
    # momentum buffers of equal gradients, one value in the program) is copied for the second, or they shared storage
    made: dict = {}  # j -> the tensor an assigned write put in place: a later write `same_as` j puts that one too
    # each optimizer's first state goes to the parameter the step read, read before any place is written (a step
    # swapping two parameters of a ParameterDict put the first's new state at the second's key)
    params = {name: state.slots[name].read() for name in first_state}
    with torch.no_grad():
        for j in order:
            wb, shards = writes[j], shards_per_output[j]
            if j in replicated and type(target := inputs[wb.input]) is not Sharded \
                    and tuple(target.shape) == wb.shape:  # the common case, inline: whole state, updated in place
                targets.append(target)
                sources.append(shards[-1])  # (a simulated mesh's last rank's, as `full()` places blocks)
                if id(target) in held:  # a block before: whole from now on
                    _LOCAL.pop(target, None)
                if wb.name in scalar_names:
                    scalars.append((state.slots[wb.name], target))
                continue
            if wb.input is not None and type(target := inputs[wb.input]) is Sharded \
                    and [a.shape for a in target.shards] == [b.shape for b in shards]:
                targets += target.shards  # a split argument or held block: its new shards, in place
                sources += shards
                if wb.name in scalar_names:
                    scalars.append((state.slots[wb.name], target))
                continue
            if targets:  # (before anything that may read them: a gradient meets its parameter's new value)
                _copy(targets, sources, scalars)
            value = unchecked(wb.layout, wb.shape, shards)  # a program output, as planned
            moved = inputs[wb.moved] if wb.moved is not None else None
            if type(moved) is Sharded and len(moved.shards) == 1 and _LOCAL.get(moved.shards[0]) is not None:
                moved = moved.shards[0]  # a block a distributed call left held: that tensor itself moves
            lifted = type(moved) in (torch.Tensor, torch.nn.Parameter)  # (a parameter too: a swap of a ParameterDict's)
            if wb.same_as is not None and wb.same_as in made or lifted:
                # one tensor the step stored at two places; or a lifted tensor it put at another place (a swap), which
                new = made[wb.same_as] if not lifted else moved  # its in-place update reached
                made[j] = new
                if wb.place is not None:
                    lift.put(state, wb.place, new)
                elif wb.optimizer is not None:
                    state.root(wb.optimizer).state[params[wb.param]][wb.key] = new
                else:
                    state.slots[wb.slot].write(new)
                continue
            if wb.input is not None:
                target = inputs[wb.input]  # (a block held from an earlier call is a module's: no walk at every step)
                whole = False
                if value.layout.mesh.runtime == "distributed" and state is not None and id(target) not in held:
                    owned = module_state(state.roots) if owned is None else owned
                    whole = id(target) not in owned
                _update(target, value, whole=whole, taken=taken)
                slot = state.slots.get(wb.name) if state is not None else None
                if slot is not None and slot.scalar:  # a lifted float hyperparameter, read as a tensor, updated in place
                    slot.write(inputs[wb.input])
            elif wb.place is not None:
                lift.put(state, wb.place, made.setdefault(j, _new_tensor(value, taken=taken)))
            elif wb.optimizer is not None:
                opt = state.root(wb.optimizer)
                param = params[wb.param]
                _meet(param, value)
                opt.state[param][wb.key] = made.setdefault(j, _new_tensor(value, taken=taken))
            else:
                slot = state.slots[wb.slot]
                if slot.follows in state.slots:
                    _meet(state.slots[slot.follows].read(), value)
                like = slot.read()
                whole = False  # (a block held from an earlier call is a module's: no walk at every step)
                if value.layout.mesh.runtime == "distributed" and slot.follows is None and \
                        isinstance(like, torch.Tensor) and id(like) not in held:
                    kept = module_state(state.roots, attributes=True) if kept is None else kept
                    whole = id(like) not in kept  # a plain object's tensor, a dict's or list's: whole
                slot.write(made.setdefault(j, _new_tensor(value, like=like, whole=whole, taken=taken)))
        if targets:
            _copy(targets, sources, scalars)


_SHAPES_SEEN: dict = {}  # id(writes) -> writes whose program's blocks had the planned shapes at a call


def _check_shapes(writes, shards_per_output) -> None:
    """Before anything is written: every block a program returns for state has the shape its
    layout plans, or nothing is written (a kernel whose shape function says otherwise than it
    computes, torch.ao's fused observer growing a per-channel scale from [1] to [16], failed
    inside the write-back, after some state was written). Checked at a program's first call."""
    bad = [(wb, tuple(block.shape), wb.layout.local_shape(wb.shape)) for wb, shards in zip(writes, shards_per_output)
           for block in shards[:1] if isinstance(block, torch.Tensor)
           and tuple(block.shape) != wb.layout.local_shape(wb.shape)]
    if bad:
        raise ExecutionError([Problem(wb.name, f"the program computed a block of shape {got} where its trace planned "
                                      f"{want} (global {tuple(wb.shape)}): an op computes another shape than torch's "
                                      "shape function for it says, so nothing was written back",
                                      "give the tensor its final shape before the first sharded call (run one step "
                                      "eagerly first: torch.ao's observers size their per-channel scale at their first "
                                      "forward), or make a new tensor instead of resizing one in place")
                              for wb, got, want in bad], headline="the program's state has other shapes than planned")
    if len(_SHAPES_SEEN) > 256:
        _SHAPES_SEEN.clear()
    _SHAPES_SEEN[id(writes)] = writes


def _copy(targets: list, sources: list, scalars: list) -> None:
    """The pending in-place updates of whole state, in one call (84 tensors of an HF Llama step
    cost a Python round trip each as separate copies); the lists are emptied."""
    torch._foreach_copy_(targets, sources)
    for slot, target in scalars:  # a lifted float hyperparameter, read as a tensor, updated in place
        slot.write(target)
    targets.clear()
    sources.clear()
    scalars.clear()


_ORDERS: dict = {}  # id(writes) -> (writes, order, replicated, first_state): a program's writes, planned once


def _order(writes) -> tuple[list, frozenset, tuple]:
    """The order `apply` writes in (in-place updates first), the in-place updates of whole
    values into state: each is a copy of the rank's replica (on a simulated mesh, of the last
    rank's, the block `Sharded.full()` keeps), all in one foreach call; and the parameters whose
    first optimizer state the program makes, by slot name."""
    found = _ORDERS.get(id(writes))
    if found is not None and found[0] is writes:
        return found[1:]
    order = sorted(range(len(writes)), key=lambda j: writes[j].input is None)
    replicated = frozenset(j for j, wb in enumerate(writes) if wb.input is not None and wb.layout.is_replicated)
    if len(_ORDERS) > 256:
        _ORDERS.clear()
    first_state = tuple(dict.fromkeys(wb.param for wb in writes if wb.optimizer is not None))
    _ORDERS[id(writes)] = (writes, order, replicated, first_state)
    return order, replicated, first_state


def clear(cleared, state) -> None:
    """Slots the function emptied (`zero_grad()` sets `.grad` to None) or set to a Python number,
    as (slot, value) pairs; a further place of a lifted tensor (`State.aliases`) by its name."""
    for name, value in cleared:
        slot = state.slots.get(name)
        (slot.write if slot is not None else next(itertools.chain(
            (w for n, _, w, _ in state.aliases if n == name), (w for n, w in state.shared_writes if n == name))))(value)


def module_state(roots, attributes: bool = False) -> set:
    """ids of the parameters and buffers of the modules, and the state of the optimizers, among
    `roots`: the state hpfun holds as blocks between distributed calls (a plain object's
    tensor, or one in a dict closed over, stays whole: eager code outside reads all of it).
    `attributes`: the tensors the modules keep as attributes too."""
    out = set()
    for root in roots:
        if isinstance(root.value, torch.nn.Module):
            out.update(map(id, root.value.parameters()))
            out.update(map(id, root.value.buffers()))
            if attributes:
                out.update(id(v) for m in root.value.modules() for v in vars(m).values() if isinstance(v, torch.Tensor))
        elif isinstance(root.value, torch.optim.Optimizer):
            for entries in root.value.state.values():  # (a tensor under a key of the optimizer's own: itself)
                held = entries.values() if isinstance(entries, dict) else (entries,)
                for t in held:  # (a list or dict of tensors under a parameter: each is state, `lift._tensor_sequence`)
                    if isinstance(t, torch.Tensor):
                        out.add(id(t))
                    elif lift._tensor_sequence(t):
                        out.update(id(x) for _, x in lift._tensor_items(t))
    return out


def _update(target, value: Sharded, whole: bool = False, taken: set | None = None) -> None:
    """An input modified in place: a Sharded argument gets its new shards, a tensor its value
    (`whole`: on a distributed mesh too, gathered, where it is not a module's or optimizer's)."""
    if isinstance(target, Sharded):
        for old, new in zip(target.shards, value.shards, strict=True):
            if tuple(old.shape) == tuple(new.shape):
                old.copy_(new)
            else:  # a held block the call was handed (donate_state): it takes the new block
                old.data = new
                _hold(old, value.layout, value.global_shape)
        return
    if value.layout.mesh.runtime == "simulated":
        target.copy_(value.full())
    elif value.layout.is_replicated and tuple(target.shape) == tuple(value.global_shape):
        target.copy_(value.shards[0])
        _hold(target, value.layout, value.global_shape)
    elif whole:  # (every rank writes back the same values in the same order: the gather pairs up)
        full = value.full()
        if tuple(target.shape) == tuple(full.shape):
            target.copy_(full)
        else:
            target.data = full
        _LOCAL.pop(target, None)
    else:  # lifted state on a distributed mesh: the rank keeps its block
        target.data = _untaken(value.shards[0], taken)
        _hold(target, value.layout, value.global_shape)


def _meet(param, value: Sharded) -> None:
    """A parameter whose gradient or optimizer state is written back as a block becomes its own
    block too, if the call left it whole (it was read, not updated): torch requires a gradient
    of its parameter's shape, and the next call must read both in one layout."""
    mesh = value.layout.mesh
    if (mesh.runtime != "distributed" or value.layout.is_replicated or not isinstance(param, torch.Tensor)
            or held_block(param) is not None or tuple(param.shape) != tuple(value.global_shape)):
        return
    param.data = local_block(param.detach(), value.layout, runtime_for(mesh).coords).clone()
    _hold(param, value.layout, value.global_shape)


def keep_blocks(read: list) -> None:
    """Lifted state a distributed call read split and did not write (a frozen weight under
    ZeRO or tensor parallelism: `(tensor, layout, global shape)` each) becomes this rank's block,
    as written state does: each rank holds its share between calls, not the whole tensor."""
    for tensor, layout, shape in read:
        if held_block(tensor) is None and tuple(tensor.shape) == tuple(shape) and not tensor.requires_grad:
            tensor.data = local_block(tensor.detach(), layout, runtime_for(layout.mesh).coords).clone()
            _hold(tensor, layout, shape)


def _untaken(block: torch.Tensor, taken: set | None) -> torch.Tensor:
    """`block`, or a copy where an earlier write of this call gave it to another slot."""
    if taken is None:
        return block
    if id(block) in taken:
        return block.clone()
    taken.add(id(block))
    return block


def _new_tensor(value: Sharded, like=None, whole: bool = False, taken: set | None = None) -> torch.Tensor:
    """A new tensor for an assigned slot: the full value when simulated (or `whole`: gathered on
    a distributed mesh, where the slot is not a module's or optimizer's), the block otherwise."""
    if value.layout.mesh.runtime == "simulated" or whole:
        out = value.full()
    else:
        out = _untaken(value.shards[0], taken)
        _hold(out, value.layout, value.global_shape)
    if like is not None and isinstance(like, torch.Tensor) and out.device != like.device:
        out = out.to(like.device)
    return out


# ---------------------------------------------------------------------------------------------
# Full values back
# ---------------------------------------------------------------------------------------------


def gather_state(obj, *, inplace: bool = False) -> dict:
    """The full values of a module's or optimizer's state, as `state_dict()` gives them.

    After a call on a distributed mesh, lifted parameters, buffers, gradients and optimizer
    state hold this rank's block; this gathers each (a collective: every rank must call it).
    Gathered values are new tensors; state that was whole all along comes back as it is held
    (as `state_dict()` gives it, not a copy). `inplace=True` also puts the full values back
    into the tensors (gradients included, and for a module what its state_dict leaves out:
    non-persistent buffers, tensors it keeps as attributes, modules it keeps in plain lists or
    dicts), so the module or optimizer runs unsharded again.
    On a simulated mesh, state is always whole: this is `state_dict()`.

    >>> import torch, hpfun
    >>> model = torch.nn.Linear(4, 2)
    >>> sorted(hpfun.gather_state(model))
    ['bias', 'weight']
    """
    gathered: dict = {}  # id -> (the tensor, its full value): one tensor under two keys (tied weights, an
    # optimizer's `st["m"] = st["m2"]`) is gathered once and stays one tensor, as state_dict() gives it

    def _full(t, inplace, param=None):
        if id(t) not in gathered:
            gathered[id(t)] = (t, _full_value(t, inplace, param))
        return gathered[id(t)][1]

    if isinstance(obj, torch.nn.Module):
        sd = obj.state_dict(keep_vars=True)
        _refuse_lost({k: v for k, v in sd.items() if isinstance(v, torch.Tensor)})
        out = {k: _full(v, inplace) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
        if inplace:  # what state_dict leaves out (non-persistent buffers, tensors a module keeps as attributes,
            for t in _held_elsewhere(obj, sd):  # in its lists, dicts and tuples) is whole again too
                _full(t, True)
        return out
    if isinstance(obj, torch.optim.Optimizer):
        sd = obj.state_dict()  # its state holds the optimizer's own tensors, keyed by index
        _refuse_lost({f"state.{i}.{k}": v for i, entries in sd["state"].items() if isinstance(entries, dict)
                      for k, v in entries.items() if isinstance(v, torch.Tensor)})
        params = [p for group in obj.param_groups for p in group["params"]]  # (the indices number them so)
        sd["state"] = {i: {k: _full_entry(v, inplace, params[i] if i < len(params) else None, _full)
                           for k, v in entries.items()} if isinstance(entries, dict) else
                       _full(entries, inplace) if isinstance(entries, torch.Tensor) else entries  # (under a key of
                       for i, entries in sd["state"].items()}  # its own: MADGRAD's `state["k"]`)
        return sd
    raise TypeError(f"gather_state takes an nn.Module or a torch.optim.Optimizer, got {type(obj).__name__}")


def _full_entry(v, inplace: bool, param: torch.Tensor | None, full):
    """An optimizer state entry gathered: a tensor, or each tensor of the containers holding
    them, nested to any depth (SPlus's `sides`, lifted tensor by tensor, whose items hold blocks
    too; AggMo's `{beta: buffer}`, made outside from the parameter's block): lists, tuples,
    dicts and their standard kinds (an OrderedDict, a defaultdict, a namedtuple, a deque), each
    rebuilt as what it was."""
    return pytree.tree_map_only(torch.Tensor, lambda t: full(t, inplace, param), v)


def _held_elsewhere(module: torch.nn.Module, sd: dict) -> list:
    """The tensors `module` holds as blocks outside its state_dict, in the order every rank walks:
    its modules' tensor attributes, and what they keep in dicts, lists and tuples (nested), the
    modules among those (a DQN's target networks in a list) with their own attributes alike."""
    listed = {id(v) for v in sd.values()}
    out, seen, visited = [], set(), set()

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and id(t) not in listed and id(t) not in seen and held_block(t) is not None:
            seen.add(id(t))
            out.append(t)

    def walk(v, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            add(v)
        elif isinstance(v, torch.nn.Module) and id(v) not in visited:
            for mod in v.modules():
                if id(mod) in visited:
                    continue
                visited.add(id(mod))
                for p in mod._parameters.values():  # (a registered one is in the state_dict: skipped)
                    add(p)
                    add(getattr(p, "grad", None))
                for k, w in [*mod._buffers.items(), *vars(mod).items()]:
                    if not k.startswith("__") and k not in _MODULE_TABLES:
                        walk(w, _DEPTH)
        elif depth and id(v) not in visited and (isinstance(v, (dict, list, tuple)) or lift.is_user_object(v)):
            visited.add(id(v))  # (an OrderedDict, a namedtuple, an object of the user's holding a module too)
            held = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else \
                lift.attributes(v).values()
            for w in list(held):
                walk(w, depth - 1)

    walk(module, _DEPTH)
    return out


_MODULE_TABLES = frozenset(["_parameters", "_buffers", "_modules"])  # (walked as what they are)
# containers and objects inside one another that a module's attribute holds: deeper than lifting
# reads a module's own (`lift.HELD_DEPTH`), since a function may reach them by a closed-over chain
_DEPTH = 64


def _refuse_lost(values: dict) -> None:
    """An error naming the tensors a failed donating call lost (their storage holds undefined
    values): gathered, they would be saved as a checkpoint."""
    if _LOST and (names := lost(values)):
        raise ExecutionError(Problem(", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else ""),
                                     "lost: a call that was handed them (donate_state=True) failed, and their storage "
                                     "holds undefined values", "restore them from the last checkpoint instead of "
                                     "gathering them"), headline="donated state lost")


def _full_value(x: torch.Tensor, inplace: bool, param: torch.Tensor | None = None) -> torch.Tensor:
    """`x` gathered if it holds a block. `param`: the parameter an optimizer's state entry `x`
    belongs to: state an optimizer stepped outside the sharded function made from the block
    its parameter holds (`exp_avg` of the block's shape) is that block's, in its layout."""
    block = held_block(x)
    if block is None and param is not None and x.dim() > 0 and (owner := held_block(param)) is not None \
            and x.shape == param.shape and _WHOLE.get(x) != x.data_ptr():  # (not state a call left whole:
        # Adafactor's (1, 8) column statistics of a (4, 8) weight split over 4 ranks, shaped as its block)
        block = Sharded(owner.layout, owner.global_shape, (x,))
    full = x.detach() if block is None else block.full()
    if inplace and block is not None:
        with torch.no_grad():
            x.data = full
        _LOCAL.pop(x, None)
    if inplace and x.is_leaf and x.grad is not None:  # after its parameter: a gradient must match its shape
        x.grad = _full_value(x.grad, True)
    return full
