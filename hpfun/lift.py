"""Lifting: the tensors a sharded function reads without being given them.

A step function written as PyTorch users write it reads state it was not passed: the
parameters and buffers of a module it closes over (or reads as a global), an optimizer's
parameters and state, `.grad`, closed-over and global tensors. hpfun finds that state by
walking the function's closure cells and the globals its code loads (into the user's own
helper functions too), names every tensor (a module's fully qualified parameter name,
`model.layers.0.self_attn.q_proj.weight`, or the variable's name), and makes each one an input
of the program, read at every call. While the function is traced, every place that holds a
lifted tensor holds its fake stand-in instead; what the function assigns there (a new `.grad`,
an optimizer's first state, a reassigned attribute) is recorded and written back after each
call, as eager PyTorch would have left it.

Python values that decide the trace (a module's `training` flag, an optimizer's momentum, a
number in a closed-over config dict, list or namespace) are read too: they join the cache key,
so a change retraces instead of running a stale program. The
hyperparameters a scheduler changes (a float learning rate, Adam's betas; `LIFTED_SCALARS`) are
inputs instead (0-d float64 tensors while traced), so a scheduler stepping them does not retrace.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import decimal
import dis
import enum
import fractions
import functools
import gc
import inspect
import itertools
import numbers
import operator
import os
import sys
import time
import types
import weakref

import attrs
import torch
from torch.utils.hooks import RemovableHandle

from hpfun.capture import HPFUN_DIR, SITE_PACKAGES, TORCH_DIR, cell_value, exact_key, in_backwards
from hpfun.optimizers import FOREACH_SGD, PythonFloats, read_as_float
from hpfun.errors import CaptureError, Problem
from hpfun.sharded import Sharded
from torch._subclasses.fake_tensor import FakeTensor

_LIBRARY_DIRS = (TORCH_DIR, HPFUN_DIR, os.path.dirname(os.__file__) + os.sep)


@attrs.frozen(eq=False)
class Slot:
    """One place that holds a tensor (or may come to hold one): read and written by name."""

    name: str
    read: object  # () -> the value held there now (a tensor, None, or a static value)
    write: object  # (value) -> None: make that place hold `value`
    follows: str | None = None  # a parameter's name: a gradient or optimizer state takes its spec
    requires_grad: bool = False  # a parameter autograd fills the `.grad` of
    scalar: bool = False  # a Python number read as a 0-d float64 tensor (a float learning rate, a beta)


@attrs.frozen(eq=False)
class Root:
    """An object found by walking the function: a module, an optimizer, or a tensor at a place."""

    name: str
    value: object
    read: object = None  # for tensors (and Sharded values): the value at its place now
    write: object = None  # and how to replace it


class _Inherited:
    """A Root's value for a tensor a subclass inherits from the class holding it: the trace must
    not give the subclass one of its own (`Sub.ema = Sub.ema + v`), which hpfun would not write
    back (`Substitution.left_over`)."""

    __slots__ = ("cls", "owner", "attr")

    def __init__(self, cls, owner, attr):
        self.cls, self.owner, self.attr = cls, owner, attr


class _Keyed:
    """A Root's value for a dict keyed by tensors (or by their ids) or a set of tensors the walk
    found (`{p: torch.optim.AdamW([p])}`, `no_decay = {bias, norm.weight}`): keyed by the
    stand-ins while a trace runs (`Substitution._rekey`), so its lookups find them."""

    __slots__ = ("container",)

    def __init__(self, container):
        self.container = container


def _member_ids(container) -> frozenset:
    """Which objects a set holds, by identity (a parameter taken out of `no_decay` between calls)."""
    return frozenset(map(id, container))


def _is_tensor_key(k, depth: int = 3) -> bool:
    """A tensor, or an address-sized int (`id(p)`), as a dict's key or a set's member, or a
    tuple holding one (`(p, "w")`)."""
    return isinstance(k, torch.Tensor) or _is_an_id(k) or \
        bool(depth) and type(k) in (tuple, frozenset) and any(_is_tensor_key(x, depth - 1) for x in k)


def _keyed_by_tensors(container) -> bool:
    """Whether a dict's keys or a set's members include a tensor, or an address-sized int (`id(p)`)."""
    return any(map(_is_tensor_key, container))


# ---------------------------------------------------------------------------------------------
# Walking the function
# ---------------------------------------------------------------------------------------------


def _wrapped_function(obj):
    """`obj.__wrapped__` (functools.wraps, lru_cache), or None; not a getattr that runs the
    object's own `__getattr__` for a name it lacks (a config of the user's raising KeyError)."""
    try:
        return inspect.getattr_static(obj, "__wrapped__", None) and getattr(obj, "__wrapped__", None)
    except Exception:  # noqa: BLE001 (a descriptor raising: no wrapped function)
        return None


def find_roots(fn, guard: list | None = None) -> tuple[list[Root], list[tuple[str, object]]]:
    """Modules, optimizers and tensors `fn` can reach through closures and loaded globals; and
    the other objects it reaches (by name), which an error can point at when an unlifted tensor
    turns up in the trace. `guard` receives (holder, name, object) for every closure cell, global
    and code object the walk read (`holder` a dict for globals, else an object whose attribute
    `name` held `object`), and None if it went into a container or an object whose contents can
    change in place (see `RootCache`)."""
    roots: list[Root] = []
    opaque: list[tuple[str, object]] = []
    keyed_objects: set = set()  # ids of the library objects whose values key the program (`LibraryValues`)
    seen_objects: set[int] = set()
    seen_functions: set = set()  # (code, cells): two closures of one helper hold different objects
    seen_hooks: set = set()  # (id of an owner, its hook dicts) walked
    seen_places: set = set()  # (id of a cell or a globals dict, name): a variable two functions read is one root
    seen_classes: set = set()  # the user's classes whose methods and values were walked
    seen_modules: set = set()  # (id, names read) of the user's Python modules walked as configs
    names: set[str] = set()

    def unique(name: str, owner: str) -> str:
        """`name`, or where another root has it (two helpers each closing over their own `model`)
        the owner's name before it, then a number."""
        if name in names and owner:
            name = _join(owner, name)
        base, n = name, 2
        while name in names:
            name, n = f"{base}#{n}", n + 1
        names.add(name)
        return name

    def value(obj, name: str, read, write, owner: str = "", attrs_read: frozenset = frozenset()) -> None:
        if _is_scalar(obj):  # a Python value the trace may read: it keys the cache (before ids: small ints are shared)
            if name and read is not None:  # (`write`: to set it back when a trace that changed it is refused)
                roots.append(Root(unique(name, owner), _SCALAR, read, write))
            return
        if type(obj) in (set, frozenset) and id(obj) not in seen_objects and _keyed_by_tensors(obj):
            seen_objects.add(id(obj))  # (`p in no_decay`; a frozenset is put anew at its place, `write`)
            roots.append(Root(unique(name, owner), _Keyed(obj), read, write))
            note(None)  # (its members change in place; which they are keys the program, by identity)
            roots.append(Root(unique(f"{name}.<members>", owner), _SCALAR, functools.partial(_member_ids, obj)))
            return
        if type(obj) in (set, frozenset) and id(obj) not in seen_objects and len(obj) <= PLAIN_CONTAINER_ITEMS \
                and any(_key_objects(m, None) for m in obj):  # objects of the user's (`{k}`, `{(k, "x")}`):
            seen_objects.add(id(obj))  # which they are keys the program, and their numbers are read
            note(None)
            roots.append(Root(unique(f"{name}.<members>", owner), _SCALAR, functools.partial(_member_ids, obj)))
            for i, member in enumerate(obj):
                for suffix, part, read_part in _key_objects(member, functools.partial(_key_at, obj, i)):
                    value(part, f"{name}.<member {i}>{suffix}", read_part, None)
            return
        if type(obj) is set and len(obj) <= PLAIN_CONTAINER_ITEMS and all(map(_is_scalar, obj)):
            if name and read is not None:  # (`if k in NAMES`): its members key the cache, read anew at every call
                roots.append(Root(unique(name, owner), _SCALAR, _frozen_reader(read)))
            return
        if name and read is not None and (token := _binding(obj)) is not None:
            bound.append((name, token))  # which function or class a name holds: rebinding it compiles again
        if _is_numbers_array(obj):  # a NumPy array of numbers (a table of scales): its values key the cache,
            if name and read is not None:  # read anew at every call, as a scalar is (it changes in place)
                roots.append(Root(unique(name, owner), _SCALAR, _array_reader(read)))
            return
        if isinstance(obj, (torch.Tensor, Sharded)):  # a root per place that holds it (`w` and `params = [w, b]`):
            roots.append(Root(unique(name, owner), obj, read, write))  # one input, its stand-in in every place
            if isinstance(obj, torch.Tensor) and type(obj) is not Sharded and id(obj) not in seen_objects:
                tensor_code(obj, name)  # a free tensor's hooks and attributes, as a parameter's
                note(_Unchanged(vars(obj)))
            return
        if id(obj) in seen_objects:
            return
        elif isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            seen_objects.add(id(obj))
            roots.append(Root(unique(name, owner) if name else name, obj))
            if isinstance(obj, torch.nn.Module):
                module_code(obj, name)
                module_held(obj, name)
            else:  # its step hooks, its own and every optimizer's
                hooks_code(obj, _OPTIMIZER_HOOK_DICTS, name)
                hooks_code(sys.modules["torch.optim.optimizer"], _GLOBAL_OPTIMIZER_HOOK_DICTS, "torch.optim.optimizer")
                optimizer_own(obj, name)
        elif type(obj) is types.MappingProxyType and len(obj) <= PLAIN_CONTAINER_ITEMS:  # a read-only view of a
            seen_objects.add(id(obj))  # dict (a class's `__dict__`, `MappingProxyType(cfg)`): what it shows is read
            note(None)  # (walked again at every call: the dict it shows may change)
            for k, v in list(obj.items()):
                if _is_scalar(k) and not _is_an_id(k):
                    value(v, f"{name}.{k}", functools.partial(obj.get, k), None)
        elif isinstance(obj, dict) and ((holds := _holds_state(obj)) or _length(obj) <= PLAIN_CONTAINER_ITEMS):
            seen_objects.add(id(obj))
            if _keyed_by_tensors(obj):  # (`scales[p]`, `scales.get(p, 1.0)`, `buf[id(p)]`)
                roots.append(Root(unique(f"{name}.<keys>", owner), _Keyed(obj)))
            if not holds:  # watched too: a tensor the trace leaves in it is an error (`ObjectValues`)
                opaque.append((name, obj))
                guard_seen(obj)
            else:
                note(None)
            for i, (k, v) in enumerate(list(obj.items())):  # (a key that is an object, a parameter keying its
                key = k if _is_scalar(k) and not _is_an_id(k) else f"<key {i}>"  # optimizer:
                # by position, never by its printed values; an id(p), each process's own: by position too)
                value(v, f"{name}.{key}", functools.partial(obj.get, k), functools.partial(obj.__setitem__, k))
                at = functools.partial(_key_at, obj, i)
                for suffix, part, read_part in _key_objects(k, at):  # an object of the user's in a key (a tuple's or
                    value(part, f"{name}.{key}{suffix}", read_part, None)  # frozenset's part too): its numbers are read
            if type(obj) is not dict and (own := _own_dict(obj)):  # a dict subclass's attributes (a
                note(_Unchanged(own))  # config holding its settings as `cfg.scale = 2.0`): read as an object's
                for k, v in list(own.items()):
                    if not k.startswith("__"):
                        value(v, _join(name, k), functools.partial(getattr, obj, k), functools.partial(set_attribute, obj, k))
        elif isinstance(obj, (list, tuple)) and ((holds := _holds_state(obj)) or _length(obj) <= PLAIN_CONTAINER_ITEMS):
            seen_objects.add(id(obj))
            if not holds:
                opaque.append((name, obj))
                guard_seen(obj)
            else:
                note(None)
            for i, v in enumerate(obj):
                value(v, f"{name}.{i}", _item_reader(read, i), _sequence_writer(obj, i, read, write))
        elif isinstance(obj, (types.FunctionType, types.MethodType, functools.partial)):
            function(obj, name)
        elif callable(obj) and isinstance(_wrapped_function(obj), types.FunctionType):
            function(obj.__wrapped__, name)  # a decorated helper (functools.lru_cache, functools.wraps)
        elif isinstance(getattr(type(obj), "traced_function", None), property):  # a sharded function called
            value(obj.traced_function, name, _constant(obj.fn), None)  # inside this one: its code and state are ours
        elif _is_user_object(obj):  # an instance of the user's own class (a Trainer holding model and opt)
            seen_objects.add(id(obj))
            own = _own_dict(obj)  # (an attribute set, added or removed: walked again)
            note(_Unchanged(own) if type(own) is dict else None if own is not None else (obj, "__class__", type(obj)))
            for k in _slot_names(type(obj)):  # (and one in `__slots__`)
                note((obj, k, getattr(obj, k, _MISSING)))
            for k, v in list(attributes(obj).items()):
                value(v, _join(name, k), functools.partial(getattr, obj, k), functools.partial(set_attribute, obj, k))
            user_classes(type(obj), name, obj)  # its methods (`__call__` too) and class attributes
        elif isinstance(obj, type) and _is_user_class(obj) and id(obj) not in seen_objects:
            seen_objects.add(id(obj))  # a class of the user's used as a namespace (`Config.scale`)
            user_classes(obj, name)
            for c in obj.__mro__:  # or made inside (`Smooth()(x)`): what its constructors read (`self.eps = EPS`)
                if _is_user_class(c) and not c.__module__.startswith("torch."):  # keys the program too
                    for k in _CONSTRUCTORS:
                        if isinstance(v := vars(c).get(k), (types.FunctionType, staticmethod)):
                            note((vars(c), k, v))  # (one patched on the class: walked again)
                            function(getattr(v, "__func__", v), name)
        elif isinstance(obj, types.ModuleType) and _is_user_module(obj) and attrs_read and \
                (id(obj), attrs_read) not in seen_modules:
            seen_modules.add((id(obj), attrs_read))  # (once for the names read: a package's modules may import
            module = vars(obj)  # each other, einx's do) a module of the user's read as a config (`config.LR`)
            note(_Unchanged(module))
            for k in sorted(attrs_read & module.keys() if attrs_read is not EVERY_NAME else
                            (k for k in module if not k.startswith("_"))):
                v = module[k]
                if _is_scalar(v) or _is_numbers_array(v) or type(v) in (set, dict, list) or _is_user_object(v):
                    value(v, _join(name, k), functools.partial(module.get, k), functools.partial(module.__setitem__, k))
                elif isinstance(v, types.ModuleType) and _is_user_module(v) or isinstance(v, type) and _is_user_class(v):
                    value(v, _join(name, k), functools.partial(module.get, k), None, attrs_read=attrs_read)  # (a
                    # package's module, `cfgpkg.config.LR`; a class in it, `config.Train.lr`)
        elif not isinstance(obj, (type, types.ModuleType)):
            opaque.append((name, obj))
            if name and _is_plain_object(obj) and keyed_library_object(obj) and id(obj) not in keyed_objects:
                keyed_objects.add(id(obj))  # a library's object read for its numbers (a transform's `scale`, a
                roots.append(Root(unique(f"{name}.<values>", owner), _SCALAR,  # config held in a global): its values
                                  functools.partial(LibraryValues, obj)))  # key the program, read at every call
            if _is_block_mask(obj) and id(obj) not in seen_objects:  # flex_attention's, made outside the step (as
                seen_objects.add(id(obj))  # torch's docs advise): its mask_mod's code and what it reads (a document
                note((obj, "mask_mod", obj.mask_mod))  # id table) are the function's own; its block tensors are
                value(obj.mask_mod, _join(name, "mask_mod"), functools.partial(getattr, obj, "mask_mod"), None)
                # read by torch's kernels only, never by the math hpfun traces it as

    def module_held(obj, name: str) -> None:
        """What a module tree holds besides its state that is walked as the function's: optimizers,
        modules in plain containers, and objects of the user's holding tensors."""
        tree = None
        for mod_name, mod in obj.named_modules(remove_duplicate=True):  # an optimizer a module holds
            for k, v in list(vars(mod).items()):  # (`model.opt_g`, `model.opts = [opt_g, opt_d]`): stepped
                if _is_optimizer(v) or _holds_any(v, _is_optimizer):  # as one the function reaches
                    value(v, _join(_join(name, mod_name), k), functools.partial(getattr, mod, k), None)
                elif _object_with_tensors(v) or k not in _MODULE_INTERNALS and not _holds_any(v, _is_tensor, 1) \
                        and _holds_any(v, _object_with_tensors, HELD_DEPTH):
                    # an object of the user's holding tensors (a `cached_property` table a helper keeps, as
                    # eager keeps it), or a list or config holding one: its tensors are state, as a closed-over
                    # object's are
                    value(v, _join(_join(name, mod_name), k), functools.partial(getattr, mod, k), None)
                elif k not in _MODULE_INTERNALS and _holds_any(v, _unregistered_module(None), HELD_DEPTH):
                    tree = {id(m) for m in obj.modules()} if tree is None else tree  # a module in a plain
                    if _holds_any(v, _unregistered_module(tree), HELD_DEPTH):  # dict or list, not a
                        # submodule (`self.heads = {"a": Linear(...)}`), as deep as objects are read: its
                        # state lifted (a tensor beside them in a tuple, `Head(proj, offset)`, is refused:
                        # rebuilt around the stand-ins, the tuple did not keep the tensor itself)
                        value(v, _join(_join(name, mod_name), k), functools.partial(getattr, mod, k), None)

    def user_classes(cls: type, name: str, instance=None) -> None:
        """The user's classes in `cls`'s method order: their methods are walked (the globals they
        read key the cache as the function's own do), and their values (sets, dicts and lists of
        them too) are read through the instance when given (an attribute it does not shadow)."""
        for c in cls.__mro__:
            if c in seen_classes or not _is_user_class(c) or c.__module__.startswith("torch."):
                continue
            seen_classes.add(c)
            note(_SameNames(c))  # (a value added to the class, or deleted: walked again, its roots anew)
            for k, v in list(vars(c).items()):
                if not _walked_member(k, v):
                    continue
                held = v
                if isinstance(v, (staticmethod, classmethod)):
                    v = v.__func__
                elif isinstance(v, property):
                    v = v.fget
                if isinstance(v, types.FunctionType):
                    note((vars(c), k, held))  # (a method patched on the class: walked again)
                    bound.append((f"{c.__qualname__}.{k}", _binding(v)))  # (patched on the class: compiled again)
                    function(v, name)
                elif _is_user_object(v) and callable(v):  # an object of the user's that is called (`act = Scaler(2.0)`):
                    note((vars(c), k, held))  # its numbers and `__call__`, as a global one's (one set instead: walked again)
                    holder = instance if instance is not None else c
                    value(v, _join(name, k), functools.partial(getattr, holder, k), None)
                elif callable(v) and (token := _binding(v)) is not None:  # a builtin or partial held by the class
                    note((vars(c), k, held))  # (`act = staticmethod(torch.relu)`, later torch.tanh: compiled again)
                    bound.append((f"{c.__qualname__}.{k}", token))
                    if isinstance(v, functools.partial):  # (its arguments too, as a global partial's)
                        holder = instance if instance is not None else c
                        value(v, _join(name, k), functools.partial(getattr, holder, k), None)
                    elif isinstance(v, type) and _is_user_class(v):  # a class in it (`Cfg.Optim.lr`): its values
                        value(v, _join(name or c.__qualname__, k), _constant(v), None)
                elif _is_user_object(v) and not isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):
                    note((vars(c), k, held))  # an object it holds (`Cfg.opt = Opt()`, a SimpleNamespace): its values
                    holder = instance if instance is not None else c
                    value(v, _join(name or c.__qualname__, k), functools.partial(getattr, holder, k), None)
                elif _is_scalar(v) or _is_numbers_array(v) or type(v) in (set, dict, list):
                    note((c, k, v))  # (an attribute set to another object: walked again)
                    holder = instance if instance is not None else c
                    value(v, _join(name, k), functools.partial(getattr, holder, k), functools.partial(set_attribute, c, k))
                elif isinstance(v, torch.Tensor) and type(v) is not Sharded:  # a tensor the class holds (`Stats.ema`):
                    note((c, k, v))  # state, read and written back at the class, as a global tensor is
                    value(v, _join(name or c.__qualname__, k), functools.partial(getattr, c, k),
                          functools.partial(set_attribute, c, k))
                    for d in cls.__mro__[:cls.__mro__.index(c)]:  # (its subclasses the walk came through: one
                        if _is_user_class(d) and k not in vars(d):  # given its own, `Sub.ema = ...`, is refused)
                            roots.append(Root(f"{d.__qualname__}.{k}", _Inherited(d, c, k)))

    def optimizer_own(opt, name: str) -> None:
        """What an optimizer holds besides its state and groups, and the code of a user's optimizer
        class: a hand-written `step`'s globals key the cache as the function's own do, and the
        attributes it sets on itself are read as a trainer's are (numbers: statics; a dict it
        fills lazily, `self.by_id.setdefault(id(p), ...)`: state). Both had been left out: a
        changed global or `self.mult` ran the first program, and the momentum stayed the trace's."""
        note(_SameAttributes(opt))  # (an attribute set or added between calls: walked again)
        user_classes(type(opt), name, opt)
        for k, v in list(vars(opt).items()):  # (a private one holding a tensor too: `self._gn`, made by a step)
            if k not in ("state", "param_groups", "defaults") and (_users_attribute(opt, k) or isinstance(v, torch.Tensor)):
                value(v, _join(name, k), functools.partial(getattr, opt, k), functools.partial(setattr, opt, k))

    def hooks_code(owner, kinds: tuple, name: str) -> None:
        """The hooks in `owner`'s hook dicts (an optimizer's step hooks, the hooks torch runs for
        every module or optimizer), each bound by identity, the dicts guarded: one added, removed
        or replaced compiles again (they ran as the trace found them, silently)."""
        if (id(owner), kinds) in seen_hooks:
            return
        seen_hooks.add((id(owner), kinds))
        note((RemovableHandle, "next_id", RemovableHandle.next_id))  # a hook registered anywhere: walked again
        for kind in kinds:
            hooks = getattr(owner, kind, None)
            if isinstance(hooks, dict):
                note(_Unchanged(hooks))
                for h in list(hooks.values()):
                    if not isinstance(h, bool):  # (a flags dict, `with_kwargs`: torch leaves a removed hook's
                        value(h, _join(name, kind.lstrip("_")), _constant(h), None)  # flag behind; the hook keys it)

    def module_code(module: torch.nn.Module, name: str) -> None:
        """A module tree's code: each module's own class (a user's `forward` reading a global)
        and the hooks it holds, each bound by identity (a hook added or removed compiles
        again); the walk is done again when a submodule or a hook is added, removed or replaced.
        And what a module holds of the user's code: a function, or one a partial binds (`self.fn =
        helper`, whose globals and closure are read as the function's own), a class (`self.cls = Hyper`,
        its values and methods) and a config object's class (`self.cfg.s` where `Cfg.s` is a class
        attribute); the walk is done again when such an attribute holds another object."""
        hooks_code(torch.nn.modules.module, _GLOBAL_HOOK_DICTS, "torch.nn.modules.module")  # every module's
        note((RemovableHandle, "next_id", RemovableHandle.next_id))  # a hook registered anywhere: walked again
        attributes_of = []  # each tensor's attribute dict: one set or added between calls is walked again
        for mod_name, mod in module.named_modules(remove_duplicate=True):  # (a submodule replaced: `RootCache`)
            user_classes(type(mod), "")
            cls = type(mod)
            if cls not in seen_classes:  # a library's module class: its forward by identity (one patched after a
                seen_classes.add(cls)  # call, as kernel libraries patch transformers' norms: compiled again)
                forward = inspect.getattr_static(cls, "forward", None)  # (a TorchScript module's is a descriptor
                if isinstance(forward, types.FunctionType):  # that raises on its class)
                    note((cls, "forward", forward))
                    bound.append((f"{cls.__module__}.{cls.__qualname__}.forward", _binding(forward)))
            for k, v in list(vars(mod).items()):
                if k.startswith("__") or k in _MODULE_INTERNALS:
                    continue
                if held_code(v, _join(_join(name, mod_name), k), HELD_DEPTH):
                    note((mod, k, v))
            for kind in _HOOK_DICTS:
                hooks = getattr(mod, kind, None)
                if hooks:  # (one removed: walked again)
                    note(_Unchanged(hooks))
                    for h in list(hooks.values()):
                        value(h, _join(mod_name, kind.lstrip("_")), _constant(h), None)
            for p_name, p in list(mod._parameters.items()) + list(mod._buffers.items()):
                if p is not None and id(p) not in seen_objects:
                    tensor_code(p, _join(mod_name, p_name))
                    attributes_of.append(vars(p))
        note(_AllUnchanged(attributes_of))

    def held_code(v, place: str, depth: int) -> bool:
        """The user's code a module holds, at `place`, directly or in its lists, tuples, dicts and
        objects (to `depth` levels): a function, or one a partial binds (`self.fn = helper`, whose
        globals and closure are read as the function's own), a class (`self.cls = Hyper`, its
        values and methods), a classmethod (its class, its code) and a config object's class
        (`self.cfg.s` where `Cfg.s` is a class attribute); whether it found any (the containers
        and objects it found some in are guarded: one changed in place walks again)."""
        held = v.func if isinstance(v, functools.partial) else v  # (a partial's arguments: `ModuleValues`)
        if _is_user_function(held):
            function(held, place)
            return True
        if isinstance(v, type) and _is_user_class(v):
            value(v, place, _constant(v), None)
            return True
        if isinstance(v, types.MethodType) and isinstance(v.__self__, type) and _is_user_class(v.__self__):
            value(v.__self__, place, _constant(v.__self__), None)  # a classmethod (`self.act = Scaler.apply`)
            function(v.__func__, place)
            return True
        if isinstance(held, types.MethodType) and _is_user_function(held.__func__) and _is_user_object(held.__self__) \
                and not isinstance(held.__self__, (torch.nn.Module, torch.optim.Optimizer)):
            function(held, place)  # a method of an object of the user's (`self.fns = [obj.act]`): its code, its object
            return True
        if not depth or isinstance(v, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
            return False
        if type(v) in (list, tuple, dict) and _length(v) <= PLAIN_CONTAINER_ITEMS:
            items = v.items() if type(v) is dict else enumerate(v)
            found = [held_code(x, f"{place}.{i}", depth - 1) for i, x in list(items)]
            if any(found) and type(v) is not tuple:
                note(_Unchanged(v))
            return any(found)
        if _is_config_object(v) and _is_user_object(v):  # (its own values are the module's: `ModuleValues`)
            user_classes(type(v), place, v)  # (a SimpleNamespace's class is no user's: only what it holds)
            found = [held_code(x, _join(place, k), depth - 1) for k, x in list(attributes(v).items())]
            if any(found):  # (one keeping them in `__slots__`: walked at every call)
                note(_SameAttributes(v) if isinstance(getattr(v, "__dict__", None), dict) else None)
            return True
        return False

    def tensor_code(p: torch.Tensor, p_name: str) -> None:
        """A tensor's own gradient hooks (what they read keys the cache) and the Python values it
        carries (`p.no_decay = True`, `p.lr_scale = 0.5`, read by a hand-written loop)."""
        seen_objects.add(id(p))
        note((RemovableHandle, "next_id", RemovableHandle.next_id))  # a hook registered anywhere: walked again
        for kind in _TENSOR_HOOK_DICTS:
            hooks = getattr(p, kind, None)
            if hooks:
                note(_Unchanged(hooks))
                for h in list(hooks.values()):
                    value(h, f"{p_name}.{kind.lstrip('_')}", _constant(h), None)
        for k, v in list(vars(p).items()):
            if not k.startswith("_") and (_is_scalar(v) or type(v) in (set, dict, list)):  # (a library's private
                value(v, f"{p_name}.{k}", functools.partial(getattr, p, k, None), None)  # flags: `_is_buffer`)

    def function(fn, name: str, given: bool = False) -> None:
        if isinstance(fn, functools.partial):
            if fn.keywords:
                note(_Unchanged(fn.keywords))  # (a dict, changeable in place)
            function(fn.func, name, given)
            for i, a in enumerate(fn.args):
                value(a, _join(name, f"args.{i}"), _constant(a), None)
            for k, a in fn.keywords.items():
                value(a, _join(name, k), _constant(a), None)
            return
        if isinstance(fn, types.MethodType):  # a module's method names its state by FQN, another's as self.*
            owner = fn.__self__
            top = "" if isinstance(owner, torch.nn.Module) else "self"
            value(owner, f"{name}.__self__" if name else top, _constant(owner), None)
            if not isinstance(owner, (torch.nn.Module, torch.optim.Optimizer, type)) and not _is_user_object(owner) \
                    and any(_is_optimizer(v) or _holds_any(v, _is_optimizer, 2) for v in attributes(owner).values()):
                for k, v in attributes(owner).items():  # a library object's method: the optimizers it steps (a
                    if _is_optimizer(v) or _holds_any(v, _is_optimizer, 2) or _is_tensor(v) or _holds_any(
                            v, _is_tensor, 2):  # gradient hook over `self.optims`, {param: Adam}, as its closure's),
                        value(v, _join(f"{name}.__self__" if name else top, k),  # and the parameters it holds
                              functools.partial(getattr, owner, k), None)  # (`p is self.params[0]`)
            fn = fn.__func__
        if not isinstance(fn, types.FunctionType):
            fn = getattr(type(fn), "__call__", None)
            if not isinstance(fn, types.FunctionType):
                return
        code = fn.__code__
        key = (code, tuple(map(id, fn.__closure__ or ())), id(fn.__defaults__), id(fn.__kwdefaults__))  # (a hook
        # made in a loop, `def hook(p, o=o)`: one code, each with its own optimizer as a default)
        if key in seen_functions:
            return
        if not given and _is_library(code.co_filename):
            wrapped = getattr(fn, "__wrapped__", None)  # a helper under a library's decorator (torch.no_grad(),
            if wrapped is not None and wrapped is not fn:  # hpfun.checkpoint, torch.compiler.disable): its code
                seen_functions.add(key)
                if isinstance(wrapped, (types.FunctionType, types.MethodType, functools.partial)):
                    function(wrapped, name)
                else:  # a module it wraps (`hpfun.checkpoint(block)` kept in a global): its state
                    value(wrapped, name, _constant(wrapped), None)
                return
            for i, cell in enumerate(fn.__closure__ or ()):  # a library's closure over the user's code (flex
                held = cell_value(cell, _MISSING)  # attention's `and_masks(causal, window)`): that code is read too
                if _is_user_function(held) or type(held) in (tuple, list) and _length(held) <= PLAIN_CONTAINER_ITEMS \
                        and any(map(_is_user_function, held)):
                    seen_functions.add(key)
                    value(held, _join(name, f"<closure {i}>"), _constant(held), None)
                elif _is_optimizer(held) or _holds_any(held, _is_optimizer, 2):  # and the optimizers it steps
                    seen_functions.add(key)  # (torchtune's optimizer in the backward: a gradient hook over
                    value(held, _join(name, f"<closure {i}>"), _constant(held), None)  # {param: AdamW})
            return
        seen_functions.add(key)
        note((fn, "__code__", code))
        g = fn.__globals__
        loaded = _global_names(code)
        attrs_read = _attribute_names(code)
        every = _read_by_name(code) if not any(reader in g for reader in ("getattr", "vars")) else frozenset()
        for var, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
            contents = cell_value(cell, _MISSING)
            note((cell, "cell_contents", contents))
            if contents is _MISSING or (id(cell), var) in seen_places:  # (empty: assigned later in the enclosing function)
                continue
            seen_places.add((id(cell), var))
            value(contents, var, functools.partial(getattr, cell, "cell_contents"),
                  functools.partial(setattr, cell, "cell_contents"), owner=name,
                  attrs_read=EVERY_NAME if var in every else attrs_read)
        note((fn, "__defaults__", fn.__defaults__))  # `def step(x, model=model)`: read when not given
        defaults = fn.__defaults__ or ()
        for i, (var, d) in enumerate(zip(code.co_varnames[code.co_argcount - len(defaults):code.co_argcount], defaults)):
            # (a number too: `lambda g, mult=mult: g * mult` made anew with another value is the same code)
            value(d, var, _item_reader(functools.partial(getattr, fn, "__defaults__"), i), _default_writer(fn, i),
                  owner=name)
        kwdefaults = fn.__kwdefaults__ or {}
        note((fn, "__kwdefaults__", fn.__kwdefaults__))
        for var, d in kwdefaults.items():
            value(d, var, functools.partial(kwdefaults.get, var), functools.partial(kwdefaults.__setitem__, var),
                  owner=name)
        if "globals" in loaded and "globals" not in g:  # (`globals()["G"]`: the names it may look up)
            loaded = (*loaded, *sorted(_attribute_names(code) & g.keys()))
        attrs_read = attrs_read.union(*(_identifiers(g[var]) for var in loaded if var in g))  # (`getattr(config,
        for var in loaded:  # KEY)`, KEY = "LR" a global)
            note((g, var, g.get(var, _MISSING)))
            if var in g and (id(g), var) not in seen_places:
                seen_places.add((id(g), var))
                value(g[var], var, functools.partial(g.get, var), functools.partial(g.__setitem__, var),
                      attrs_read=EVERY_NAME if var in every else attrs_read)
        own = vars(fn)  # its own attributes (`helper.scale = 2.0`, read as `helper.scale`): numbers key the cache
        if any(not k.startswith("__") for k in own):
            note(_Unchanged(own))
            for k, v in list(own.items()):
                if not k.startswith("__") and _is_scalar(v):
                    value(v, _join(name, f"{code.co_name}.{k}"), functools.partial(getattr, fn, k),
                          functools.partial(setattr, fn, k))

    note = guard.append if guard is not None else lambda _: None
    bound: list = []  # (name, token) of the functions, classes and modules the walk read from a global or a cell

    def guard_seen(container) -> None:  # a plain dict or list: the walk holds while it holds the same
        note(_Unchanged(container))
    if isinstance(fn, torch.nn.Module):
        roots.append(Root("", fn))
        seen_objects.add(id(fn))
        note((type(fn), "forward", type(fn).forward))
        function(type(fn).forward.__get__(fn), "")
        module_code(fn, "")
        module_held(fn, "")
    else:  # the function handed to shard is the user's wherever it is defined (an installed package too)
        function(fn, "", given=True)
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)  # the saved_tensors_hooks around the
    note(_SavedTensorsHooks(hooks))  # call: what they read keys the program too (`self.scale` of a hook's object)
    for kind, hook in zip(("pack", "unpack"), hooks or (), strict=False):
        value(hook, f"saved_tensors_hooks.{kind}", _constant(hook), None)
    if bound:  # one static for all of them, made once per walk (every binding it read is in the guard)
        roots.append(Root(BINDINGS, _SCALAR, _constant(Bindings(tuple(bound)))))
    return roots, opaque


BINDINGS = "<functions and classes called>"  # the statics key of a walk's Bindings


class _Same:
    """An object compared by identity (a builtin function, a class, a module), shown by name."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return type(other) is _Same and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        if isinstance(self.obj, types.CodeType):  # a Python function, by its code
            return f"{self.obj.co_qualname} ({os.path.basename(self.obj.co_filename)}:{self.obj.co_firstlineno})"
        module = getattr(self.obj, "__module__", None)
        name = getattr(self.obj, "__qualname__", None) or getattr(self.obj, "__name__", None) or type(self.obj).__name__
        if isinstance(self.obj, types.BuiltinFunctionType):  # torch.relu's qualname is _VariableFunctionsClass.relu
            name = getattr(self.obj, "__name__", name)
        return f"{module}.{name}" if module and module != "builtins" else str(name)


def _binding(obj):
    """What keys the cache for a function, class or module a name holds: a Python function by its
    code (a lambda made anew at each call of its maker is the same trace; what its cells and
    globals hold is walked and keyed on its own), a bound method by its function and object, a
    partial by its function; a builtin, class, module or other callable by identity. None for
    values keyed otherwise (state, scalars, containers, user objects)."""
    if isinstance(obj, types.FunctionType):
        return _Same(obj.__code__)
    if isinstance(obj, types.MethodType):  # (an object of the user's by its values too: `scaler.__call__` held by a
        return (_binding(obj.__func__), _bound_argument(obj.__self__))  # module, `scaler.s` changed)
    if isinstance(obj, functools.partial):  # (and its arguments: `partial(F.leaky_relu, negative_slope=0.1)`
        return ("partial", _binding(obj.func), tuple(map(_bound_argument, obj.args)),  # held by a module, then 0.5)
                tuple((k, _bound_argument(v)) for k, v in obj.keywords.items()))
    if isinstance(obj, (torch.Tensor, Sharded, torch.nn.Module, torch.optim.Optimizer)) or _is_user_object(obj):
        return None
    if isinstance(obj, (type, types.ModuleType)) or callable(obj):
        return _Same(obj)
    return None


def _bound_argument(a):
    """What keys the cache for an argument a partial holds: a number by `exact_key`, a function
    by `_binding`, a container or config by its values; a tensor by its place (it is state, read
    where it is), any other object by identity."""
    if _is_scalar(a):
        return exact_key(a)
    if isinstance(a, (torch.Tensor, Sharded)):
        return ("tensor",)
    if (token := _binding(a)) is not None:
        return token
    key = _values_of(object_key(a, 3))
    return _Same(a) if key is _BY_IDENTITY else key


class Bindings:
    """The functions, classes and modules a walk found its function reading from globals and
    closure cells, by name (`act = torch.relu`, later `act = torch.tanh`): a trace calls what
    they held, so they key the program cache. Hashed once, compared by value."""

    __slots__ = ("items", "_hash")

    def __init__(self, items: tuple):
        self.items, self._hash = items, hash(items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is Bindings and self._hash == other._hash and self.items == other.items)

    def __repr__(self) -> str:
        return f"<{len(self.items)} functions and classes called>"


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# the hooks torch runs for every module (`register_module_forward_hook`...), and their flags
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks", "_global_forward_hooks_with_kwargs",
                      "_global_forward_hooks_always_called")
_OPTIMIZER_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_GLOBAL_OPTIMIZER_HOOK_DICTS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
_TENSOR_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")


# code objects whose names are read, per analysis: a package walked as the user's code (tensordict from a path
# outside site-packages, 3379 code objects) thrashed a cache of 1024, and every cached call disassembled them all
_CODE_CACHE = 1 << 16


@functools.lru_cache(maxsize=_CODE_CACHE)
def _attribute_names(code: types.CodeType) -> frozenset:
    """Names `code` (and the code inside it) loads as attributes (`config.LR` loads LR), and the
    names it may pass to getattr (`getattr(config, "LR")`: its string constants that are names)."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_ATTR", "LOAD_METHOD")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _attribute_names(const)
        names |= _identifiers(const)  # (`for k in ("LR", "WD"): getattr(config, k)`)
    return frozenset(names)


EVERY_NAME = frozenset(["<every name>"])  # what `getattr(config, name)` or `vars(config)` may read of a module


@functools.lru_cache(maxsize=_CODE_CACHE)
def _read_by_name(code: types.CodeType) -> frozenset:
    """The globals and closed-over names `code` (and the code inside it) gives to `getattr` or
    `vars` (`getattr(settings, key)`: any setting of `settings` may be read, by a name the
    function is given or computes)."""
    names, after_reader = set(), False
    for i in dis.get_instructions(code):
        if after_reader and i.opname in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME"):
            names.add(i.argval)
        after_reader = i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and i.argval in ("getattr", "vars")
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _read_by_name(const)
    return frozenset(names)


def _identifiers(v) -> set:
    """The strings that are names in `v`: itself, or a tuple's, list's or set's of them."""
    if isinstance(v, str):
        return {v} if v.isidentifier() else set()
    if type(v) in (tuple, frozenset, list, set) and len(v) <= PLAIN_CONTAINER_ITEMS:
        return {x for x in v if isinstance(x, str) and x.isidentifier()}
    return set()


def _is_user_module(module: types.ModuleType) -> bool:
    """A Python module of the user's (a `config.py` beside the script, or one made at run time,
    `types.ModuleType("settings")`), not a library's or a built-in one."""
    filename = getattr(module, "__file__", None)
    if filename is None:
        return getattr(module, "__spec__", None) is None and module.__name__ not in sys.builtin_module_names \
            and module.__name__ != "__main__"
    return filename.endswith(".py") and not _is_library(filename)


def set_attribute(obj, name: str, value) -> None:
    """`setattr`, or where the object's class refuses assignment (a frozen dataclass or attrs
    class, whose own code writes with `object.__setattr__`: a cache set so), what that writes."""
    try:
        setattr(obj, name, value)
    except AttributeError as err:  # (dataclasses' and attrs' FrozenInstanceError are AttributeErrors)
        try:
            object.__setattr__(obj, name, value)
        except (AttributeError, TypeError):
            raise err from None


def del_attribute(obj, name: str) -> None:
    """`delattr`, or `object.__delattr__` where the class refuses it (as `set_attribute`)."""
    try:
        delattr(obj, name)
    except AttributeError as err:
        try:
            object.__delattr__(obj, name)
        except (AttributeError, TypeError):
            raise err from None


def _own_dict(obj) -> dict | None:
    """An object's `__dict__`, or None, never through a `__getattr__` (an AttrDict's raises KeyError)."""
    try:
        return object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return None


def attributes(obj) -> dict:
    """An object's attributes by name: its `__dict__`, and the `__slots__` its classes declare."""
    return dict(getattr(obj, "__dict__", None) or {}) | _slot_values(obj)


def _slot_names(cls: type) -> tuple:
    """The slots `cls` and its bases declare (`__dict__` and `__weakref__` left out)."""
    names = []
    for c in cls.__mro__[:-1]:
        slots = vars(c).get("__slots__", ())
        names += [k for k in ((slots,) if isinstance(slots, str) else slots) if k not in ("__dict__", "__weakref__")]
    return tuple(names)


def _slot_values(obj) -> dict:
    """What the `__slots__` of an object's classes hold, by slot name (unset ones left out)."""
    out = {}
    for cls in type(obj).__mro__[:-1]:
        slots = vars(cls).get("__slots__", ())
        for k in (slots,) if isinstance(slots, str) else slots:
            if k not in ("__dict__", "__weakref__") and hasattr(obj, k):
                out[k] = getattr(obj, k)
    return out


def _is_slotted_object(v) -> bool:
    """An instance of the user's class that keeps its attributes in `__slots__` (no `__dict__`:
    `class Scale: __slots__ = ("s",)`, `@dataclass(slots=True)`), not state or a container."""
    return not isinstance(getattr(v, "__dict__", None), dict) and _is_user_object(v) and not isinstance(
        v, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, Sharded, tuple, list, dict, set, frozenset)) \
        and not isinstance(v, type)


def _is_config_object(v) -> bool:
    """A config: an object with attributes (`_is_plain_object`), or one of the user's classes
    keeping them in `__slots__`."""
    return _is_plain_object(v) or _is_slotted_object(v)


def _frozen(read) -> frozenset:
    return frozenset(read())


def _frozen_reader(read):
    return functools.partial(_frozen, read)


def held_sets(roots) -> list:
    """The sets the walk found (of numbers or strings, keying the cache by their members, or of
    tensors, `_Keyed`), each once: what a refused trace sets back (`ObjectValues`)."""
    out = {}
    for root in roots:
        if isinstance(root.value, _Keyed) and type(root.value.container) is set:
            out[id(root.value.container)] = root.value.container
        elif type(root.read) is functools.partial and root.read.func is _frozen:
            try:
                held = root.read.args[0]()
            except Exception:  # noqa: BLE001 - a place gone since the walk: nothing to set back there
                continue
            if type(held) is set:
                out[id(held)] = held
    return list(out.values())


def _is_user_class(cls: type) -> bool:
    """A class defined in the user's code, not a library's (whose attributes are its own), or
    made at run time (`dataclasses.make_dataclass`: named after the `types` module)."""
    if _made_at_run_time(cls):
        return True
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    return module is not None and cls.__module__ != "builtins" and (filename is None or not _is_library(filename))


_MISSING = object()  # an empty closure cell, a global not (or no longer) defined


class RootCache:
    """`find_roots` of one function, walked again only when a closure cell, global or code object
    the last walk read holds another object, or when that walk went into containers or objects
    whose contents can change in place; and `collect` of those roots, done again only when a
    container it read (a module's parameters, buffers, submodules or attributes; an optimizer's
    groups and state) holds other objects, or a parameter's `requires_grad` changed (`Snapshot`)."""

    def __init__(self, fn):
        self.fn = fn
        self._last = None  # (roots, opaque, guard) of a reusable walk
        self._state = None  # (roots, State, Snapshot) of the last collect

    def __call__(self) -> tuple[list[Root], list[tuple[str, object]]]:
        if self._last is not None and _holds(self._last[2]):
            return self._last[0], self._last[1]
        guard: list = []
        roots, opaque = find_roots(self.fn, guard)
        self._last = (roots, opaque, guard) if None not in guard else None
        return roots, opaque

    def forget(self) -> None:
        """Walk and collect anew at the next call: a call put state where there was none (a new
        key in a dict the function reaches, which no walk had made a root of)."""
        self._last = self._state = None

    def state(self) -> State:
        """`collect` of the roots; the last State again while nothing it read has changed, with
        the statics (learning rates, scalars) read anew."""
        roots, opaque = self()
        if self._state is not None and self._state[0] is roots:
            if self._state[2].holds():
                state = self._state[1]
                now = statics(roots, state.statics)
                if _ALIASES in state.statics:  # (the same places: nothing the walk read changed)
                    now[_ALIASES] = state.statics[_ALIASES]
                if now != state.statics:
                    state = attrs.evolve(state, statics=now)
                    self._state = (roots, state, self._state[2])
                return state
            self._last = None  # (a submodule replaced: its class's code is walked too)
            roots, opaque = self()
        snapshot = Snapshot()
        state = collect(roots, opaque, snapshot)
        self._state = (roots, state, snapshot)
        return state


class Snapshot:
    """What a `collect` read, by identity: every dict and list it walked with the keys and
    objects they held, and each tensor's `requires_grad`. While all of them are unchanged, a
    new walk would find the same slots (which read their tensors anew at every call). A
    container replaced, an entry added, removed or reassigned, a module's `training` flag
    flipped (a module's attributes are among the dicts) all make `holds()` false; so does a
    value replaced by an equal one, which costs only a new walk.

    Contents are compared by `id`, in a dict only once its version tag says it was written to
    (unwritten, the 2856 entries of an 8-layer HF Llama's modules cost nothing to check again).
    A tensor is held weakly (the snapshot does not keep a
    tensor the user replaced alive), and a tensor freed makes `holds()` false, so its id cannot
    have passed to another object; every other value is held, so its id is its own."""

    def __init__(self):
        self.dicts: list = []  # (dict, ids of its keys, ids of its values)
        self.versions: list = []  # per dict, its version tag when read (`_dict_version`)
        self.lists: list = []  # (list, ids of its items)
        self.sets: list = []  # (set, ids of its members)
        self.groups: list = []  # (an optimizer's param group, keys, {key: id of a tensor or list it held})
        self.slotted: list = []  # (an object without a __dict__, ((slot, id of its value), ...))
        self.arrays: list = []  # (a NumPy array of numbers, its dtype, shape and bytes): edited in place, unseen
        self.kept: list = []  # the values that are not tensors, kept alive
        self.tensors: dict = {}  # id -> a weak reference to each tensor seen
        self.refs: tuple = ()
        self.flags: tuple = ()
        self._empty: tuple = ()
        self._named: tuple = ()
        self._other: tuple = ()

    def _seen(self, values) -> None:
        for v in values:
            if isinstance(v, torch.Tensor) and type(v) not in WEAK_PROXIES:
                self.tensors.setdefault(id(v), (weakref.ref(v), v.requires_grad))
            else:
                self.kept.append(v)

    def dict(self, d: dict) -> None:  # (an optimizer's state is keyed by its parameters)
        self.dicts.append((d, tuple(map(id, d)), tuple(map(id, d.values()))))
        if _dict_version is not None:
            self.versions.append(_dict_version(d))
        self._seen(d)
        self._seen(d.values())

    def list(self, seq: list) -> None:
        self.lists.append((seq, tuple(map(id, seq))))
        self._seen(seq)

    def set(self, members) -> None:
        self.sets.append((members, frozenset(map(id, members))))
        self._seen(members)

    def object(self, obj) -> None:
        """An object's attributes: its `__dict__` by version tag, and what its `__slots__` hold (a
        config declared with `__slots__` or `@dataclass(slots=True)`, which has no dict to tag)."""
        if isinstance(getattr(obj, "__dict__", None), dict):
            self.dict(vars(obj))
        if slots := _slot_values(obj):
            self.slotted.append((obj, tuple((k, id(v)) for k, v in slots.items())))
            self._seen(slots.values())

    def array(self, a) -> None:
        """A NumPy array of numbers by its values (`cfg.scales[0] = 5.0` writes no dict)."""
        self.arrays.append((a, a.dtype, a.shape, a.tobytes()))

    def group(self, group: dict) -> None:
        """Its parameter list and tensors by identity; its numbers are statics, read anew."""
        held = {k: v for k, v in group.items() if isinstance(v, (torch.Tensor, list)) or _tensors_in(v)}
        self.groups.append((group, tuple(group), {k: id(v) for k, v in held.items()}))
        self._seen(held.values())

    def seal(self) -> None:
        self.refs = tuple(ref for ref, _ in self.tensors.values())
        self.flags = tuple(flag for _, flag in self.tensors.values())
        # checked at every call, so sorted by the cheapest check each needs: empty dicts (most of a
        # module tree's buffer and submodule dicts) stay empty; string keys compare as strings
        self._empty = tuple(d for d, keys, _ in self.dicts if not keys)
        self._named = tuple((d, tuple(d), ids) for d, keys, ids in self.dicts
                            if keys and all(type(k) is str for k in d))
        named = {id(d) for d, _, _ in self._named}
        self._other = tuple(e for e in self.dicts if e[1] and id(e[0]) not in named)
        # the others by version tag (an empty dict is told empty cheaper still)
        self._tagged = tuple(i for i, (_, keys, _) in enumerate(self.dicts) if keys)
        self._all = tuple(self.dicts[i][0] for i in self._tagged)
        self.versions = tuple(self.versions[i] for i in self._tagged) if _dict_version is not None else None

    def holds(self) -> bool:
        tensors = tuple(map(operator.call, self.refs))  # (`None in tensors` would compare tensors with ==)
        if not all(map(operator.is_not, tensors, itertools.repeat(None))) or \
                tuple(map(_REQUIRES_GRAD, tensors)) != self.flags:
            return False
        if any(self._empty):
            return False
        if self.versions is not None:  # a dict whose version tag is unchanged was not written to
            now = tuple(map(_dict_version, self._all))
            if now != self.versions:
                if not all(_holds_dict(*self.dicts[self._tagged[i]])
                           for i, (a, b) in enumerate(zip(now, self.versions)) if a != b):
                    return False
                self.versions = now  # written to, holding what it held: checked by tag again from now on
        else:
            for d, keys, ids in self._named:
                if tuple(d) != keys or tuple(map(id, d.values())) != ids:
                    return False
            for d, keys, ids in self._other:
                if not _holds_dict(d, keys, ids):
                    return False
        for seq, ids in self.lists:
            if tuple(map(id, seq)) != ids:
                return False
        for members, ids in self.sets:
            if frozenset(map(id, members)) != ids:
                return False
        for group, keys, held in self.groups:
            if tuple(group) != keys or any(id(group[k]) != i for k, i in held.items()):
                return False
        for obj, held in self.slotted:
            if tuple((k, id(v)) for k, v in _slot_values(obj).items()) != held:
                return False
        for a, dtype, shape, values in self.arrays:
            if a.dtype != dtype or a.shape != shape or a.tobytes() != values:
                return False
        return True


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _holds_dict(d: dict, keys: tuple, ids: tuple) -> bool:
    """`d` holds the keys and values (by identity) it held when read."""
    return len(d) == len(keys) and tuple(map(id, d)) == keys and tuple(map(id, d.values())) == ids


try:  # a dict's version tag (PEP 509): CPython changes it at every write, so an equal one means
    # no write since; torch's guards read it in C, 50 ns a dict, where comparing a module's
    # attributes by identity takes microseconds
    from torch._C._dynamo.guards import dict_version as _dict_version

    _dict_version({})
except Exception:  # (a build or Python without it: every entry compared, as written above)
    _dict_version = None


class _SavedTensorsHooks:
    """A guard on the saved_tensors_hooks held around a call: the same pack and unpack objects."""

    __slots__ = ("ids", "_hooks")

    def __init__(self, hooks):
        self.ids = None if hooks is None else tuple(map(id, hooks))
        self._hooks = hooks  # (kept alive: their ids stay theirs)

    def holds(self) -> bool:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return (None if hooks is None else tuple(map(id, hooks))) == self.ids


def _holds(guard: list) -> bool:
    """Every place a walk read still holds the object it held then (a class's own member is read
    from its `__dict__`: through `getattr`, a staticmethod is another object, and a walk that
    read one was done again at every call)."""
    for entry in guard:
        if type(entry) in (_Unchanged, _AllUnchanged, _SavedTensorsHooks, _SameAttributes, _SameNames):
            if not entry.holds():
                return False
            continue
        holder, name, obj = entry
        now = holder.get(name, _MISSING) if type(holder) in (dict, types.MappingProxyType) else \
            cell_value(holder, _MISSING) if name == "cell_contents" else getattr(holder, name, _MISSING)
        if now is not obj:
            return False
    return True


class _AllUnchanged:
    """A guard on many dicts at once (the attribute dicts of a module tree's tensors, where
    `p.lr_scale = 0.5` set between calls is to be read): their version tags, compared in one C
    loop; where a Python has no version tags, the dicts that hold something, one by one."""

    __slots__ = ("dicts", "versions", "each")

    def __init__(self, dicts: list):
        if _dict_version is not None:
            self.dicts, self.versions, self.each = tuple(dicts), tuple(map(_dict_version, dicts)), ()
        else:
            self.dicts, self.versions, self.each = (), (), tuple(_Unchanged(d) for d in dicts if d)

    def holds(self) -> bool:
        if self.each:
            return all(e.holds() for e in self.each)
        return tuple(map(_dict_version, self.dicts)) == self.versions


class _Unchanged:
    """A guard on a plain dict or list a walk went into: it holds the same keys and objects (a
    dict: the same version tag, so no write since)."""

    __slots__ = ("container", "version", "ids")

    def __init__(self, container):
        self.container = container
        self.version = _dict_version(container) if _dict_version is not None and type(container) is dict else None
        self.ids = None if self.version is not None else self._ids()

    def _ids(self) -> tuple:
        c = self.container
        return (tuple(map(id, c)), tuple(map(id, c.values()))) if isinstance(c, dict) else tuple(map(id, c))

    def holds(self) -> bool:
        if self.version is not None:
            return _dict_version(self.container) == self.version
        return self._ids() == self.ids


class _SameNames:
    """A guard on the names a class holds (`setattr(Config, "smoothing", 0.5)` between calls,
    read as `getattr(Config, "smoothing", 0.0)`): the same set."""

    __slots__ = ("cls", "names")

    def __init__(self, cls: type):
        self.cls, self.names = cls, vars(cls).keys() - ()

    def holds(self) -> bool:
        return vars(self.cls).keys() == self.names


class _SameAttributes:
    """A guard on the attributes an optimizer holds besides its state (which every trace sets
    aside and back): the same names, holding the same objects."""

    __slots__ = ("obj", "held")

    def __init__(self, obj):
        self.obj = obj
        self.held = self._held()

    def _held(self) -> list:
        return [(k, v) for k, v in vars(self.obj).items() if k != "state"]

    def holds(self) -> bool:
        now = self._held()
        return len(now) == len(self.held) and all(k == j and v is w for (k, v), (j, w) in zip(now, self.held))


def _is_library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_DIRS) or SITE_PACKAGES in filename


_SCALAR = object()  # a Root's value for a Python scalar: read anew (`Root.read`) whenever wanted

# A dict or list the function reaches is walked when it holds state (tensors, modules...), or
# when it is no longer than this: its numbers (a config `{"alpha": 0.5}`) key the cache as
# globals do, and what it holds is watched for changes while the function is traced (a counter
# it increments, a scheduler it steps). Longer ones (a vocabulary) are read as they are: walking
# them at every call would cost more than the call.
PLAIN_CONTAINER_ITEMS = 1024


# Immutable values a trace reads as constants, keyed by value: Python's numbers, strings and
# flags, torch's dtypes and devices (`x.to(DTYPE)` with a global DTYPE), and enum members.
_SCALAR_TYPES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.memory_format,
                 torch.layout, enum.Enum, fractions.Fraction, decimal.Decimal)


def _is_scalar(x) -> bool:
    """A Python number, string, bool or None, a torch dtype or device, an enum member, or a
    tuple or frozenset of them."""
    if isinstance(x, (tuple, frozenset)):
        return all(_is_scalar(v) for v in x)
    return x is None or isinstance(x, _SCALAR_TYPES)


def _is_numbers_array(x) -> bool:
    """A NumPy array (or NumPy scalar) of numbers, of at most PLAIN_CONTAINER_ITEMS elements."""
    np = sys.modules.get("numpy")
    return (np is not None and isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind in "biufc"
            and x.size <= PLAIN_CONTAINER_ITEMS)


def _array_values(x):
    """What keys the cache for a NumPy array a function reads: its shape, dtype and values."""
    if _is_numbers_array(x):
        return ("ndarray", x.shape, str(x.dtype), tuple(x.ravel().tolist()))
    return x if _is_scalar(x) else ("object", type(x).__name__, id(x))


def _array_reader(read):
    return lambda: _array_values(read())


def is_config(x) -> bool:
    """An argument that is an object holding Python values (an instance of the user's class, an
    argparse or SimpleNamespace config): what the trace reads from it is baked into the program,
    so its values (`object_key`) key the cache."""
    return _is_user_object(x) and not isinstance(x, (torch.nn.Module, torch.optim.Optimizer, Sharded)) \
        and not callable(x)


def is_user_object(x) -> bool:
    """An instance of a class of the user's, with attributes (`_is_user_object`)."""
    return _is_user_object(x)


def is_config_argument(x) -> bool:
    """An argument keyed by its values (`object_key`): a config (`is_config`), an object of the
    user's that the function calls (`act = Scale(2.0)`), whose `__call__` reads its values and its
    class's, a class of the user's passed as a namespace (`f(x, Hyper)`, read as `ns.lr`), or a
    function the function calls (the user's own, by the globals and closure it reads; a partial by
    what it binds; a method of such an object): each was keyed by identity, and a value changed on
    it ran the first program."""
    return is_config(x) or _is_called_object(x) or isinstance(x, type) and _is_user_class(x) or \
        _is_user_function(x) or isinstance(x, functools.partial) or \
        isinstance(x, types.ModuleType) and _is_user_module(x) or \
        isinstance(x, types.MethodType) and (is_config(x.__self__) or _is_called_object(x.__self__)
                                             or isinstance(x.__self__, type) and _is_user_class(x.__self__)
                                             or isinstance(x.__self__, torch.nn.Module))


_CONSTRUCTORS = ("__new__", "__init__", "__post_init__")  # what making an instance runs
_ALIASES = "<places holding one tensor>"  # a statics key: which places hold a tensor lifted by another name
# a class's special methods that no step's arithmetic runs (printing, pickling, its own bookkeeping)
_NOT_WALKED = frozenset(["__repr__", "__str__", "__format__", "__del__", "__getstate__", "__setstate__", "__reduce__",
                         "__reduce_ex__", "__init_subclass__", "__dir__", "__sizeof__", "__hash__", "__eq__", "__ne__",
                         "__copy__", "__deepcopy__", "__class_getitem__", "__subclasshook__"])


def _walked_member(k: str, v) -> bool:
    """Whether a user class's member `k` is walked for what it reads: its methods and values,
    and its special methods a step may run (`__call__`, `__getitem__`, `__mul__`, `__iter__`,
    `__enter__`: a global read in one keys the program too), not its constructors (walked where
    the class is made inside, `_CONSTRUCTORS`) nor its printing and pickling."""
    if not k.startswith("__"):
        return True
    return k not in _NOT_WALKED and k not in _CONSTRUCTORS and isinstance(v, (types.FunctionType, staticmethod,
                                                                               classmethod, property))


def _is_block_mask(x) -> bool:
    """A flex_attention BlockMask (`create_block_mask`)."""
    cls = type(x)
    return cls.__name__ == "BlockMask" and cls.__module__ == "torch.nn.attention.flex_attention"


def _is_user_function(x) -> bool:
    """A Python function (a lambda too) of the user's code, not a library's."""
    return isinstance(x, types.FunctionType) and not _is_library(x.__code__.co_filename)


_KEY_MEMO: dict | None = None  # (kind, id, depth) -> key of the classes and functions one walk has met


def object_key(x, depth: int = 8, _path: tuple = ()):
    """A hashable snapshot of the values a config object holds: its numbers, strings and flags,
    NumPy arrays of numbers, and the dicts, lists and objects of them it holds (to `depth`
    levels, as deep as a module's objects are read, `HELD_DEPTH`; containers to
    PLAIN_CONTAINER_ITEMS items); another hashable value as itself, any
    other by identity. Equal snapshots: a trace reading it records the same program. An object
    met again inside itself (`self.me = self`) is a mark of how many levels up it was met, not
    walked again. Each class and function is walked once per walk and depth (`_KEY_MEMO`): a
    library outside site-packages (a clone on PYTHONPATH), whose classes name each other in
    their methods, was walked again along every path, a first call of minutes."""
    return _one_walk(_object_key, x, depth, _path)


def _one_walk(make, *args):
    """`make(*args)` as one key walk: the outermost call holds the memo (`_KEY_MEMO`) that every
    nested call shares, and drops it at its end."""
    global _KEY_MEMO
    if _KEY_MEMO is not None:
        return make(*args)
    _KEY_MEMO = {}
    try:
        return make(*args)
    finally:
        _KEY_MEMO = None


def _memoized(kind: str, x, depth: int, make) -> "_Shared":
    """`make()`, or the key this walk made of `x` already at this depth."""
    memo = _KEY_MEMO
    found = memo.get((kind, id(x), depth), _MISSING)
    if found is _MISSING:
        found = memo[(kind, id(x), depth)] = _Shared(make())
    return found


class _Shared:
    """A class's or function's key (`_memoized`), held at every place its class or function is
    named: its hash made once, and one found equal made the same, so that a key holding it many
    times hashes and compares in time linear in its distinct parts (nested tuples hash and compare
    each copy again: exponential in how deep classes name classes)."""

    __slots__ = ("key", "_hash")

    def __init__(self, key):
        self.key, self._hash = key, hash(key)

    def __eq__(self, other) -> bool:
        if self is other or type(other) is _Shared and other.key is self.key:
            return True
        if type(other) is not _Shared or other._hash != self._hash or other.key != self.key:
            return False
        other.key = self.key  # (equal: the next comparison of the two is by identity)
        return True

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return repr(self.key)


def _unshared(key):
    return key.key if type(key) is _Shared else key


def _object_key(x, depth: int, _path: tuple):
    if _is_scalar(x):
        return Exact(x)  # (1, 1.0 and True: three programs, as arguments are)
    if _is_numbers_array(x):
        return Exact(_array_values(x))
    if id(x) in _path:  # (which ancestor: `c.back = a` and `c.back = c` are different programs)
        return ("cycle", len(_path) - _path.index(id(x)))
    if depth:
        _path = (*_path, id(x))
    if depth and isinstance(x, dict) and _length(x) <= PLAIN_CONTAINER_ITEMS:
        items = tuple((Exact(k), object_key(v, depth - 1, _path)) for k, v in x.items())
        if type(x) is not dict and (own := _own_dict(x)):  # a dict subclass's own attributes too (`cfg.sub.alpha`)
            return ("dict", items, tuple((k, object_key(v, depth - 1, _path)) for k, v in list(own.items())
                                         if not k.startswith("__")))
        return ("dict", items)
    if depth and isinstance(x, (list, tuple, collections.deque)) and _length(x) <= PLAIN_CONTAINER_ITEMS:
        return (type(x).__name__, tuple(object_key(v, depth - 1, _path) for v in x))
    if depth and type(x) in (set, frozenset) and len(x) <= PLAIN_CONTAINER_ITEMS:  # (of objects of the user's:
        return (type(x).__name__, tuple(sorted(repr(object_key(v, depth - 1, _path)) for v in x)))  # by their values)
    if depth and _is_user_function(x):
        return _memoized("function", x, depth, lambda: _function_key(x, depth, _path))
    if depth and isinstance(x, types.ModuleType) and _is_user_module(x):  # a config module (`import settings`):
        return ("module", x.__name__, tuple((k, object_key(v, depth - 1, _path)) for k, v in list(vars(x).items())
                                            if not k.startswith("_") and (not isinstance(v, types.ModuleType)
                                                                          or _is_user_module(v))))  # (`c.train.LR`)
    if depth and isinstance(x, type) and _is_user_class(x):  # a class of the user's as a namespace (`ns.lr`):
        return _class_key(x, depth, _path), ()  # its values and methods, as an instance's class's
    if depth and (is_config(x) or _is_called_object(x)):  # (one that is called: its type's `__call__` reads them)
        return (_class_key(type(x), depth, _path),
                tuple((k, object_key(v, depth - 1, _path)) for k, v in attributes(x).items()))
    if depth and isinstance(x, torch.nn.Module):  # (one a container holds, not a submodule: `{"a": Act()}`,
        return (_class_key(type(x), depth, _path),  # its class (a forward patched), its values, those of what it
                tuple((k, object_key(v, depth - 1, _path)) for k, v in vars(x).items()  # holds, its hooks (one
                      if k not in _MODULE_INTERNALS),  # added between calls runs in the next) and its submodules'
                tuple((kind, tuple(object_key(h, depth - 1, _path) for h in getattr(x, kind).values()))
                      for kind in _HOOK_DICTS if getattr(x, kind, None)),
                tuple((kind, tuple(object_key(h, depth - 1, _path) for h in hooks.values()))  # (and those torch
                      for kind in _GLOBAL_HOOK_DICTS  # runs for every module: `register_module_forward_hook`)
                      if (hooks := getattr(torch.nn.modules.module, kind, None))),
                tuple((k, object_key(v, depth - 1, _path)) for k, v in x._modules.items()))
    if depth and _is_plain_object(x) and not callable(x):  # (a library's config in a list: its public values)
        return (type(x).__qualname__, tuple((k, object_key(v, depth - 1, _path)) for k, v in vars(x).items()
                                             if _is_public_value(k)))
    if depth and _is_plain_object(x) and callable(x) and keyed_library_object(x):  # (a distribution's transform:
        return (_by_identity(x), _library_items(x, depth, _path))  # its values, and which one it is)
    if depth and isinstance(x, functools.partial):  # (by its function and what it binds, changed in place too:
        return ("partial", object_key(x.func, depth - 1, _path), object_key(x.args, depth, _path), object_key(x.keywords, depth, _path))
    if depth and isinstance(x, types.MethodType):  # `p.keywords["slope"] = 0.5`; a bound method by its object)
        return ("method", object_key(x.__func__, depth - 1, _path), object_key(x.__self__, depth - 1, _path))
    if isinstance(x, (torch.Tensor, Sharded)):  # (compared by identity: a tensor's == is elementwise)
        return _TensorKey(id(x))
    return _by_identity(x)


def _by_identity(x):
    """`x` itself where it hashes (by identity, as an object of a class without `__eq__`), else a
    mark of its identity."""
    try:
        hash(x)
    except TypeError:
        return ("object", type(x).__name__, id(x))
    return x


def keyed_library_object(x) -> bool:
    """A library's object whose values the function reads as numbers it bakes in, and which
    holds little else: a torch.distributions transform, distribution or constraint, a
    transformers config. Other library objects a function reaches (a logger, a progress bar, a
    scheduler or data loader a trainer holds) are reached without being read, and change at
    every step: keying by them compiled a program per call."""
    module = type(x).__module__
    return module.startswith("torch.distributions") or any(
        c.__name__ in ("PretrainedConfig", "PreTrainedConfig") and c.__module__.startswith("transformers")
        for c in type(x).__mro__)


def _library_items(x, depth: int, _path: tuple) -> tuple:
    """A keyed library object's public values and those its properties read (an inverse
    transform's `_inv`)."""
    exposed = _read_by_properties(type(x))
    return tuple((k, object_key(v, depth - 1, _path)) for k, v in list(vars(x).items())
                 if _is_public_value(k) or k in exposed)


LIBRARY_DEPTH = 8  # how deep the values of a library's object the function reaches key the program (as HELD_DEPTH)


class LibraryValues:
    """What a library's object the function reaches keys the program by (`keyed_library_object`:
    a distribution's transform, a transformers config held in a global): its public values and
    those its properties read, `LIBRARY_DEPTH` levels deep (`object_key`); a callable one by its
    identity too. Each was baked into the trace (a transform's `scale`)."""

    __slots__ = ("kind", "values", "_hash")

    def __init__(self, obj):
        self.kind = _by_identity(obj) if callable(obj) else type(obj).__qualname__
        self.values = _one_walk(_library_items, obj, LIBRARY_DEPTH, ())  # ((name, key), ...)
        self._hash = hash((self.kind, self.values))

    def __eq__(self, other) -> bool:
        return self is other or type(other) is LibraryValues and self._hash == other._hash and \
            self.kind == other.kind and self.values == other.values

    def __hash__(self) -> int:
        return self._hash

    def changes(self, other: "LibraryValues") -> list[tuple[str, object, object]]:
        """(attribute, key here, key in `other`) of each value that differs."""
        mine, theirs = dict(self.values), dict(other.values)
        return [(k, mine.get(k, _MISSING), theirs.get(k, _MISSING)) for k in dict.fromkeys([*mine, *theirs])
                if mine.get(k, _MISSING) != theirs.get(k, _MISSING)]

    def __repr__(self) -> str:
        return f"<{len(self.values)} values of a {self.kind if isinstance(self.kind, str) else type(self.kind).__name__}>"


def _global_key(v, code: types.CodeType, depth: int, _path: tuple):
    """`object_key` of a value a function's code loads: a module of the user's (`import config`)
    by the attributes the code reads of it (`config.LR`, `cfgpkg.config.LR`), which a module's
    identity does not show."""
    if isinstance(v, types.ModuleType) and _is_user_module(v) and depth:
        scope = vars(v)
        return ("module", v.__name__, tuple((a, _global_key(scope[a], code, depth - 1, _path))
                                            for a in sorted(_attribute_names(code) & scope.keys())))
    return object_key(v, depth, _path)


@attrs.frozen
class _TensorKey:
    """A tensor in an `object_key`, by identity (a tensor's == is elementwise); a message shows
    it as a tensor, not as its id."""

    ident: int

    def __repr__(self):
        return "a tensor"


def _function_key(x, depth: int, _path: tuple):
    """A user function in its `object_key`: by its code, the globals it loads, its closure's
    values, its defaults and own numbers: what a call reads (a lambda made anew at each call with
    the same values is the same)."""
    cells = tuple(cell_value(c, _MISSING) for c in x.__closure__ or ())
    code, scope = x.__code__, x.__globals__
    own = tuple((k, object_key(v, depth - 1, _path)) for k, v in vars(x).items() if not k.startswith("__"))
    return ("function", _Same(code), own, tuple((name, _global_key(scope[name], code, depth - 1, _path))
                                                for name in _global_names(code) if name in scope),
            tuple(_global_key(v, code, depth - 1, _path) for v in cells),
            object_key(x.__defaults__, depth - 1, _path), object_key(x.__kwdefaults__, depth - 1, _path))


def _class_key(cls: type, depth: int, _path: tuple):
    return _memoized("class", cls, depth, lambda: _class_key_of(cls, depth, _path))


def _class_key_of(cls: type, depth: int, _path: tuple):
    """A user object's class in its `object_key`: the class itself (two classes of one name, made
    by `type()` or defined twice, are two programs: their code and values differ) and the values
    its user classes hold (`Cfg.v = 4.0` between calls, read as `c.v`, is another program), the
    methods and properties by identity (one patched on the class: compiled again). A library's
    class: its name."""
    if not _is_user_class(cls):
        return cls.__qualname__
    held = []
    for c in cls.__mro__[:-1]:
        if not _is_user_class(c) or c.__module__.startswith("torch."):
            continue
        for k, v in list(vars(c).items()):
            if not _walked_member(k, v):
                continue
            if isinstance(v, (types.FunctionType, staticmethod, classmethod, property)):  # (by identity: one
                code = v.fget if isinstance(v, property) else getattr(v, "__func__", v)  # patched on the class is
                held.append((c.__qualname__, k, _Same(v), object_key(code, depth - 1, _path)  # another; and what its
                             if isinstance(code, types.FunctionType) else None))  # code reads: a global it loads)
            else:
                held.append((c.__qualname__, k, object_key(v, depth - 1, _path)))
    return ("class", _Same(cls), tuple(held))


def class_key(cls: type):
    """What a user's class holds, as a cache key (`_class_key`): the class, its values and methods."""
    return _one_walk(_class_key, cls, 4, ())


def is_user_class(cls: type) -> bool:
    """A class defined in the user's code or made at run time (`_is_user_class`)."""
    return _is_user_class(cls)


def class_difference(cached, given) -> tuple[str, str] | None:
    """Where the `object_key`s of two configs of one repr differ in their class (`_class_key`),
    as (cached, given) text: another class of the same name, or a value or method its class holds
    (`Cfg.created = 3`, then 4); None where their classes agree."""
    if not (type(cached) is tuple and type(given) is tuple and len(cached) == len(given) == 2) or \
            cached[0] == given[0]:
        return None
    a, b = _unshared(cached[0]), _unshared(given[0])
    if not (type(a) is tuple and type(b) is tuple and a[0] == b[0] == "class"):
        return str(a), str(b)
    if a[1] != b[1]:
        return f"class {a[1]!r}", f"another class of that name ({b[1]!r}, made since)"
    held_a, held_b = {(q, k): rest for q, k, *rest in a[2]}, {(q, k): rest for q, k, *rest in b[2]}
    for q, k in sorted(held_a.keys() | held_b.keys()):
        if held_a.get((q, k), _MISSING) != held_b.get((q, k), _MISSING):
            def shown(held):
                v = held.get((q, k), _MISSING)
                if v is _MISSING:
                    return f"{q}.{k} absent"
                if len(v) == 2:  # a method: itself, and what its code reads
                    return f"{q}.{k}, a method reading {_reads_text(v[1])}"
                return f"{q}.{k} = {v[0]!r}"
            return shown(held_a), shown(held_b)
    return None


def class_changes(cached, given, obj) -> list[tuple[str, object, object]]:
    """(`Class.name`, value before, value now) of each value of `obj`'s class (`obj` a config or
    a class, `cached` and `given` its `object_key`s) that differs, each plain value set back on
    its class as it was (the call that changed it is refused); _MISSING where absent."""
    if not (type(cached) is tuple and type(given) is tuple and len(cached) == len(given) == 2):
        return []
    a, b = _unshared(cached[0]), _unshared(given[0])
    if not (type(a) is tuple and type(b) is tuple and a[0] == b[0] == "class" and a[1] == b[1]):
        return []
    owners = {c.__qualname__: c for c in (obj if isinstance(obj, type) else type(obj)).__mro__}
    held_a, held_b = {(q, k): rest for q, k, *rest in a[2]}, {(q, k): rest for q, k, *rest in b[2]}
    out = []
    for q, k in sorted(held_a.keys() | held_b.keys()):
        was, now = held_a.get((q, k), [_MISSING]), held_b.get((q, k), [_MISSING])
        if was == now:
            continue
        out.append((f"{q}.{k}", was[0], now[0]))
        if len(was) == 1 and isinstance(was[0], Exact) and q in owners:
            setattr(owners[q], k, was[0].value)
        elif was[0] is _MISSING and q in owners and k in vars(owners[q]):  # (made by the step: taken away)
            delattr(owners[q], k)
    return out


def _reads_text(key) -> str:
    """The globals a method's `object_key` holds, as text (`G = 1.0`), for a retrace warning."""
    key = _unshared(key)
    if not (type(key) is tuple and key and key[0] == "function"):
        return "its globals"
    return ", ".join(f"{name} = {value!r}" for name, value in key[3]) or "no globals"


# containers `_holds_any` looks into: the plain ones and the standard library's dicts
_PLAIN_KINDS = (list, tuple, dict, collections.OrderedDict, collections.defaultdict)


def _holds_any(container, found, depth: int = 3) -> bool:
    """A list, tuple or dict holding a value `found` is true of (nested `depth` deep); a
    namedtuple, a dataclass or a plain object of the user's too (`self.heads = Heads(a=Linear(...),
    ...)`, a SimpleNamespace)."""
    if depth <= 0:
        return False
    if type(container) in _PLAIN_KINDS or _is_namedtuple(container):
        if _length(container) > PLAIN_CONTAINER_ITEMS:  # (a subclass may be anything: e3nn's Irreps, a tuple,
            return False  # refuses len())
        items = container.values() if isinstance(container, dict) else container
    elif (dataclasses.is_dataclass(container) or _is_plain_object(container)) and not isinstance(container, type) \
            and _is_user_object(container):
        items = attributes(container).values()
    else:
        return False
    return any(found(v) or _holds_any(v, found, depth - 1) for v in items)


def _object_with_tensors(v) -> bool:
    """An object of the user's (not a module) holding tensors as attributes."""
    return _is_user_object(v) and not isinstance(v, (torch.nn.Module, torch.Tensor)) \
        and any(isinstance(a, torch.Tensor) for a in attributes(v).values())


def _is_namedtuple(v) -> bool:
    return isinstance(v, tuple) and hasattr(type(v), "_fields")


def _is_optimizer(v) -> bool:
    return isinstance(v, torch.optim.Optimizer)


def _unregistered_module(tree: set | None):
    """Whether a value is a module with state whose id is not in `tree` (the modules registered)."""
    return lambda v: isinstance(v, torch.nn.Module) and (tree is None or id(v) not in tree) and \
        next(itertools.chain(v.parameters(), v.buffers()), None) is not None


def _length(container) -> int:
    """A dict's, list's, tuple's or deque's length by its base class (a subclass may refuse
    `len()`: e3nn's `Irreps`, a tuple, raises NotImplementedError)."""
    for base in (dict, list, tuple, collections.deque):
        if isinstance(container, base):
            return base.__len__(container)
    return len(container)


def _holds_state(container) -> bool:
    items = container.values() if isinstance(container, dict) else container
    kinds = (torch.Tensor, Sharded, torch.nn.Module, torch.optim.Optimizer, dict, list, tuple)
    return any(isinstance(v, kinds) and (not isinstance(v, (dict, list, tuple)) or _holds_state(v)) for v in items)


def _item_reader(read_seq, i: int):
    return lambda: read_seq()[i]


def _key_identity(k):
    """A dict key by what `_rekey` put: a tensor by identity, an int (a tensor's id) by value."""
    return ("int", k) if type(k) is int else id(k)


def _rekeyed_back(container, real: dict) -> None:
    """A dict or set keyed by stand-ins during a trace keyed by what they stood in for (`real`:
    `_key_identity` of a stand-in key -> the key), in its order."""
    if type(container) is set:
        members = list(container)
        container.clear()
        container.update(real.get(_key_identity(k), k) for k in members)
        return
    items = list(container.items())
    container.clear()
    container.update((real.get(_key_identity(k), k), v) for k, v in items)


def _sequence_writer(seq, i: int, read_seq, write_seq):
    if isinstance(seq, list):
        return functools.partial(seq.__setitem__, i)
    if write_seq is None:
        return None

    def write(v):  # a tuple is rebuilt at its own place, from the one there now (a write to
        current = read_seq()  # another of its items may have rebuilt it since the walk)
        items = list(current if isinstance(current, tuple) and len(current) == len(seq) else seq)
        items[i] = v
        write_seq(type(seq)(items) if type(seq) is tuple else type(seq)(*items))

    return write


def _is_name(key) -> bool:
    """A dict key a slot can be named by."""
    return type(key) in (str, int) and "." not in str(key)


def _is_plain_key(key, depth: int = 3) -> bool:
    """A dict key whose repr names it the same in every process: a string, a number, a flag, or
    a tuple of them (`"0.weight"`, a parameter's qualified name)."""
    if type(key) is tuple:
        return depth > 0 and all(_is_plain_key(k, depth - 1) for k in key)
    return type(key) in (str, int, bool, float)


def _entry_name(base: str, attr: str, key) -> str:
    """The name of what a module's dict holds under `key` (a plain key): `model.cache.k`, or
    `model.bufs['0.weight']` where the key is no name (a parameter's qualified name)."""
    return _join(base, f"{attr}.{key}") if _is_name(key) else f"{_join(base, attr)}[{key!r}]"


def _default_of(fn, i: int):
    return fn.__defaults__[i]


def _default_writer(fn, i: int):
    def write(v):  # a function's defaults are a tuple: rebuilt with the new value
        items = list(fn.__defaults__)
        items[i] = v
        fn.__defaults__ = tuple(items)

    return write


_TYPES_OWN = frozenset(v for v in vars(types).values() if isinstance(v, type))


def _made_at_run_time(cls: type) -> bool:
    """A class made by `dataclasses.make_dataclass` or `types.new_class`, which Python names after
    the `types` module (not one of that module's own classes): the user's."""
    return cls.__module__ == "types" and cls not in _TYPES_OWN


def _is_user_object(obj) -> bool:
    """An instance of a class defined in the user's code (not a library's), with attributes, or
    a namespace of them (`argparse`'s parsed arguments, a `SimpleNamespace` config)."""
    if isinstance(obj, (type, types.ModuleType)):
        return False
    if not isinstance(getattr(obj, "__dict__", None), dict) and not _declares_slots(type(obj)):
        return False
    if type(obj) in (argparse.Namespace, types.SimpleNamespace):
        return True
    if _made_at_run_time(type(obj)):
        return True
    module = sys.modules.get(type(obj).__module__)
    filename = getattr(module, "__file__", None)
    return module is not None and (filename is None or not _is_library(filename))


@functools.lru_cache(maxsize=_CODE_CACHE)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names `code` (and the functions, lambdas and comprehensions inside it) loads as globals."""
    names = [i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return tuple(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------
# The state a call reads: slots by name
# ---------------------------------------------------------------------------------------------


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


@attrs.frozen(eq=False)
class State:
    """What a call reads besides its arguments, found anew at every call."""

    slots: dict  # name -> Slot, tensors and gradients and optimizer state, in a stable order
    statics: dict  # name -> hashable Python value deciding the trace (training flags, learning rates)
    roots: tuple
    opaque: tuple
    param_names: dict  # id(tensor) -> its name: optimizer state is named after its parameter
    # (name, read, write, id of the tensor) of each further place holding a lifted tensor (`self.a = self.b =
    # t`, `self.stats = {"last": self.ema}`): one input, lifted by its first name; one the step rebinds is put
    aliases: tuple = ()
    # (name, write) of each further key of an optimizer's state holding a lifted tensor (`st["keep"] = st["m"]`)
    shared_writes: tuple = ()

    def root(self, name: str):
        return next(r.value for r in self.roots if r.name == name)

    _reads: tuple = attrs.field(init=False, repr=False)  # (names, read functions): read at every call

    # the slots holding a Python number read as a tensor (written back as a number)
    scalar_names: frozenset = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "_reads", (tuple(self.slots), tuple(slot.read for slot in self.slots.values())))
        object.__setattr__(self, "scalar_names", frozenset(name for name, slot in self.slots.items() if slot.scalar))

    def values(self, skip_ids=frozenset()) -> dict:
        """name -> the tensor (or Sharded value) each slot holds now, for slots holding one."""
        names, reads = self._reads
        return {name: v for name, v in zip(names, map(operator.call, reads)) if v is not None and id(v) not in skip_ids}


def collect(roots: list[Root], opaque=(), snapshot: Snapshot | None = None) -> State:
    """Every slot the roots hold now, named; problems (state hpfun cannot lift) raise together.
    `snapshot` records what the walk read (see `Snapshot`)."""
    snapshot = snapshot or Snapshot()
    slots: dict[str, Slot] = {}
    names: dict[int, str] = {}  # id(tensor) -> first name: a tensor held in two places is one input
    aliases: list = []  # and the other places holding it (`State.aliases`)
    shared: list = []  # (name, first name) of optimizer state holding a tensor held by another name
    shared_writes: list = []  # (name, write) of those
    alive: list = []  # every value read, kept until the walk ends: a slot reading a new tensor each time
    problems: list[Problem] = []  # (a Python number as a 0-d tensor) would free it, and its id be another's

    def add(name, read, write, **kw) -> bool:
        v = read()
        if v is not None and id(v) in names:
            if write is not None and names[id(v)] != name and (not kw.get("follows") or name.endswith(".grad")):
                aliases.append((name, read, write, id(v)))  # (a gradient that is a tensor lifted already: `p.grad = buf`)
            elif write is not None and names[id(v)] != name:  # (optimizer state under a second key: one
                shared.append((name, names[id(v)]))  # tensor, written back as one; which keys keys the program)
                shared_writes.append((name, write))
            return False
        if v is not None:
            names[id(v)] = name
            alive.append(v)
        slots[name] = Slot(name, read, write, **kw)
        return True

    for root in roots:
        if isinstance(root.value, torch.nn.Module):
            _module_slots(root.name, root.value, add, snapshot)
    opaque = list(opaque)
    # tensors the function names itself before the optimizers holding them: `W` keeps its name
    # (and its state_specs entry), not `opt.params.0.0`, whichever the function mentions first
    for root in sorted(roots, key=lambda r: isinstance(r.value, torch.optim.Optimizer)):
        if isinstance(root.value, torch.optim.Optimizer):
            _optimizer_slots(root.name, root.value, add, names, problems, snapshot, opaque)
        elif root.value is not _SCALAR and not isinstance(root.value, (torch.nn.Module, _Keyed, _Inherited)) and \
                id(root.value) in names:  # another place of a tensor lifted already
            if root.write is not None and isinstance(root.value, torch.Tensor) and root.read() is root.value:
                add(root.name, root.read, root.write)
        elif root.value is not _SCALAR and not isinstance(root.value, (torch.nn.Module, _Keyed, _Inherited)):
            leaf = isinstance(root.value, torch.Tensor) and root.value.requires_grad and root.value.is_leaf
            if add(root.name, root.read, root.write or _cannot_write(root.name), requires_grad=leaf) and leaf:
                # a tensor made with requires_grad=True (a from-scratch model: `w -= lr * w.grad`): its gradient too
                add(f"{root.name}.grad", functools.partial(_grad_at, root.read), functools.partial(_set_grad_at, root.read),
                    follows=root.name)
    if problems:
        raise CaptureError(problems, headline="cannot lift the state the function reads")
    snapshot.seal()
    # every tensor's name by id, frozen parameters' too: an optimizer's state of a parameter
    # that gets no gradient this step is still its own, and stays
    params = {id(v): name for name, slot in slots.items() if slot.follows is None and (v := slot.read()) is not None
              and not alive.append(v)}  # (kept alive too: a freed number's id is another's)
    found = statics(roots)
    if aliases or shared:  # which places hold one tensor keys the program (`self.c = self.a`, then a swap: `c`
        # is `b`; `st["keep"] = st["m"]`, then m and v swapped: keep is v)
        found[_ALIASES] = tuple((name, names.get(held)) for name, _, _, held in aliases) + tuple(shared)
    return State(slots, found, tuple(roots), tuple(opaque), params, tuple(aliases), tuple(shared_writes))


def statics(roots, known: dict | None = None) -> dict:
    """The Python values that decide what a trace records: the scalars the function reads from
    closures and globals (a learning rate `lr`), each module tree's training flags and the
    Python values its modules hold (`ModuleValues`), each optimizer's hyperparameters (its
    learning rate, betas...). `known`: the statics of an earlier call whose module trees (and
    so their flags and values) are unchanged."""
    out: dict[str, object] = torch_state()  # (a step called under torch.no_grad or autocast traces another program)
    for root in roots:
        if root.value is _SCALAR:
            value = root.read()  # (a number by its type and sign; the bindings read as they are, shown by name)
            out[root.name] = value if type(value) is Bindings else Exact(value)
        elif isinstance(root.value, torch.nn.Module):
            name = training_key(root.name)
            out[name] = known[name] if known is not None else tuple(m.training for m in root.value.modules())
            name = _join(root.name, VALUES)
            out[name] = known[name] if known is not None else ModuleValues.of(root.name, root.value)
        elif isinstance(root.value, torch.optim.Optimizer):
            for g, group in enumerate(root.value.param_groups):
                # which tensors the group updates (taken out of the optimizer, added to it)
                out[_join(root.name, f"param_groups.{g}.params")] = _Identities(group["params"])
                lifted = lifted_scalars(root.value, group)  # inputs, read at every call: their signs key the cache
                for key, v in group.items():
                    if key != "params" and not isinstance(v, torch.Tensor) and key not in {k for k, _ in lifted.values()}:
                        out[_join(root.name, f"param_groups.{g}.{key}")] = \
                            _hashable(tuple(_TENSOR_HELD if isinstance(x, torch.Tensor) else x for x in v)
                                      if _tensors_in(v) else v) if not _is_config_object(v) else object_key(v)
                for name, (key, index) in lifted.items():
                    out[_join(root.name, f"param_groups.{g}.{name}.sign")] = _sign(group[key] if index is None else group[key][index])
                for key, v in group.items():  # a hyperparameter kept in a tensor: an input, its sign keys the cache
                    for i, x in _group_tensors(key, v):
                        if (sign := _tensor_sign(x)) is not None:
                            out[_join(root.name, f"param_groups.{g}.{key}{'' if i is None else f'.{i}'}.sign")] = sign
            # what a step reads from its defaults (timm's Lamb reads `self.defaults["max_grad_norm"]` at every
            # step) keys the program, as a group's values do
            for key, v in root.value.defaults.items():
                if key != "params" and not isinstance(v, torch.Tensor) and not _tensors_in(v):  # (a config object:
                    out[_join(root.name, f"defaults.{key}")] = object_key(v) if _is_config_object(v) else _hashable(v)
                    # by the values it holds, which a schedule may change in place)
                for i, x in _group_tensors(key, v):  # (one kept in a tensor: an input, its sign keys the cache)
                    if (sign := _tensor_sign(x)) is not None:
                        out[_join(root.name, f"defaults.{key}{'' if i is None else f'.{i}'}.sign")] = sign
            out.update(_state_numbers(root.name, root.value, known))
    if keyed := [root for root in roots if isinstance(root.value, _Keyed)]:
        # which keys of a dict or set keyed by tensors are the tensors lifted now: a parameter replaced
        # by another between calls is no longer the key (eager's lookup misses; the program hit it)
        lifted = {id(t) for root in roots if isinstance(root.value, torch.nn.Module)
                  for t in itertools.chain(root.value.parameters(), root.value.buffers())}
        lifted |= {id(root.value) for root in roots if isinstance(root.value, torch.Tensor)}
        for root in keyed:
            out[f"{root.name}.<lifted keys>"] = tuple(_key_lifted(k, lifted) for k in root.value.container)
    return out


def _key_lifted(key, lifted: set) -> bool:
    if isinstance(key, torch.Tensor):
        return id(key) in lifted
    if type(key) is int:
        return key in lifted
    return type(key) in (tuple, frozenset) and any(_key_lifted(k, lifted) for k in key)


class _Identities(tuple):
    """The tensors a param group holds, compared by identity (a cache key's part); shown by
    their shapes."""

    def __new__(cls, tensors):
        return super().__new__(cls, (id(t) for t in tensors))

    def __init__(self, tensors):
        self.shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors]

    def __repr__(self):
        return f"{len(self)} tensors {self.shapes}"


def _state_numbers(name: str, opt, known: dict | None) -> dict:
    """The Python numbers and flags in an optimizer's per-parameter state (timm's Muon keeps
    `use_muon`), by parameter position: statics. `known` (the statics of a walk whose snapshot
    still holds) has them: the state's dicts hold the same objects."""
    prefix = _join(name, "state.")
    if known is not None:
        return {k: v for k, v in known.items() if k.startswith(prefix)}
    out = {}
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            for key, v in opt.state.get(p, {}).items():  # (a number, or a dict or list of them: `meta["n"] += 1`)
                if not isinstance(v, torch.Tensor) and (_is_scalar(v) or type(v) in (dict, list) and _is_plain_data(v)):
                    out[f"{prefix}{g}.{i}.{key}"] = _hashable(v)
    for key, v in list(opt.state.items()):  # a number (or plain data) under a key of the optimizer's own
        if not isinstance(key, torch.Tensor) and _is_plain_key(key) and _is_plain_data(v):
            out[f"{prefix}[{key!r}]"] = _hashable(v)
    return out


GRAD_MODE = "torch.is_grad_enabled()"  # the statics key of the caller's grad mode


def torch_state() -> dict:
    """torch's global modes the caller sets around a call, which a trace bakes in: grad mode,
    autocast (CPU and CUDA, on and its dtype), the default dtype (`torch.ones(3)`'s), and
    deterministic algorithms (ops choose their kernels by it). A statics entry each."""
    return {GRAD_MODE: torch.is_grad_enabled(),
            "torch.is_autocast_enabled('cpu')": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
            "torch.is_autocast_enabled('cuda')": (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")),
            "torch.get_default_dtype()": torch.get_default_dtype(),
            "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
            SAVED_TENSORS_HOOKS: _saved_tensors_hooks()}


SAVED_TENSORS_HOOKS = "torch.autograd.graph.saved_tensors_hooks"


def _saved_tensors_hooks():
    """The pack and unpack hooks of a `torch.autograd.graph.saved_tensors_hooks` (or
    `save_on_cpu`) the caller holds around a call, which the trace runs and bakes in: a function
    by its code, a partial by its function, an object of the user's by its class (the numbers
    they read are walked and key the program on their own: `find_roots`; a `save_on_cpu()` made
    at every step makes new functions of the same code), None without."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    return tuple(_binding(h) or _Same(type(h)) for h in hooks)


def training_key(root: str) -> str:
    """The statics key of a module tree's training flags."""
    return _join(root, "training")


VALUES = "<python values>"  # the statics key of a module tree's ModuleValues


class ModuleMoves:
    """The submodule places a step gives modules its tree held before the call, as (the holder's
    name, the key in its `_modules`, the name of the module it gets), names as `ModuleValues.of`
    gives them: made by every call of the program (`replay`), the modules found by name in that
    call's tree (which keys the program: `ModuleValues` names each module held at two places),
    all read before any is moved (a swap)."""

    __slots__ = ("moves",)

    def __init__(self, moves: tuple):
        self.moves = moves

    def replay(self, values: "ModuleValues") -> None:
        found = [(values.objects[holder], key, values.objects[source]) for holder, key, source in self.moves]
        for holder, key, module in found:
            vars(holder).pop(key, None)  # (as Module.__setattr__ does)
            holder._modules[key] = module

    def __repr__(self) -> str:
        return f"<{len(self.moves)} submodule moves>"


class ModuleValues:
    """The Python values a module tree holds (`self.scale = 2.0`, `self.max_seq_len_cached`, a
    transformers config's `use_cache`, PEFT's `self.scaling = {"default": 2.0}`): numbers,
    strings, booleans, None and tuples of them held by each module, in a dict of them a module
    holds, and by each plain object a module holds (a config), by name. A trace reads
    them as constants, so they key the program cache: a value changed between calls compiles
    again, where the program of the old value would be silently wrong. Hashed once (a cache-hit
    call hashes one object, not every value of a model), compared by value.

    `objects` names where the values live (module FQN, or FQN.attribute for a held object), for
    writing a value back (`replay`)."""

    __slots__ = ("items", "objects", "extra", "_key", "_hash")

    def __init__(self, items: tuple, objects: dict, extra: tuple = ()):
        # `extra`: what else a module holds that a trace bakes in, compared but never written back:
        # which function an attribute holds (`self.act = torch.relu`), lists, sets and nested dicts
        # of numbers, NumPy arrays, a config's nested objects
        self.items, self.objects, self.extra = items, objects, extra
        # (by type and zero's sign, as every Python value keys the cache: 1, 1.0 and True are three)
        self._key = tuple((name, exact_key(v)) for name, v in items)
        self._hash = hash((self._key, extra))

    @classmethod
    def of(cls, prefix: str, module: torch.nn.Module) -> "ModuleValues":
        items, objects, seen, extra = [], {}, set(), []
        own = None  # (ids of the tree's parameters and buffers, read where a dict or set it holds is keyed by tensors)
        modules = list(module.named_modules(remove_duplicate=True))
        names = {id(mod): _join(prefix, mod_name) for mod_name, mod in modules}
        for mod_name, mod in modules:
            base = _join(prefix, mod_name)
            objects[base] = mod
            for key, sub in mod._modules.items():  # a module held at a second place (`self.last = self.layers[-1]`):
                if sub is not None and names[id(sub)] != _join(base, key):  # which one (a program calling it
                    extra.append((_join(base, f"{key}.<module>"), names[id(sub)]))  # bakes in that module's state)
            for attr, v in vars(mod).items():
                if attr == "training" or attr.startswith("__") or attr in _MODULE_INTERNALS:
                    continue
                if type(v) in (dict, set, frozenset) and _keyed_by_tensors(v):
                    # which keys are the tree's tensors now (`self.scale = {self.lin.weight: 3.0}`, the weight
                    # replaced between calls: eager's lookup misses, where the program traced before hit)
                    if own is None:
                        own = {id(t) for t in itertools.chain(module.parameters(), module.buffers())}
                    pairs = v.items() if type(v) is dict else ((k, None) for k in v)  # (and the numbers held)
                    extra.append((_join(base, f"{attr}.<keys>"), tuple(
                        (_key_lifted(k, own), exact_key(w) if _is_scalar(w) else type(w).__name__) for k, w in pairs)))
                    continue
                if _is_scalar(v):
                    items.append((_join(base, attr), v))
                elif type(v) is dict and not attr.startswith("_") and v and id(v) not in seen \
                        and all(_is_scalar(w) and _is_name(k) for k, w in v.items()):  # PEFT's scaling per adapter
                    seen.add(id(v))
                    objects[_join(base, attr)] = v
                    items += [(_join(base, f"{attr}.{k}"), w) for k, w in v.items()]
                elif _is_config_object(v) and id(v) not in seen:  # a config, walked once where first held
                    seen.add(id(v))
                    objects[_join(base, attr)] = v
                    exposed = _read_by_properties(type(v))
                    for k, w in attributes(v).items():  # (its public values, `_is_public_value`: a private one is
                        if not _is_public_value(k) and k not in exposed:  # bookkeeping a call may change,
                            continue  # `self._calls`, which would compile a program per call, and differ between
                            # ranks; unless a property reads it, `t` returning `self._t`)
                        if _is_scalar(w):
                            items.append((_join(_join(base, attr), k), w))
                        elif (key := _held_values(w)) is not None:
                            extra.append((_join(_join(base, attr), k), key))
                        elif _is_config_object(w) or _is_called_object(w) or isinstance(w, torch.nn.Module):
                            # a config's nested sections (`config.text_config.hidden_size`,
                            # `cfg.model.act.s`), to the depth a module's containers are read
                            extra.append((_join(_join(base, attr), k),
                                          _values_of(object_key(w, HELD_DEPTH - 1), by_kind=True)))
                elif (key := _held_values(v)) is not None:
                    extra.append((_join(base, attr), key))
        return cls(tuple(items), objects, tuple(extra))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is ModuleValues and self._hash == other._hash and self._key == other._key
                                 and self.extra == other.extra)

    def __repr__(self) -> str:
        return f"<{len(self.items)} Python values of modules>"

    def changes(self, after: "ModuleValues") -> list[tuple[str, object, object]]:
        """(name, value here, value in `after`) of each value that differs; _MISSING where absent."""
        before, now = dict(self.items), dict(after.items)
        return [(k, before.get(k, _MISSING), now.get(k, _MISSING)) for k in dict.fromkeys([*before, *now])
                if exact_key(before.get(k, _MISSING)) != exact_key(now.get(k, _MISSING))]

    def _place(self, name: str) -> tuple:
        """(the object holding one value, its key there): a dict's own key, or an attribute name."""
        owner_name, _, attr = name.rpartition(".") if "." in name else ("", "", name)
        owner = self.objects.get(owner_name)
        if type(owner) is dict:
            return owner, next((k for k in owner if str(k) == attr), attr)
        return owner, attr

    def current(self, name: str):
        """What the place of one value holds now (_MISSING where nothing)."""
        owner, key = self._place(name)
        if owner is None:
            return _MISSING
        return owner.get(key, _MISSING) if type(owner) is dict else attributes(owner).get(key, _MISSING)

    def set(self, name: str, value) -> None:
        """Write one value at its place (deleting it for _MISSING)."""
        owner, key = self._place(name)
        if owner is None:
            return
        if type(owner) is dict:
            if value is _MISSING:
                owner.pop(key, None)
            else:
                owner[key] = value
            return
        if value is _MISSING:
            if key in attributes(owner):  # (its __dict__ or a set slot: never a class's own attribute)
                del_attribute(owner, key)
        else:
            set_attribute(owner, key, value)


# a weak proxy passes for what it refers to (`isinstance(weakref.proxy(t), torch.Tensor)`): held
# by a module, it is a reference to a tensor, not a tensor of its own (`Substitution._repoint_weak`)
WEAK_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # torch's own bookkeeping in every module
# torch's own bookkeeping in every optimizer (its hook dicts, profiling name), and what an LR
# scheduler sets on the optimizer it wraps (`_opt_called`, set by every step)
_OPTIMIZER_INTERNALS = frozenset(vars(torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {}))) | {"_opt_called"}


def _users_attribute(obj, attr: str) -> bool:
    """Whether an object's attribute is the user's, watched and lifted as its public ones are: a
    public one, or a private one of an object of the user's own class (a hand-written optimizer's
    `self._bufs` or `self._step`, a trainer's `self._acc`), torch's own optimizer bookkeeping
    excepted. A library's private attributes are its own (they had been left out for the user's
    classes too: momentum in `self._bufs` was read as the trace's constants, silently)."""
    if not attr.startswith("_"):
        return True
    return not attr.startswith("__") and attr not in _OPTIMIZER_INTERNALS and _is_user_class(type(obj))


def _held_values(v):
    """What keys the cache for a non-scalar value a module (or its config) holds: a function by
    `_binding`, a list, tuple, set or dict of numbers (nested too) or a NumPy array by its values;
    None for anything else (state, submodules, objects walked on their own)."""
    if isinstance(v, (torch.Tensor, Sharded, torch.nn.Module, torch.optim.Optimizer)):
        return None
    if type(v) is set and len(v) <= PLAIN_CONTAINER_ITEMS and all(map(_is_scalar, v)):
        return ("set", frozenset(v))
    if type(v) in (set, frozenset) and len(v) <= PLAIN_CONTAINER_ITEMS and any(
            _key_objects(m, None) or _is_called_object(m) for m in v):
        return ("set", tuple(sorted(map(repr, map(object_key, v)))))  # objects of the user's: by their values
    if type(v) in (list, collections.deque) or isinstance(v, (dict, tuple)) or _is_numbers_array(v):  # (a
        # namedtuple too; a dict subclass, an AttrDict or EasyDict config, by its items)
        items = _values_of(object_key(v, HELD_DEPTH), by_kind=True)  # (an object in it by its type: the
        # numbers beside it key the program all the same)
        if isinstance(v, dict) and type(v) is not dict and (own := _own_dict(v)):  # and its attributes
            return items, _values_of(object_key(dict(own), HELD_DEPTH), by_kind=True)  # (`cfg.scale = 2.0`)
        return items
    if callable(v) and not _is_plain_object(v):
        return _binding(v)
    return None


_BY_IDENTITY = object()  # `_values_of`: a key holding an object by identity


def held_value_key(v):
    """What keys the program for a value an argument's container holds beside its items (a
    UserDict subclass's `self.tag`): a number, string or config by value; a list, dict, called
    object or NumPy array by their values (changed in place too), an object in them by its type;
    None for another object, held by identity (a hashable one too: an object's hash is its
    identity, and a batch made anew at every step would compile again)."""
    if is_config(v) or _is_plain_data(v):
        return object_key(v)
    if _is_called_object(v) or _is_numbers_array(v) or type(v) in (list, tuple, dict, collections.deque):
        return _values_of(object_key(v, HELD_DEPTH), by_kind=True)  # (a list of configs, a called object, an
    return None  # array: by their values, changed in place too; an object in them by its type)


def _values_of(key, by_kind: bool = False):
    """An `object_key` with each tensor in it as a mark of its place (a tensor beside the numbers
    is state, read at every call: its identity keys nothing, and one reassigned each call is one
    program); `_BY_IDENTITY` where it holds an object by identity (a None in it is a value), or,
    `by_kind`, that object as a mark of its type (the values beside it still key the program)."""
    return _values_in(key, by_kind, {})


def _values_in(key, by_kind: bool, done: dict):
    """`_values_of`, each tuple once (`done`, by id): a key holds one class's key at every place
    its class is named, and walking each copy was exponential in how deep classes name classes."""
    if type(key) is _TensorKey:
        return ("tensor",)
    if type(key) is _Shared:
        if id(key) not in done:
            inner = _values_in(key.key, by_kind, done)
            done[id(key)] = inner if inner is _BY_IDENTITY else _Shared(inner)
        return done[id(key)]
    if isinstance(key, tuple):
        if id(key) in done:
            return done[id(key)]
        if len(key) == 3 and key[0] == "object":
            return ("object", key[1]) if by_kind else _BY_IDENTITY
        items = tuple(_values_in(k, by_kind, done) for k in key)
        done[id(key)] = out = _BY_IDENTITY if any(k is _BY_IDENTITY for k in items) else items
        return out
    return key


@functools.lru_cache(maxsize=1024)
def _read_by_properties(cls: type) -> frozenset:
    """The private attribute names the property getters of `cls` read (`return self._t`):
    values a trace reads through a property, which key the program."""
    names = set()
    for c in cls.__mro__[:-1]:
        for v in vars(c).values():
            if isinstance(v, property) and isinstance(getattr(v.fget, "__code__", None), types.CodeType):
                names.update(v.fget.__code__.co_names)
    return frozenset(n for n in names if n.startswith("_"))


def _is_public_value(name: str) -> bool:
    """An attribute of a library's object that is one of its values, not its bookkeeping (a hash
    of itself): public, or transformers' attention kind (`_attn_implementation_internal`)."""
    return not name.startswith("_") or "implementation" in name


HELD_DEPTH = 8  # how deep in a module's containers and objects their numbers are read (`d["l"][0].inner.inner.s`)


def _watch_held(snapshot, v, depth: int = HELD_DEPTH) -> None:
    """A module's list or dict of numbers, watched (and the ones inside it) so that an edit in
    place (`model.ks[0] = 3.0`) collects the module's values again."""
    if isinstance(v, dict) and len(v) <= PLAIN_CONTAINER_ITEMS:  # (an AttrDict or EasyDict config too)
        snapshot.dict(v)
        items = list(v.values())
        if type(v) is not dict and (own := _own_dict(v)) is not None:  # (its attributes too: `cfg.scale = 2.0`,
            snapshot.dict(own)  # and what they hold: `cfg.sub.alpha`, `cfg.scales[0]`)
            items += [w for k, w in own.items() if not k.startswith("__")]
    elif type(v) in (list, collections.deque) and len(v) <= PLAIN_CONTAINER_ITEMS:
        snapshot.list(v)
        items = v
    elif type(v) in (tuple, set, frozenset) and len(v) <= PLAIN_CONTAINER_ITEMS:
        items = v
    elif isinstance(v, functools.partial):  # (its keywords edited in place, an object among its arguments)
        snapshot.dict(v.keywords)
        items = (*v.args, *v.keywords.values())
    elif isinstance(v, types.MethodType):  # (a bound method's object: `m.fn = scaler.__call__`)
        items = (v.__self__,)
    elif _is_called_object(v) or _is_config_object(v):  # (`m.acts = [Scaler(2.0)]`, `m.cfg = {"p": {Pw(1.0)}}`,
        snapshot.object(v)  # a library's config in a list: their numbers, changed in place; `__slots__` too)
        items = attributes(v).values()
    elif isinstance(v, torch.nn.Module):  # (one a container holds, not a submodule: its own values, and
        snapshot.dict(vars(v))  # the configs and lists it holds)
        items = [w for k, w in vars(v).items() if k not in _MODULE_INTERNALS] + list(v._modules.values())
    elif _is_numbers_array(v) and not isinstance(v, sys.modules["numpy"].generic):
        snapshot.array(v)  # (its values key the program: edited in place, collected again)
        return
    else:
        return
    for w in items if depth > 1 else ():
        _watch_held(snapshot, w, depth - 1)


def _is_called_object(x) -> bool:
    """An object of the user's that is called (an activation `Scaler(2.0)`), not state: what
    its `__call__` reads from it is baked into a trace, so its values key the program."""
    return _is_user_object(x) and callable(x) and not isinstance(
        x, (torch.nn.Module, torch.optim.Optimizer, Sharded, types.MethodType, types.FunctionType, functools.partial)) \
        and (isinstance(getattr(x, "__dict__", None), dict) or bool(_slot_values(x)))


class Exact:
    """A Python value the trace read, in the statics of a cache key: equal by `exact_key`,
    shown as the value."""

    __slots__ = ("value", "_key", "_hash")

    def __init__(self, value):
        self.value, self._key = value, exact_key(value)
        self._hash = hash(self._key)

    def __eq__(self, other) -> bool:
        return type(other) is Exact and self._hash == other._hash and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return repr(self.value)


def expand_statics(statics: dict) -> dict:
    """`statics` with each ModuleValues spread into its values by name (for messages)."""
    out = {}
    for k, v in statics.items():
        if type(v) is ModuleValues:
            out.update(v.items)
            out.update(v.extra)
        elif type(v) is Bindings:
            out.update(v.items)
        else:
            out[k] = v
    return out


def _is_plain_object(v) -> bool:
    """An object with attributes that is not state, a function, a class or a container (an
    OrderedDict has a `__dict__` too): a config."""
    return isinstance(getattr(v, "__dict__", None), dict) and not isinstance(
        v, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, type, types.ModuleType, types.FunctionType,
            types.MethodType, functools.partial, Sharded, dict, list, tuple, set, frozenset))


def _constant(v):
    return lambda: v


def _cannot_write(name: str):
    def write(_):
        raise CaptureError(f"{name} is assigned inside the sharded function, but hpfun cannot write it back "
                           "(it is held in a tuple or a partial's arguments)", headline="cannot write state back")
    return write


def _tensor_list(v) -> bool:
    return type(v) is list and any(isinstance(t, torch.Tensor) for t in v)


def _keyed_tuple_item(d: dict, key, i: int):
    held = d.get(key)
    return held[i] if type(held) is tuple and i < len(held) else None


def _keyed_tuple_writer(d: dict, key, i: int, value) -> None:
    held = d.get(key)
    if type(held) is not tuple or i >= len(held):
        if value is None:
            return
        raise IndexError(f"{key!r} holds no item {i} to write")
    d[key] = held[:i] + (value,) + held[i + 1:]


def _tuple_item(mod, attr: str, i: int):
    """Item i of the tuple a module holds now; None where it holds no such item (the step
    assigned a shorter tuple, or another value)."""
    held = vars(mod).get(attr)
    return held[i] if isinstance(held, tuple) and i < len(held) else None


def _tuple_item_writer(mod, attr: str, i: int, value) -> None:
    """Write item i of the tuple a module holds now, rebuilt (nothing to clear where the step
    assigned a tuple without that item: put whole, as it assigned it)."""
    held = vars(mod).get(attr)
    if not isinstance(held, tuple) or i >= len(held):
        if value is None:
            return
        raise IndexError(f"{attr} holds no item {i} to write")
    items = list(vars(mod)[attr])
    items[i] = value
    held = vars(mod)[attr]
    vars(mod)[attr] = tuple(items) if type(held) is tuple else type(held)(*items)


def _modules_own(mod, attr: str) -> bool:
    """Whether a module's attribute is its own, public or private (`self._grid = [grid]`, made by
    neuralop's forward: a private one had been left out of the state a step makes, then deleted
    after the call), not torch's bookkeeping (`_parameters`, hooks, an RNN's `_flat_weights`:
    a private one of a module built on a torch.nn class) nor a dunder."""
    if attr.startswith("__") or attr in _MODULE_INTERNALS:
        return False
    return not attr.startswith("_") or not _built_on_torch(type(mod))


@functools.cache
def _built_on_torch(cls: type) -> bool:
    """A module class that is, or derives from, one of torch.nn's own (not Module itself)."""
    return any(c.__module__.startswith("torch.") for c in cls.__mro__ if c not in (torch.nn.Module, object))


def _held_dict(attr: str, v) -> bool:
    """A dict a module holds whose tensors are its state (a cache its forward fills): a public
    one, or a private one holding tensors (torchmetrics' `self._defaults`); never torch's own
    bookkeeping (`_parameters`, `_buffers`, `_modules`)."""
    if not _is_dict(v) or attr.startswith("__") or attr in _MODULE_INTERNALS:
        return False
    return not attr.startswith("_") or any(_is_tensor(t) for t in v.values())


def _module_slots(prefix: str, module: torch.nn.Module, add, snapshot: Snapshot) -> None:
    def held(name, read, write) -> None:  # a tensor a module holds outside its parameters and buffers: one made
        v = read()  # with requires_grad=True (`self.h = [Linear, Parameter]`) has its gradient too, as a global does
        leaf = _is_tensor(v) and v.requires_grad and v.is_leaf
        if add(name, read, write, requires_grad=leaf) and leaf:
            add(f"{name}.grad", functools.partial(_grad_at, read), functools.partial(_set_grad_at, read), follows=name)

    params, objects = [], set()
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        base = _join(prefix, mod_name)
        lazy = [attr for attr, t in [*mod._parameters.items(), *mod._buffers.items()] if torch.nn.parameter.is_lazy(t)]
        if lazy:
            raise CaptureError([Problem(_join(base, attr), f"is not initialized yet ({type(mod).__name__} makes it at "
                                        "its first forward, from the input's shape)", "run the model once eagerly on a "
                                        "sample batch before the sharded call (or give the layer its sizes)")
                                for attr in lazy], headline="cannot lift the state the function reads")
        if isinstance(mod, torch.jit.ScriptModule):
            raise CaptureError(Problem(base or "the function", f"is a TorchScript module ({type(mod).__name__}): its "
                                       "compiled graph reads its own parameters, which hpfun cannot swap for the "
                                       "trace's", "shard the nn.Module it was scripted from (hpfun compiles the "
                                       "per-shard program itself: compile=True)"),
                               headline="cannot lift the state the function reads")
        for store in (vars(mod), mod._parameters, mod._buffers, mod._modules):
            snapshot.dict(store)
        for attr, v in vars(mod).items():  # a config's values key the cache too (`ModuleValues`)
            if _is_config_object(v) and id(v) not in objects:
                objects.add(id(v))
                snapshot.object(v)
                for w in attributes(v).values():
                    _watch_held(snapshot, w)
                    if _is_config_object(w) and id(w) not in objects:
                        objects.add(id(w))
                        snapshot.object(w)
            elif attr not in _MODULE_INTERNALS and (type(v) in (list, tuple, collections.deque) or isinstance(
                    v, (dict, functools.partial, types.MethodType)) or _is_numbers_array(v)) and id(v) not in objects:
                objects.add(id(v))
                _watch_held(snapshot, v)
            elif type(v) in (set, frozenset) and id(v) not in objects and len(v) <= PLAIN_CONTAINER_ITEMS:
                objects.add(id(v))  # (a member added, or one's number changed: its values collected again)
                snapshot.set(v)
                for member in v:  # (an object of the user's, called too: `{Scaler(2.0)}`, in a tuple)
                    _watch_held(snapshot, member)
        for attr, p in list(mod._parameters.items()):
            if p is not None and add(_join(base, attr), functools.partial(mod._parameters.get, attr),
                                     functools.partial(_set_param, mod, attr), requires_grad=p.requires_grad):
                params.append((_join(base, attr), mod, attr, p))
        for attr, b in list(mod._buffers.items()):
            if b is not None:
                add(_join(base, attr), functools.partial(mod._buffers.get, attr), functools.partial(mod._buffers.__setitem__, attr))
        for attr, v in list(vars(mod).items()):
            if _is_tensor(v) and not attr.startswith("__"):
                held(_join(base, attr), functools.partial(vars(mod).get, attr), functools.partial(setattr, mod, attr))
            elif _held_dict(attr, v) and (not v or all(map(_is_scalar, v.values())) or any(
                    _is_tensor(t) or _tensor_list(t) or type(t) is tuple and _holds_tensor(t)
                    for t in v.values())):
                snapshot.dict(v)  # a cache the forward keeps (`self.cache[key] = ...`): its tensors are state
                for i, (key, t) in enumerate(list(v.items())):  # (an empty one is watched: filled, the walk is done again)
                    if _is_tensor(t) and _is_plain_key(key) and not _is_tensor_key(key):
                        held(_entry_name(base, attr, key), functools.partial(v.get, key), functools.partial(v.__setitem__, key))
                    elif _is_tensor(t) and _is_tensor_key(key):  # keyed by a parameter or its id
                        held(_join(base, f"{attr}.<key {i}>"), functools.partial(v.get, key),  # (`bufs[p]`): by position
                            functools.partial(v.__setitem__, key))
                    elif _tensor_list(t) and _is_plain_key(key):  # a list in it a metric appends to
                        for i, u in enumerate(t):
                            if _is_tensor(u):
                                held(f"{_entry_name(base, attr, key)}.{i}", functools.partial(t.__getitem__, i),
                                    functools.partial(t.__setitem__, i))
                    elif type(t) is tuple and _is_plain_key(key) and any(_is_tensor(u) for u in t):
                        for i, u in enumerate(t):  # a tuple of tensors under a key: rebuilt where written
                            if _is_tensor(u):
                                held(f"{_entry_name(base, attr, key)}.{i}", functools.partial(_keyed_tuple_item, v, key, i),
                                    functools.partial(_keyed_tuple_writer, v, key, i))
            elif _modules_own(mod, attr) and _tensor_list(v):
                for i, t in enumerate(v):  # a list a metric appends its batches to (torchmetrics' list states)
                    if _is_tensor(t):
                        held(_join(base, f"{attr}.{i}"), functools.partial(v.__getitem__, i), functools.partial(v.__setitem__, i))
            elif isinstance(v, tuple) and not attr.startswith("__") and any(_is_tensor(t) for t in v):
                for i, t in enumerate(v):  # gpytorch's `self.train_inputs = (x,)`: rebuilt where written
                    if _is_tensor(t):
                        held(_join(base, f"{attr}.{i}"), functools.partial(_tuple_item, mod, attr, i),
                            functools.partial(_tuple_item_writer, mod, attr, i))
    # gradients after every parameter; a parameter held twice (tied weights) has one gradient.
    # A frozen one's too: it may hold one from before it was frozen (the optimizer still steps
    # it), or be unfrozen, or given one, inside the step (absent, its slot costs nothing)
    for name, mod, attr, _ in params:
        add(f"{name}.grad", functools.partial(_grad_of, mod, attr), functools.partial(_set_grad, mod, attr), follows=name)


def _set_param(mod, attr, value):
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=mod._parameters[attr].requires_grad)
    mod._parameters[attr] = value


def _grad_of(mod, attr):
    p = mod._parameters.get(attr)
    return None if p is None else p.grad


def _set_grad(mod, attr, value):
    mod._parameters[attr].grad = value


def _grad_at(read):
    t = read()
    return t.grad if isinstance(t, torch.Tensor) else None


def _set_grad_at(read, value):
    read().grad = value


def _snapshot_plain(snapshot: Snapshot, data) -> None:
    """The lists and dicts of plain data (`_is_plain_data`), to their innermost, in `snapshot`."""
    if type(data) is dict:
        snapshot.dict(data)
        for v in data.values():
            _snapshot_plain(snapshot, v)
    elif type(data) in (list, tuple):
        if type(data) is list:
            snapshot.list(data)
        for v in data:
            _snapshot_plain(snapshot, v)


def _optimizer_slots(prefix: str, opt: torch.optim.Optimizer, add, names: dict, problems: list,
                     snapshot: Snapshot, opaque: list) -> None:
    snapshot.dict(vars(opt))
    snapshot.list(opt.param_groups)
    snapshot.dict(opt.state)
    for g, group in enumerate(opt.param_groups):
        snapshot.group(group)
        snapshot.list(group["params"])
        for i, p in enumerate(group["params"]):
            if id(p) not in names:  # a parameter of no module the function reaches
                name = _join(prefix, f"params.{g}.{i}")
                add(name, functools.partial(group["params"].__getitem__, i), functools.partial(_set_listed, group["params"], i),
                    requires_grad=p.requires_grad)
                if isinstance(p, torch.Tensor):  # (frozen too: see _module_slots)
                    add(f"{name}.grad", functools.partial(getattr, p, "grad"), functools.partial(setattr, p, "grad"),
                        follows=name)
        for key, v in group.items():
            if key == "params":
                continue
            for i, _ in _group_tensors(key, v):  # a learning rate (or Adam's betas) kept in tensors: inputs like any state
                if i is None:
                    add(_join(prefix, f"param_groups.{g}.{key}"), functools.partial(group.get, key),
                        functools.partial(group.__setitem__, key))
                else:
                    add(_join(prefix, f"param_groups.{g}.{key}.{i}"), functools.partial(_scalar_of, group, key, i),
                        functools.partial(_set_scalar, group, key, i))
        for name, (key, index) in lifted_scalars(opt, group).items():
            add(_join(prefix, f"param_groups.{g}.{name}"), functools.partial(_scalar_of, group, key, index),
                functools.partial(_set_scalar, group, key, index), scalar=True)
    if isinstance(opt.defaults, dict):  # a tensor kept in its defaults, which its step may read (a scale it keeps
        snapshot.dict(opt.defaults)  # there alone; torch's own tensor learning rate, also its groups'): an input
        for key, v in opt.defaults.items():
            for i, _ in _group_tensors(key, v):
                if i is None:
                    add(_join(prefix, f"defaults.{key}"), functools.partial(opt.defaults.get, key),
                        functools.partial(opt.defaults.__setitem__, key))
                else:
                    add(_join(prefix, f"defaults.{key}.{i}"), functools.partial(_scalar_of, opt.defaults, key, i),
                        functools.partial(_set_scalar, opt.defaults, key, i))
    if isinstance(opt, torch.optim.SparseAdam):
        problems.append(Problem(prefix or "optimizer", "is a SparseAdam, which updates sparse gradients; hpfun shards "
                                "dense tensors only", "use nn.Embedding(sparse=False) and torch.optim.Adam (which also "
                                "decays the moments of rows the batch does not touch, where SparseAdam leaves them)"))
        return
    for p, entries in opt.state.items():
        if not isinstance(p, torch.Tensor):  # a key of the optimizer's own (MADGRAD's `self.state["k"]`, a step count)
            if isinstance(entries, torch.Tensor) and _is_name(p):
                add(f"{_join(prefix, 'state')}.{p}", functools.partial(opt.state.get, p),
                    functools.partial(opt.state.__setitem__, p))
            elif not _is_plain_data(entries):
                opaque.append((f"{_join(prefix, 'state')}.{p!r}", entries))
            else:  # (its lists and dicts, which a step or the caller may edit in place: their numbers key the program)
                _snapshot_plain(snapshot, entries)
            continue
        snapshot.dict(entries)
        owner = names.get(id(p))
        if owner is None:
            problems.append(Problem(f"{prefix}.state", f"holds state for a tensor of shape {tuple(p.shape)} that is "
                                    "not among its param_groups", "keep the optimizer's state for its own parameters"))
            continue
        for key, v in entries.items():
            name = f"{_join(prefix, 'state')}.{owner}.{key}"
            if isinstance(v, torch.Tensor):
                # read from the dict itself: while the snapshot holds, `opt.state[p]` is that dict
                add(name, functools.partial(entries.get, key), functools.partial(_set_state, opt, p, key),
                    follows=owner)
            elif _tensor_sequence(v):  # a list or tuple of tensors (SPlus's `sides`, PSGD's bounds), or a dict of
                if type(v) is list:  # them by name (`state["ema"] = {"m": ...}`): each one state
                    snapshot.list(v)  # (an item replaced between calls: walked again)
                elif isinstance(v, dict):
                    snapshot.dict(v)
                for i, _ in _tensor_items(v):
                    add(f"{name}.{i}", functools.partial(_state_item, entries, key, i),
                        functools.partial(_set_state_item, opt, p, key, i), follows=owner)
            elif not _is_scalar(v):  # (a number or flag is a static: `statics`) LBFGS's history lists: not
                opaque.append((name, v))  # lifted; a trace that reads their tensors is refused (`unlifted_tensor_error`)


# The hyperparameters hpfun traces as 0-d float64 tensors standing in for their floats, per
# optimizer: each is then an input read at every call, and a scheduler stepping it between calls
# (a learning rate schedule, OneCycleLR's cycled betas) changes an input, not the program. These
# steps only do arithmetic on them (the same double-precision arithmetic eager does on the
# floats). Their code may compare one with zero (SGD's `if momentum != 0`): the comparison is
# answered from the value's sign, which keys the cache (`ScalarSigns`). A tuple's floats
# (`betas`) are lifted one by one; every other hyperparameter keys the cache as a static value.
_LR, _LR_BETAS, _LR_MOMENTUM = ("lr",), ("lr", "betas"), ("lr", "momentum")
LIFTED_SCALARS = {torch.optim.SGD: _LR_MOMENTUM, torch.optim.Adam: _LR_BETAS, torch.optim.AdamW: _LR_BETAS,
                  torch.optim.Adamax: _LR_BETAS, torch.optim.NAdam: _LR_BETAS, torch.optim.RAdam: _LR_BETAS,
                  torch.optim.Adagrad: _LR, torch.optim.Adadelta: _LR, torch.optim.RMSprop: _LR_MOMENTUM,
                  torch.optim.ASGD: _LR, torch.optim.Adafactor: _LR, torch.optim.Muon: _LR_MOMENTUM}


def lifted_scalars(opt, group: dict) -> dict[str, tuple]:
    """The hyperparameters of `group` lifted as inputs (scalar slots), not statics: the key's
    name (`lr`, `betas.0`) -> (key, index in its tuple or None)."""
    out = {}
    for key in LIFTED_SCALARS.get(type(opt), ()):
        v = group.get(key)
        if _real(v):
            out[key] = (key, None)
        elif type(v) in (tuple, list) and v and all(_real(x) or isinstance(x, torch.Tensor) for x in v) \
                and not _half(group):  # (a scheduler writes a float beside a tensor beta: both inputs)
            out.update({f"{key}.{i}": (key, i) for i, x in enumerate(v) if _real(x)})
    return out


# Optimizers whose default step branches in Python on its step count (RAdam's rectification
# test, ASGD's start of averaging), read with `.item()`, which a trace cannot do: they are traced
# through their `capturable` path, torch's branch-free form of the same update made for graph
# capture. Their 0-d state (the step count, ASGD's eta and mu) is traced in float64, as eager
# reads it with `.item()` into a Python float, and stored back in its own dtype.
TRACED_CAPTURABLE = (torch.optim.RAdam, torch.optim.ASGD)
# Optimizers traced through their for-loop path (capture splits a foreach path into per-tensor
# ops anyway): Adamax's foreach path passes a list of step sizes where torch takes numbers
# (traced, they are tensors), and the for-loop capturable paths are the closer to eager's.
TRACED_FOR_LOOP = (torch.optim.Adamax, *TRACED_CAPTURABLE)


class _Float64Scalars(dict):
    """An optimizer's per-parameter state while its step is traced: a 0-d floating tensor put in
    it reads as a float64 copy, and `stored()` gives each back in the dtype it was put in with."""

    def __init__(self, entries=()):
        super().__init__()
        self.dtypes: dict = {}
        for k, v in dict(entries).items():
            self[k] = v

    def __setitem__(self, key, value):
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
            self.dtypes[key] = value.dtype
            value = read_as_float(value)
        else:
            self.dtypes.pop(key, None)
        super().__setitem__(key, value)

    def stored(self) -> dict:
        return {k: v.to(self.dtypes[k]) if k in self.dtypes and isinstance(v, torch.Tensor) else v
                for k, v in self.items()}


def _half(group: dict) -> bool:
    """Whether the group's parameters are 16-bit floats: Adam would convert a tensor beta to
    their precision (0.9 -> 0.8984375 in bfloat16), where eager keeps the float's, so their
    betas stay statics."""
    params = group["params"]
    return bool(params) and params[0].dtype in (torch.bfloat16, torch.float16)


def _real(v) -> bool:
    """A real number a hyperparameter may be (a NumPy float from a schedule too), not a flag."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, torch.Tensor)) and type(v).__name__ != "bool_"


def _sign(v) -> int:
    return int(v > 0) - int(v < 0)


def _tensor_sign(v: torch.Tensor) -> int | None:
    """The sign of a 0-d tensor's value; None where it has none to read (a meta tensor) or
    reading it would wait for the device (a CUDA tensor: it is read at every call)."""
    if v.dim() != 0 or v.device.type != "cpu" or isinstance(v, torch._subclasses.FakeTensor) or isinstance(v, Sharded):
        return None
    return _sign(v.item())


class ScalarSigns(torch.overrides.TorchFunctionMode):
    """While a step is traced, a lifted hyperparameter's stand-in (of a float, or of a 0-d
    tensor the group holds) behaves as the Python float where a tensor would not:
    - compared with zero (SGD's `if momentum != 0`, RMSprop's `if momentum > 0`), it gives the
      Python answer: its sign is part of the cache key, so the program is right for every value
      of that sign (compared with anything else, it stays a traced tensor);
    - a float's stand-in converted to a parameter's lower precision (Adam turns a tensor beta1
      into a float32 one) stays float64, as the float would in eager's arithmetic;
    - in arithmetic with a tensor, a float's stand-in, and every value computed from such
      stand-ins alone (the step count, read as a number, and the bias corrections made from it),
      promotes as the Python float does: a 0-d tensor would make `lr / bias_correction` float64
      where eager's is the tensor learning rate's float32 (`PythonFloats`)."""

    _COMPARE = {f: compare for name, compare in (("eq", operator.eq), ("ne", operator.ne), ("gt", operator.gt),
                                                 ("ge", operator.ge), ("lt", operator.lt), ("le", operator.le))
                for f in (getattr(torch.Tensor, name), getattr(torch.Tensor, f"__{name}__"))}

    def __init__(self, signs: dict, floats: set):
        super().__init__()
        self.signs = signs  # id(stand-in) -> the sign of the value it stands in for
        self.floats = PythonFloats(floats)  # the stand-ins of Python floats, and what is computed from them alone

    def __enter__(self):
        self._outer = PythonFloats.active
        PythonFloats.active = self.floats
        self._backwards = in_backwards(self)  # (an optimizer stepped in a gradient hook)
        self._backwards.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        PythonFloats.active = self._outer
        self._backwards.__exit__(None, None, None)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        floats = self.floats
        if args and id(args[0]) in self.signs:
            compare = self._COMPARE.get(func)
            if compare is not None and len(args) == 2 and type(args[1]) in (int, float) and args[1] == 0:
                return compare(self.signs[id(args[0])], 0)
            if func is torch.Tensor.to and args[0] in floats:
                dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
                if dtype is not None and dtype.is_floating_point:
                    kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
                    args = tuple(a for a in args if not isinstance(a, torch.dtype))
        if not floats.ids:
            return func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors:
            return func(*args, **kwargs)
        if func in _BINARY and len(tensors) == 2 and len(args) == 2:
            args = floats.promoted(args)
        elif func in _IN_PLACE_BINARY and len(tensors) == 2 and len(args) == 2 and args[0] not in floats:
            args = floats.promoted(args)  # `mu_product *= mu`: the tensor written keeps its dtype
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dim() == 0 and out.dtype == torch.float64 and func not in _NOT_ARITHMETIC \
                and all(t in floats for t in tensors):
            floats.add(out)
        return out


_BINARY = frozenset(getattr(torch.Tensor, f"__{op}__") for op in
                    ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "pow", "rpow")) | {
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.pow, torch.Tensor.add, torch.Tensor.sub,
    torch.Tensor.mul, torch.Tensor.div, torch.Tensor.pow, torch.maximum, torch.minimum}
_IN_PLACE_BINARY = frozenset(getattr(torch.Tensor, f"__i{op}__") for op in ("add", "sub", "mul", "truediv")) | {
    torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.mul_, torch.Tensor.div_}
# ops returning a float64 0-d tensor that is no arithmetic result (a copy keeps what it copies)
_NOT_ARITHMETIC = frozenset({torch.Tensor.__setitem__, torch.Tensor.copy_})


def _scalar_of(group: dict, key: str, index: int | None):
    v = group[key] if index is None else group[key][index]
    return v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)


def _set_scalar(group: dict, key: str, index: int | None, value) -> None:
    old = group[key] if index is None else group[key][index]
    if isinstance(value, torch.Tensor) and not isinstance(old, torch.Tensor):
        value = value.item() if type(old) in (float, int) else type(old)(value.item())  # (a NumPy float stays one)
    if index is None:
        group[key] = value
    else:
        group[key] = type(group[key])((*group[key][:index], value, *group[key][index + 1:]))  # (a list stays one)


_STEP_OUTSIDE = ("step this optimizer outside the sharded function: shard the forward and backward (`loss = "
                 "fwd_bwd(x, y)`, which writes the gradients back to the parameters), then call `opt.step(); "
                 "opt.zero_grad()` after it (the sharded function should not reach the optimizer: its numbers key the "
                 "cache, and they change at every step); or use an optimizer that keeps its counters in tensors "
                 "(torch.optim's do)")


def _is_a_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def _untraceable_state(name: str, v, opt) -> Problem:
    if _holds_any(v, lambda t: isinstance(t, (list, tuple, dict)) and _holds_any(t, _is_a_tensor)):
        return Problem(name, f"is a {type(v).__name__} in {type(opt).__name__}'s state holding its tensors deeper than "
                       "hpfun lifts: under each key of a parameter's state, a tensor, a number, a list or tuple of "
                       "tensors, or a dict of tensors by name", "keep each tensor at one of those places "
                       "(`state['ema_m']`, `state['ema'] = {'m': m}`), or " + _STEP_OUTSIDE)
    if isinstance(v, dict) and any(isinstance(t, torch.Tensor) for t in v.values()):  # (`{"m": t, "n": 2}`)
        items = ", ".join(f"{k!r}: " + (f"tensor{tuple(t.shape)}" if isinstance(t, torch.Tensor) else _short_repr(t))
                          for k, t in v.items())
        return Problem(name, f"is a {type(v).__name__} of tensors and other values ({{{items[:80]}}}) in "
                       f"{type(opt).__name__}'s state: hpfun lifts a dict of tensors keyed by names (strings without "
                       "dots), tensor by tensor", "keep only tensors in it, under such keys, or each under a key of "
                       "the parameter's state itself (`state['ema_m']`); or " + _STEP_OUTSIDE)
    if type(v) in (list, tuple) and any(isinstance(t, torch.Tensor) for t in v):  # (SPlus-like `[L, None]`)
        items = ", ".join(f"tensor{tuple(t.shape)}" if isinstance(t, torch.Tensor) else _short_repr(t) for t in v)
        return Problem(name, f"is a {type(v).__name__} of tensors and other values ([{items[:60]}]) in "
                       f"{type(opt).__name__}'s state: hpfun lifts a list or tuple of tensors only, tensor by tensor",
                       "keep only tensors in it (a zero tensor in place of None), or each under a key of its own; or "
                       + _STEP_OUTSIDE)
    return Problem(name, f"is a {type(v).__name__} ({_short_repr(v)}) in {type(opt).__name__}'s state, not a tensor or a "
                   "number: hpfun lifts an optimizer's tensors, and reads its numbers as constants", _STEP_OUTSIDE)


def changed_state(name: str, opt, was, now) -> Problem:
    """The error for a Python number in an optimizer's state or groups that its step changes (or,
    for torch.optim's own, whose steps change none, that the function set)."""
    if type(opt).__module__.startswith("torch.optim.") and ".param_groups." in name:
        return Problem(name, f"changed from {was!r} to {now!r} while the function was traced: the function set it "
                       f"({type(opt).__name__}'s step changes no number in its groups), and a traced program would "
                       "repeat the trace's value", "set it outside the sharded function, between calls (a schedule: "
                       "`opt.param_groups[0]['weight_decay'] = wd` before the call): hpfun reads the learning rate "
                       "at every call, and compiles the step again for another value of the others")
    return Problem(name, f"changed from {was!r} to {now!r} while the function was traced: {type(opt).__name__} keeps "
                   "it in Python and updates it at every step, and a traced program would repeat the trace's value",
                   _STEP_OUTSIDE)


def _short_repr(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _set_listed(seq, i, value):
    seq[i] = value


class _Removed:
    """What a state the step removed (`del st["m2"]`) is written as: its key taken away (None is
    written as None, `st["m2"] = None`)."""

    def __repr__(self) -> str:
        return "<removed>"


REMOVED = _Removed()


def _set_state(opt, p, key, value):
    if value is REMOVED:
        opt.state.get(p, {}).pop(key, None)
    else:
        opt.state[p][key] = value


def _tensor_sequence(v) -> bool:
    """A list or tuple of tensors (and nothing else) in a parameter's optimizer state, or a dict
    (OrderedDict, defaultdict) of them keyed by names: each of its tensors is lifted in its place."""
    if isinstance(v, dict):
        return type(v) in _STATE_DICTS and bool(v) and all(_is_name(k) and isinstance(t, torch.Tensor)
                                                           for k, t in v.items())
    return type(v) in (list, tuple) and bool(v) and all(isinstance(t, torch.Tensor) for t in v)


_STATE_DICTS = (dict, collections.OrderedDict, collections.defaultdict)


def _tensor_items(v) -> list:
    """(index or key, tensor) of a `_tensor_sequence`, in its order."""
    return list(v.items()) if isinstance(v, dict) else list(enumerate(v))


def _with_tensors(v, tensors):
    """`v` (a `_tensor_sequence`) of the same type holding `tensors` in its order (a defaultdict
    keeps its factory)."""
    if isinstance(v, dict):
        out = copy.copy(v)
        out.update(zip(v.keys(), tensors, strict=True))
        return out
    return type(v)(tensors)


def _state_item(entries: dict, key, i):
    held = entries.get(key)
    if isinstance(held, dict):
        return held.get(i) if type(held) in _STATE_DICTS else None
    return held[i] if type(held) in (list, tuple) and isinstance(i, int) and i < len(held) else None


def _set_state_item(opt, p, key, i, value) -> None:
    """Item i of the list (or tuple, rebuilt), or key i of the dict, of tensors under `key` of a
    parameter's state."""
    held = opt.state.get(p, {}).get(key)
    if value is None or value is REMOVED:  # (the step removed the list)
        if held is not None and not _tensor_sequence(held):
            return
        opt.state.get(p, {}).pop(key, None)
        return
    if type(held) is list or type(held) in _STATE_DICTS:
        held[i] = value
    else:
        items = list(held)
        items[i] = value
        opt.state[p][key] = tuple(items)


def _put_state_entry(real_state, p, key, value) -> None:
    real_state[p][key] = value


_TENSOR_HELD = "<tensor>"  # a tensor's place in a tuple of hyperparameters that keys the cache (it is an input)


def _tensors_in(v) -> bool:
    """Whether `v` is a tuple (or list) of hyperparameters holding tensors (Adam's betas as tensors)."""
    return type(v) in (tuple, list) and any(isinstance(x, torch.Tensor) for x in v)


def _group_tensors(key: str, v) -> list:
    """The tensors an optimizer group's `key` holds, as (index in its tuple or None, tensor)."""
    if key == "params":
        return []
    if isinstance(v, torch.Tensor):
        return [(None, v)]
    return [(i, x) for i, x in enumerate(v) if isinstance(x, torch.Tensor)] if _tensors_in(v) else []


def _is_an_id(k) -> bool:
    """A key that is an object's id (`id(p)`, `str(id(p))`): each process's own, named by position."""
    return type(k) is int and k >= 1 << 32 or type(k) is str and k.isdigit() and len(k) >= 10 and int(k) >= 1 << 32


def _is_plain_data(x, depth: int = 4) -> bool:
    """A Python number, string, flag or None (`_is_scalar`), or a list, tuple or dict of them
    nested `depth` deep: data an optimizer may keep under a key of its own (a history of
    losses), which keys the program and is compared after a trace as a number is."""
    if type(x) in (list, tuple, dict) and depth > 0:
        items = x.items() if type(x) is dict else enumerate(x)
        return all((type(x) is not dict or _is_plain_key(k)) and _is_plain_data(v, depth - 1) for k, v in items)
    return type(x) not in (list, tuple, dict) and _is_scalar(x)


def _hashable(v):
    try:
        hash(v)
    except TypeError:
        return repr(v)
    return v


# ---------------------------------------------------------------------------------------------
# Tracing with stand-ins
# ---------------------------------------------------------------------------------------------


class Substitution:
    """Every place the roots hold a lifted tensor holds its stand-in until `restore()`.

    `swap[id(real)]` is the stand-in (a fake tensor during capture). Modules' parameters,
    buffers and tensor attributes, optimizers' parameter lists and state (keyed by the
    stand-ins), gradients, closure cells, globals and containers are all swapped, so a tensor
    held in several places (tied weights, an optimizer's parameter) is one stand-in everywhere.
    """

    def __init__(self, state: State, swap: dict, grads: dict, scalars: dict | None = None, fn=None):
        self.state, self.swap, self._undo = state, swap, []
        self.scalars = scalars or {}  # a scalar slot's name -> its stand-in (`LIFTED_SCALARS`)
        self.set_aside: set = set()  # the statics this substitution itself changes (a group's foreach flag)
        self.signs: dict = {}  # id(a lifted hyperparameter's stand-in) -> its value's sign (`ScalarSigns`)
        self.floats: set = set()  # ids of the stand-ins of lifted Python floats (`ScalarSigns`)
        self._optimizers: list = []
        self._groups: list = []  # (optimizer's name, index, param group, its keys) before the trace
        self._param_lists: list = []  # (optimizer's name, index, param group, its params list, the list's items)
        self.new_numbers: list = []  # (optimizer state, parameter, key, value) of numbers the step put in its state
        self._own_before: dict = {}  # id(plain data under an optimizer's own key) -> a copy of it before the trace
        self._real_params: dict = {}  # id(an optimizer's parameter as the trace sees it) -> the parameter
        self._fused: set = set()  # ids of the parameters (as the trace sees them) of groups traced unfused
        self._modules: list = []  # (prefix, module, its attributes, its buffers, its containers' items) before the trace
        self._inner_lists: list = []  # (name, a list inside a module's dict, its length) before the trace
        self._inner_held: dict = {}  # id(a list inside a module's dict) -> its items before the trace
        self._tuples: dict = {}  # id -> each tuple of stand-ins put in a module in place of its tuple of tensors
        self._watched: list = []  # (name, read, container, its items) of lists and dicts the function or a hook reaches
        self._places: list = []  # (name, read) of every closed-over, global and default value the function reaches
        self._plain_held: list = []  # (name, a plain object among them, its attributes before the trace)
        self._held_before: set = set()  # ids of the objects in those objects' lists and dicts before the trace
        self._submodules: dict = {}  # id(a module) -> its submodules before the trace
        self._module_names: dict = {}  # id(a module) -> (its root's name, the first name it is held by)
        self._rekeyed: list = []  # (a dict keyed by stand-ins while the trace runs, stand-in id -> tensor)
        self._tuples_held: list = []  # (name, read, tuple) of the tuples of tensors the function reaches
        self._writers: dict = {}  # id(a dict a plain object holds) -> how to give the object another one there
        real = {id(v): v for v in state.values().values()}  # (read before anything is swapped)
        # id(a stand-in) -> the tensor it stands for: a key or member the trace put (`seen.add(p)`)
        self._stood_for = {id(stand_in): real[real_id] for real_id, stand_in in swap.items() if real_id in real}
        if fn is not None:  # (their contents, and the modules', as they are before anything is swapped)
            self._watch(fn)
        for root in state.roots:  # (every module tree before any is swapped: one module reached by two roots, `m`
            if isinstance(root.value, torch.nn.Module):  # and `wrap.model`, was kept the second time holding
                self._keep(root.name, root.value)  # the first's stand-ins, and set back to them)
        swapped: set = set()  # ids of the modules whose tensors hold their stand-ins
        for root in state.roots:
            if isinstance(root.value, torch.nn.Module):
                self._module(root.value, swapped)
            elif isinstance(root.value, torch.optim.Optimizer):
                self._hold_plain(root.name or "optimizer", root.value)  # (its own dicts: `self.by_id.setdefault(id(p),
                self._optimizer(root.value)  # ...)` in a hand-written step, watched as a trainer's are)
            elif id(root.value) in swap:
                if root.write is None:
                    raise CaptureError(Problem(root.name, "is a tensor held where hpfun cannot put the value it "
                                               "lifts (an argument a functools.partial binds, an item of a tuple "
                                               "inside another object)", "pass it as an argument, close over it in a "
                                               "def, or hold it in a module's buffer or attribute"))
                self._set(root.write, root.value, swap[id(root.value)])
        self._rekey()
        for real_id, grad in grads.items():  # stand-in parameters get their gradients' stand-ins
            stand_in = swap[real_id]
            self._undo.append(functools.partial(setattr, stand_in, "grad", None))
            stand_in.grad = grad
        # a weak reference a module keeps to a lifted tensor (`self._wref() is w`, an identity-keyed cache): to
        # its stand-in while the trace runs, to the tensor after (`restore`)
        self._repoint_weak(swap, list(self._stood_for.values()))

    def _repoint_weak(self, to: dict, referents) -> None:
        """Each weak reference a module keeps (in its attributes, and the dicts and lists it holds)
        to a tensor whose id `to` maps: to the tensor it maps to; a weak proxy too, to one of
        `referents` (a proxy does not say what it refers to: their proxies are looked up)."""
        proxied = None
        for _, mod, _, _, containers in self._modules:
            places = {id(c): c for c, _ in containers.values() if type(c) in (dict, list)}
            places.update((id(v), v) for k, v in vars(mod).items()  # (and those the forward made: `self.refs = [...]`;
                          if type(v) in (dict, list) and not k.startswith("_")  # not torch's own, an RNN's
                          and len(v) <= PLAIN_CONTAINER_ITEMS)  # `_flat_weight_refs`, which it sets itself)
            for place in [vars(mod), *places.values()]:
                for k, v in list(place.items() if type(place) is dict else enumerate(place)):
                    if type(v) is weakref.ref and (r := v()) is not None and id(r) in to:
                        place[k] = weakref.ref(to[id(r)])
                    elif type(v) in WEAK_PROXIES:
                        if proxied is None:
                            proxied = {id(w): r for r in referents for w in weakref.getweakrefs(r)
                                       if type(w) in WEAK_PROXIES}
                        if (r := proxied.get(id(v))) is not None and id(r) in to:
                            place[k] = weakref.proxy(to[id(r)])

    def stands_for_parameter(self, value) -> bool:
        """Whether `value` is the stand-in of a lifted Parameter."""
        return _is_fake(value) and isinstance(self._stood_for.get(id(value)), torch.nn.Parameter)

    @property
    def traces_optimizer(self) -> bool:
        """Whether an optimizer's step may run in the trace (`ScalarSigns` then stands in for its numbers)."""
        return bool(self.signs or self._optimizers)

    def _set(self, write, old, new):
        write(new)
        self._undo.append(functools.partial(write, old))

    def _rekey(self) -> None:
        """A dict keyed by lifted tensors (one optimizer per parameter, `{p: torch.optim.AdamW([p])}`
        stepped in a gradient hook; a learning-rate scale per parameter), or by their ids, and a
        set of them (`p in no_decay`), is keyed by their stand-ins while the trace runs, in its
        order, and by the tensors again after (`_keys_back`): those the walk found (`_Keyed`),
        the dicts the function and its hooks reach, and those held by the objects they reach
        (the function's `self`, a closed-over trainer) and by the modules."""
        holders = [obj for _, obj, _ in self._plain_held]  # (the function's `self` among them)
        holders += [m for root in self.state.roots if isinstance(root.value, torch.nn.Module) for m in root.value.modules()]
        found = [root.value.container for root in self.state.roots if isinstance(root.value, _Keyed)]
        found += [c for _, _, c, _ in self._watched if _is_dict(c)]
        found += [v for obj in holders for k, v in _own_attributes(obj).items()
                  if (_is_dict(v) or type(v) is set) and _users_attribute(obj, k)]
        ids = {real_id: id(stand_in) for real_id, stand_in in self.swap.items()}

        def stand_in_for(k):
            if isinstance(k, torch.Tensor):
                return self.swap.get(id(k), k)
            if type(k) in (tuple, frozenset):  # (`scales[(p, "w")]`, `groups[frozenset(ps)]`)
                members = tuple(k)
                parts = tuple(map(stand_in_for, members))
                return type(k)(parts) if any(a is not b for a, b in zip(parts, members)) else k
            if type(k) is str and k.isdigit() and int(k) in ids:  # (`str(id(p))`)
                return str(ids[int(k)])
            return ids.get(k, k) if type(k) is int else k

        for root in self.state.roots:  # a frozenset of parameters: one of their stand-ins at its place
            if isinstance(root.value, _Keyed) and type(root.value.container) is frozenset and root.write is not None:
                frozen = root.value.container
                self._set(root.write, frozen, frozenset(map(stand_in_for, frozen)))
        seen: set = set()
        for container in found:
            if id(container) in seen or type(container) is frozenset:
                continue
            seen.add(id(container))
            pairs = [(k, stand_in_for(k)) for k in container]
            if all(new is old for old, new in pairs):
                continue
            if type(container) is set:
                container.clear()
                container.update(new for _, new in pairs)
            else:
                items = list(container.values())
                container.clear()
                container.update((new, v) for (_, new), v in zip(pairs, items, strict=True))
            self._rekeyed.append((container, {_key_identity(new): old for old, new in pairs if new is not old}))
        if self._rekeyed:
            self._undo.append(self._keys_back)

    def _keys_back(self) -> None:
        """The dicts `_rekey` keyed by stand-ins keyed by the tensors again, once the trace has
        run: before the slots are read (a tensor value's slot reads it by the tensor, `buf[p]`)
        and what the trace added is looked for."""
        for container, real in self._rekeyed:  # (a key the trace added, `seen.add(p)`: the tensor it stands for)
            _rekeyed_back(container, {**self._stood_for, **real})
        self._rekeyed.clear()

    def _module(self, module, swapped: set):
        for mod in module.modules():
            if id(mod) in swapped:
                continue
            swapped.add(id(mod))
            caches = [v for k, v in vars(mod).items() if _held_dict(k, v)]
            caches += [v for k, v in vars(mod).items() if type(v) is list and _modules_own(mod, k)
                       and (not k.startswith("_") or _tensor_list(v))]
            caches += [t for c in list(caches) if _is_dict(c) for t in c.values() if type(t) is list]
            for store in (mod._parameters, mod._buffers, vars(mod), *caches):
                for key, v in list(store.items() if isinstance(store, dict) else enumerate(store)):
                    if isinstance(v, torch.Tensor) and id(v) in self.swap:
                        self._set(functools.partial(store.__setitem__, key), v, self.swap[id(v)])
            for d in [vars(mod)[k] for k, v in vars(mod).items() if _held_dict(k, v)]:  # tuples under a dict's keys
                for key, v in list(d.items()):
                    if type(v) is tuple and any(id(t) in self.swap for t in v):
                        stand_ins = tuple(self.swap.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in v)
                        self._set(functools.partial(d.__setitem__, key), v, stand_ins)
                        self._tuples[id(stand_ins)] = stand_ins
            for key, v in list(vars(mod).items()):  # a tuple of tensors (gpytorch's `train_inputs`): rebuilt
                if isinstance(v, tuple) and not key.startswith("__") and any(id(t) in self.swap for t in v):
                    items = [self.swap.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in v]
                    stand_ins = tuple(items) if type(v) is tuple else type(v)(*items)
                    self._set(functools.partial(vars(mod).__setitem__, key), v, stand_ins)
                    self._tuples[id(stand_ins)] = stand_ins  # (not state the trace made: `created`)

    def _watch(self, fn) -> None:
        """Lists and dicts the function's code and the hooks of its modules and parameters (forward,
        backward, gradient) reach through closure cells and globals (`acts = []` that a forward
        hook appends activations to): what the trace adds to them is taken back, and added by
        every call (`created`)."""
        functions = [fn]
        for root in self.state.roots:
            if isinstance(root.value, torch.nn.Module):
                for mod in root.value.modules():
                    for hooks in (mod._forward_hooks, mod._forward_pre_hooks, mod._backward_hooks,
                                  mod._backward_pre_hooks):
                        functions += hooks.values()
                    for p in mod._parameters.values():  # a parameter's own gradient hooks
                        for hooks in (getattr(p, "_backward_hooks", None), getattr(p, "_post_accumulate_grad_hooks", None)):
                            functions += (hooks or {}).values()
        seen: set = set()
        helpers = set()  # (the helpers the function calls, found through its cells and globals: their dicts
        for f in functions:  # and lists are watched too, `get_state().setdefault(name, ...)`)
            helper = id(f) in helpers
            while isinstance(f, (functools.partial, types.MethodType)):
                if isinstance(f, types.MethodType) and _is_config_object(f.__self__):
                    # (`self.stats = {...}`; `self.opt.state.setdefault(p, ...)`: an object it holds, a
                    # hand-written optimizer, or a list or tuple of them, `self.opts`)
                    self._hold_plain_and_parts("self", f.__self__, sequences=True)
                if isinstance(f, functools.partial):  # (`partial(step, trainer)`: the trainer, as a method's self)
                    for i, a in (*enumerate(f.args), *f.keywords.items()):
                        if _is_config_object(a) and not callable(a):
                            self._hold_plain_and_parts(f"args.{i}" if type(i) is int else i, a, sequences=True)
                f = f.func if isinstance(f, functools.partial) else f.__func__
            if not isinstance(f, types.FunctionType) or (key := (f.__code__, id(f.__closure__), id(f.__defaults__))) in seen:
                continue
            if helper and _is_library(f.__code__.co_filename):
                continue
            seen.add(key)
            places = [(var, functools.partial(getattr, cell, "cell_contents"))
                      for var, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True)]
            places += [(var, functools.partial(f.__globals__.get, var)) for var in _global_names(f.__code__)
                       if var in f.__globals__]
            names = f.__code__.co_varnames[:f.__code__.co_argcount]  # default arguments (`acts=acts`)
            places += [(name, functools.partial(_default_of, f, i)) for i, name in
                       enumerate(names[len(names) - len(f.__defaults__ or ()):])]
            places += [(name, functools.partial((f.__kwdefaults__ or {}).get, name)) for name in f.__kwdefaults__ or {}]
            for var, read in places:
                try:
                    container = read()
                except ValueError:  # an empty cell
                    continue
                if isinstance(container, (types.FunctionType, functools.partial)) and len(functions) < 256:
                    helpers.add(id(container))
                    functions.append(container)
                    continue
                if helper and any(name == var for name, _, _, _ in self._watched):  # (two helpers' `state`)
                    var = f"{f.__qualname__}.{var}"
                self._places.append((var, read))
                if type(container) is tuple and _holds_tensor(container):  # (rebound to another length: refused)
                    self._tuples_held.append((var, read, container))
                if _is_config_object(container) and not callable(container):
                    self._hold_plain_and_parts(var, container)  # (`cfg.sub.m = ...`; slotted too)
                if (type(container) is list or _is_dict(container)) and not any(c is container for _, _, c, _ in
                                                                                 self._watched):
                    self._watched.append((var, read, container, dict(container) if _is_dict(container)
                                          else list(container)))
                    if _is_dict(container):  # its lists too (`D["l"].append(t)`), and its dicts (state made
                        self._watch_inside(var, container, 2)  # lazily: `D["bufs"].setdefault(p, ...)`), nested

    def _watch_inside(self, var: str, container: dict, depth: int) -> None:
        """The lists and dicts a watched dict holds, watched too, to `depth` levels (`D["a"]["l"]`)."""
        for key, inner in container.items():
            if not (type(inner) is list or _is_dict(inner)) or any(c is inner for _, _, c, _ in self._watched):
                continue
            name = f"{var}[{key!r}]"
            self._watched.append((name, functools.partial(_same, inner), inner,
                                  list(inner) if type(inner) is list else dict(inner)))
            if _is_dict(inner) and depth > 1:
                self._watch_inside(name, inner, depth - 1)

    def _hold_plain_and_parts(self, var: str, obj, sequences: bool = False) -> None:
        """`_hold_plain` of `obj` and of the plain objects it holds (in a list or tuple too, with
        `sequences`)."""
        self._hold_plain(var, obj)
        for k, v in list(attributes(obj).items()):
            if _is_config_object(v) and not callable(v):
                self._hold_plain(_join(var, k), v)
            elif sequences and type(v) in (list, tuple) and len(v) <= PLAIN_CONTAINER_ITEMS:
                for i, w in enumerate(v):
                    if _is_config_object(w) and not callable(w):
                        self._hold_plain(_join(var, f"{k}.{i}"), w)

    def _hold_plain(self, var: str, obj) -> None:
        """A plain object the function reaches: its attributes as they are, and its dicts watched
        as a global dict is (`o.st["k"] = {...}` merged into the dict held there, new keys put at
        every call)."""
        if any(held is obj for _, held, _ in self._plain_held):
            return
        self._plain_held.append((var, obj, attributes(obj)))
        for v in attributes(obj).values():  # (what its lists and dicts hold, two levels: `o.lst[0]`, not made by
            for w in _items_of(v):  # the step, whose tensors are taken out without taking it out)
                self._held_before.add(id(w))
                self._held_before.update(map(id, _items_of(w)))
        for k, v in _own_attributes(obj).items():
            if _is_dict(v) and _users_attribute(obj, k) and not any(c is v for _, _, c, _ in self._watched):
                self._watched.append((_join(var, k), functools.partial(getattr, obj, k), v, dict(v)))
                self._writers[id(v)] = functools.partial(set_attribute, obj, k)
            elif type(v) is tuple and _holds_tensor(v):  # (rebound to another length: refused)
                self._tuples_held.append((_join(var, k), functools.partial(getattr, obj, k), v))

    def _keep(self, prefix: str, module) -> None:
        """What each module holds before the trace, to find and take back what the trace left in it."""
        for name, mod in module.named_modules(remove_duplicate=True):
            held = vars(mod)
            containers = {k: (v, dict(v) if isinstance(v, dict) else list(v)) for k, v in held.items()
                          if (type(v) is list or _is_dict(v)) and _modules_own(mod, k)
                          and (not k.startswith("_") or not v or _holds_tensor(v))}  # (private: with tensors, or empty)
            self._modules.append((_join(prefix, name), mod, dict(held), dict(mod._buffers), containers))
            self._submodules[id(mod)] = dict(mod._modules)
            self._module_names.setdefault(id(mod), (prefix, _join(prefix, name)))
            for k, (v, _) in containers.items():  # lists inside a module's dict (`self.c["h"].append(v)`)
                if _is_dict(v):
                    self._inner_lists += [(_entry_name(_join(prefix, name), k, key), lst, len(lst))
                                          for key, lst in v.items() if type(lst) is list and _is_plain_key(key)]
                    self._inner_held.update((id(lst), list(lst)) for lst in v.values() if type(lst) is list)

    def created(self) -> dict:
        """name -> (value, place) of each tensor the trace put into a module that was not there
        (`self.cos_cached = ...`, `register_buffer` in a forward, `self.last_loss = loss.detach()`):
        state the step makes, written back after every call as eager leaves it (`put`)."""
        self._keys_back()
        out, appended = {}, set()  # (ids of the lists whose appends are taken: one list held twice counts once)
        swap = self.swap

        def put_there(v, before) -> bool:  # (not the stand-in of the tensor it held: one held by two
            return before is not v and swap.get(id(before)) is not v  # modules is lifted once, by one name)

        for prefix, mod, held, buffers, containers in self._modules:
            for attr, v in list(vars(mod).items()):
                if _is_fake(v) and put_there(v, held.get(attr)):
                    out[_join(prefix, attr)] = (v, ("attribute", prefix, attr))
                elif isinstance(v, (list, tuple, dict)) and _modules_own(mod, attr) and held.get(attr) is not v \
                        and _holds_fake(v) and self._tuples.get(id(v)) is not v:
                    # a container the step assigned (`self.hist = self.hist + [v]`, a window `self.h[1:] + [v]`):
                    # put whole at every call, each tensor in it as that call computes it (one it held before
                    # too: kept as the trace's, it held the first call's value at every later call)
                    out.update(_created_items(_join(prefix, attr), v, ("attribute", prefix, attr)))
            for attr, v in list(mod._buffers.items()):
                if _is_fake(v) and put_there(v, buffers.get(attr)):
                    out[_join(prefix, attr)] = (v, ("buffer", prefix, attr))
            for attr, (container, items) in containers.items():  # a cache dict the forward filled
                if isinstance(container, dict) and vars(mod).get(attr) is container:
                    for key, v in container.items():
                        if key not in items and _holds_fake(v) and (found := self._real_key(key)) is not None:
                            # made lazily under a parameter or its id (`self.bufs.setdefault(p, ...)`, `id(p)`)
                            out.update(_created_items(f"{_join(prefix, attr)}[{found[0]}]", v, (
                                "key", functools.partial(vars(mod).get, attr), found[1])))
                        elif _is_fake(v):  # (a lifted tensor it held, or one held elsewhere too: kept)
                            if put_there(v, items.get(key)) and _is_plain_key(key):
                                out[_entry_name(prefix, attr, key)] = (v, ("item", prefix, attr, key))
                        elif items.get(key) is not v and _is_plain_key(key) and _holds_fake(v) and self._tuples.get(id(v)) is not v:
                            # a container put under a key (`d.setdefault(k, []).append(t)`, `d[k] = d[k] + [t]`):
                            # put whole at every call, each tensor as that call computes it
                            out.update(_created_items(_entry_name(prefix, attr, key), v, ("item", prefix, attr, key)))
                elif type(container) is list and vars(mod).get(attr) is container and id(container) not in appended:
                    appended.add(id(container))  # (one list held in two places is appended to once)
                    read = functools.partial(vars(mod).get, attr)  # its batches to (torchmetrics' list states)
                    for i, v in enumerate(container[len(items):]):
                        out.update(_created_items(f"{_join(prefix, attr)}[+{i}]", v, ("append", read)))
        for name, lst, n in self._inner_lists:
            if id(lst) in appended:
                continue
            appended.add(id(lst))
            for i, v in enumerate(lst[n:]):
                out.update(_created_items(f"{name}[+{i}]", v, ("append", functools.partial(_same, lst))))
        for var, obj, held in self._plain_held:  # a tensor a plain object is given where it held none (a trainer's
            for attr, v in list(attributes(obj).items()):  # `self.last = loss.detach()`, one shadowing its class's tensor,
                if _made_attribute(obj, attr, v, held):  # a tuple or dict of them: `self.run = (loss,)`)
                    shadows = isinstance(getattr(type(obj), attr, None), torch.Tensor)  # (its class's: lifted by
                    name = _join(var, attr) + (" (the instance's own)" if shadows else "")  # that name)
                    out.update(_created_items(name, self._real_keys(v), ("set", functools.partial(set_attribute, obj, attr))))
        for prefix, g, group, keys in self._groups:  # a counter an optimizer keeps in its group (timm's Lamb)
            for key, v in group.items():
                if key not in keys and _is_fake(v):
                    out[_join(prefix, f"param_groups.{g}.{key}")] = (v, ("group", prefix, g, key))
        for var, read, container, items in self._watched:
            if type(container) is list:
                if id(container) in appended:
                    continue
                appended.add(id(container))
                for i, v in enumerate(container[len(items):]):
                    out.update(_created_items(f"{var}[+{i}]", v, ("append", read)))
            elif (write := self._writers.get(id(container))) is not None and _is_dict(now := read()) \
                    and now is not container and _holds_fake(now) and not _holds_tensor(items):
                out.update(_created_items(var, now, ("set", write)))  # (`self.stats = {"m": t}` where it held none)
            else:  # (only new keys, and dicts of tensors put where one held none: a tensor held before is
                for key, v in container.items():  # lifted state, its assignment written back as such)
                    was = items.get(key)
                    if key not in items or was is None and _holds_fake(v) or type(was) is dict and type(v) is dict \
                            and v is not was and not _holds_tensor(was) and _holds_fake(v):  # (None: `d = {"w": None}`)
                        # keyed by a parameter or its id (`bufs.setdefault(p, ...)`): by the parameter it stands for
                        if (found := self._real_key(key)) is not None:
                            out.update(_created_items(f"{var}[{found[0]}]", v, ("key", read, found[1])))
                        elif not _is_fake(key):
                            out.update(_created_items(f"{var}[{key!r}]", v, ("key", read, key)))
        return out

    def _real_keys(self, v):
        """A dict the step made, keyed by the tensors (or ids) its stand-ins stand for (`self.ema =
        {id(p): ... for p in params}` made at a first step: it kept the stand-ins' ids, and the
        next call's lookup by `id(p)` failed); any other value as it is."""
        if not _is_dict(v) or not any(_is_fake(k) or type(k) in (int, str, tuple, frozenset) for k in v):
            return v
        found = {id(k): self._real_key(k) for k in v}
        if not any(found.values()):
            return v
        out = type(v)() if type(v) is not collections.defaultdict else collections.defaultdict(v.default_factory)
        out.update((found[id(k)][1] if found[id(k)] else k, w) for k, w in v.items())
        return out

    def _real_key(self, key):
        """(its name, the key eager has) of a key the trace put under a stand-in or its id: the
        parameter it stands for, or that one's id; None for any other key."""
        if type(key) in (tuple, frozenset) and len(key) <= 4:  # (`(id(p), "m")`, `(p, "exp_avg")`,
            items = list(key)  # `frozenset([p])`, `((p, 0), "m")`): each part as a key
            parts = [self._real_key(k) if _is_fake(k) or type(k) in (int, str, tuple, frozenset) else None
                     for k in items]
            if not any(parts):  # (the others as they are)
                return None
            names = ", ".join(part[0] if part else repr(k) for part, k in zip(parts, items))
            real = [part[1] if part else k for part, k in zip(parts, items)]
            return (f"({names})", tuple(real)) if type(key) is tuple else (f"frozenset({{{names}}})", frozenset(real))
        if type(key) is str:  # (`str(id(p))`: the id of the parameter it stands for, as a string)
            found = self._real_key(int(key)) if key.isdigit() else None
            return None if found is None else (f"str({found[0]})", str(found[1]))
        real = self._stood_for.get(id(key) if _is_fake(key) else key) \
            if _is_fake(key) or type(key) is int else None
        if real is None:
            return None
        named = self.state.param_names.get(id(real), "<tensor>")
        return (f"id({named})", id(real)) if type(key) is int else (named, real)

    def _module_lists(self):
        """(name, list, its items before the trace) of each list a module holds (an attribute, or
        a value of a dict it holds), as the trace found it."""
        for prefix, mod, _, _, containers in self._modules:
            for attr, (container, items) in containers.items():
                if type(container) is list and vars(mod).get(attr) is container:
                    yield _join(prefix, attr), container, items
        for name, lst, n in self._inner_lists:
            yield name, lst, self._inner_held[id(lst)]
        for name, _, container, items in self._watched:  # a closed-over, global or default argument's list
            if type(container) is list:
                yield name, container, items

    def _kept_prefix(self, lst: list, held: list) -> bool:
        """Whether `lst` still begins with what it held (lifted tensors as their stand-ins), a
        tensor's place given another tensor, or None, allowed (`params[0] = params[0] - lr * g`:
        the slot's write, which every call makes)."""
        if len(lst) < len(held):
            return False
        moved = {id(self.swap.get(id(t), t)) for t in torch.utils._pytree.tree_leaves(held) if isinstance(t, torch.Tensor)}

        def same(a, b) -> bool:
            if a is self.swap.get(id(b), b):
                return True
            if isinstance(b, torch.Tensor):  # its place written: a new tensor (not another place's), or emptied
                return a is None or isinstance(a, torch.Tensor) and id(a) not in moved
            if type(b) in (tuple, list) and type(a) is type(b):  # (a tuple of tensors is rebuilt with stand-ins)
                return len(a) == len(b) and all(map(same, a, b))
            if type(b) is dict and type(a) is dict:
                return a.keys() == b.keys() and all(same(a[k], b[k]) for k in b)
            return False

        appended = torch.utils._pytree.tree_leaves(lst[len(held):])
        return all(map(same, lst, held)) and not any(id(t) in moved for t in appended)

    def _param_list_edits(self) -> list[Problem]:
        """An optimizer's parameter lists edited by the step (a parameter moved to another group,
        removed, the list rebound): a program cannot repeat it, and putting the parameters back
        by position would leave them in the trace's order (a swap between groups was undone
        silently, each parameter stepped at the other's rate). Each list is set back as the trace
        found it, for `restore` to put the parameters back, and named."""
        problems = []
        for prefix, g, group, params, items in self._param_lists:
            now = group.get("params")
            if type(now) is list and now is not params and len(now) == len(items) and all(map(operator.is_, now, items)):
                group["params"] = params  # (`g["params"] = list(g["params"])`: the same parameters, in the list it held)
            if group.get("params") is params and len(params) == len(items) and all(map(operator.is_, params, items)):
                continue
            group["params"] = params
            params[:] = items
            problems.append(Problem(f"{_join(prefix, f'param_groups.{g}')}['params']", "is edited by the function "
                                    "(a parameter moved to another group, added, removed or reordered, or the list "
                                    "replaced): a traced program cannot repeat that",
                                    "edit the optimizer's parameter groups outside the sharded function, between calls"))
        return problems

    def _container_edits(self) -> list[Problem]:
        """What the trace did to a module's lists and containers that a program cannot do again
        at every call: anything but appending tensors (or tuples, lists, dicts of them) to a list,
        and a container of tensors assigned anew with none (`self.buf = []`). A call of the cached
        program would skip it, silently."""
        fix = ("edit the list outside the sharded function (after the call), or append only tensors inside it; "
               "a list a call resets is best kept outside: return the tensors and keep them there")
        problems = []
        private = {id(c) for _, _, _, _, containers in self._modules for attr, (c, _) in containers.items()
                   if attr.startswith("_")}
        for name, lst, held in self._module_lists():
            if id(lst) in private and not any(map(_holds_fake, lst)):
                continue  # (a module's private list given no tensor: a library's bookkeeping, left to it)
            if not self._kept_prefix(lst, held):
                problems.append(Problem(name, "is a list the function edits other than by appending (insert, pop, "
                                        "clear, remove, an item replaced or sorted), which the program cannot "
                                        "repeat at every call", fix))
                continue
            plain = [v for v in lst[len(held):] if not _holds_fake(v)]
            if plain:
                problems.append(Problem(name, f"gets a value holding no tensor appended ({_short(plain[0])}): the "
                                        "program returns tensors only, so a cached call would not append it", fix))
        for prefix, mod, held_attrs, _, _ in self._modules:
            for attr, v in vars(mod).items():
                was = held_attrs.get(attr)
                if isinstance(v, (list, tuple, dict)) and _modules_own(mod, attr) and was is not v and not _holds_fake(v) \
                        and type(was) in (list, tuple, dict) and _holds_tensor(was):
                    problems.append(Problem(_join(prefix, attr), f"holds tensors and is assigned a new {type(v).__name__} "
                                            "holding none: a cached call of the program would not assign it", fix))
        return problems

    def _rebound(self) -> list[Problem]:
        """A global or closed-over list or dict the function rebinds (`D = {"a": D["a"] + v}`,
        `G = G[1:] + [v]`) is written back into the one it held, place by place: a dict's new
        values are put in the old one here (its slots read it), a list's slots read the new one
        by position. One rebound with other keys or another length is refused (the places the
        program writes are the old ones), and set back to the one it held."""
        problems = []

        def refused(var, kind, what, keep):
            problems.append(Problem(var, f"is rebound to a new {kind} with {what}: hpfun writes a rebound {kind} "
                                    "back into the one it held, place by place",
                                    f"keep {keep}, or return the new values and rebind it after the call"))

        dict_keep = "its keys (or assign `D[key] = ...` into the dict it holds)"
        for var, obj, held in self._plain_held:  # a plain object's dict given a new one (`self.stats = {...}`):
            for attr, was in held.items():  # merged into the one it held, whose slots the program writes
                now = attributes(obj).get(attr)
                if type(was) is not dict or type(now) is not dict or now is was or not _holds_fake(now):
                    continue
                if not _holds_tensor(was):  # (where it held none, `self.stats = {}` before: state the step
                    continue  # makes, put whole at every call, `created`)
                if (other := _other_keys(was, now, _join(var, attr))) is not None:
                    refused(*other, dict_keep)
                else:
                    _merge(was, now)
                set_attribute(obj, attr, was)
        for var, read, held in self._tuples_held:  # (its slots write a tuple of its length at its place)
            try:
                now = read()
            except ValueError:
                continue
            if type(now) is tuple and len(now) != len(held) and _holds_fake(now):
                refused(var, "tuple", f"another length ({len(held)} items before, {len(now)} now)",
                        "its length, or keep a growing sequence in a list the function appends to")
                _rebind(read, held)
        for var, read, container, items in self._watched:
            try:
                now = read()
            except ValueError:
                continue
            if now is container:  # a dict in one of its places given a new dict (`L[0] = {"a": L[0]["a"] + v}`):
                places = items.items() if type(items) is dict else enumerate(items)  # merged into the old one
                for key, was in list(places):
                    new = container.get(key) if _is_dict(container) else \
                        container[key] if key < len(container) else None
                    if type(was) is tuple and type(new) is tuple and len(new) != len(was) and _holds_fake(new):
                        refused(f"{var}[{key!r}]", "tuple", f"another length ({len(was)} items before, {len(new)} "
                                "now)", "its length, or keep a growing sequence in a list the function appends to")
                        container[key] = was  # (its slots write a tuple of its length at its place)
                        continue
                    if type(was) is list and type(new) is list and new is not was and len(new) != len(was) \
                            and _holds_fake(new) and _holds_tensor(was):  # (`G["l"] = G["l"] + [v]`)
                        refused(f"{var}[{key!r}]", "list", f"another length ({len(was)} items before, {len(new)} "
                                "now)", "its length (a window: `G['l'] = G['l'][1:] + [v]`), or append to the list "
                                "it holds (`G['l'].append(v)`: hpfun appends at every call)")
                        container[key] = was  # (its slots write a list of its length at its place)
                        continue
                    if type(was) is not dict or type(new) is not dict or new is was or not _holds_fake(new):
                        continue
                    if _is_dict(container) and not _holds_tensor(was):  # (`D["cache"] = {"k": t}` where it held
                        continue  # none: state the step makes, put whole at every call, `created`)
                    if (other := _other_keys(was, new, f"{var}[{key!r}]")) is not None:
                        refused(*other, dict_keep)
                    else:
                        _merge(was, new)
                    container[key] = was
                continue
            if type(now) is not type(container) or not _holds_fake(now):
                continue
            if id(container) in self._writers and not _holds_tensor(items):  # (a plain object's dict that held
                continue  # none given one of tensors: state the step makes, put whole at every call, `created`)
            kind = type(container).__name__
            if _is_dict(container) and (other := _other_keys(container, now, var)) is not None:
                refused(*other, dict_keep)
                _rebind(read, container)
            elif not _is_dict(container) and len(now) != len(container):
                refused(var, kind, f"another length ({len(container)} items before, {len(now)} now)",
                        "its length (a window: `G = G[1:] + [v]`)")
                _rebind(read, container)
            elif kind == "dict":
                _merge(container, now)
                _rebind(read, container)
        return problems

    def _take_back(self) -> None:
        """Nothing the trace made stays in a module: its tensors are the trace's stand-ins."""
        for _, lst, n in self._inner_lists:
            if len(lst) != n or any(_holds_fake(v) for v in lst):
                lst[:] = self._inner_held[id(lst)]  # (what a refused trace appended too)
        for _, mod, held, buffers, containers in self._modules:
            for attr, v in list(vars(mod).items()):
                was = held.get(attr)
                if (_is_fake(v) or isinstance(v, (list, tuple, dict)) and _modules_own(mod, attr)
                        and (_holds_fake(v) or type(was) in (list, tuple, dict) and _holds_tensor(was))) \
                        and was is not v:  # (a container of tensors emptied: refused, `_container_edits`)
                    if attr in held:
                        setattr(mod, attr, held[attr])
                    else:
                        delattr(mod, attr)
            for attr, v in list(mod._buffers.items()):
                if _is_fake(v) and buffers.get(attr) is not v:
                    if attr in buffers:
                        mod._buffers[attr] = buffers[attr]
                    else:
                        del mod._buffers[attr]
            for attr, (container, items) in containers.items():  # a cache dict the forward filled
                inside = container.values() if isinstance(container, dict) else container
                if any(map(_holds_fake, inside)) or type(container) is list and not attr.startswith("_") and \
                        (len(container) != len(items) or any(a is not b for a, b in zip(container, items))):
                    # (a list given a number is refused, `_container_edits`: left as it was)
                    container.clear()
                    container.update(items) if isinstance(container, dict) else container.extend(items)
        for _, _, group, keys in self._groups:
            for key in [k for k, v in group.items() if k not in keys and _is_fake(v)]:
                del group[key]
        for _, obj, held in self._plain_held:
            for attr in [a for a, v in attributes(obj).items()  # (as `created` put them)
                         if _made_attribute(obj, a, v, held)]:
                set_attribute(obj, attr, None) if attr in held else del_attribute(obj, attr)
        for _, _, container, items in self._watched:
            inside = container.values() if _is_dict(container) else container
            if any(_holds_fake(v) for v in inside) or type(container) is list and \
                    (len(container) != len(items) or any(a is not b for a, b in zip(container, items))):
                container.clear()
                container.update(items) if _is_dict(container) else container.extend(items)

    def _optimizer(self, opt):
        prefix = next(r.name for r in self.state.roots if r.value is opt)
        for g, group in enumerate(opt.param_groups):
            self._groups.append((prefix, g, group, frozenset(group)))
            if group.get("fused"):  # one kernel per step with no fake tensor kernel: traced as the for-loop
                # path, the same arithmetic per tensor (as foreach, capture splits it per tensor)
                self._set(functools.partial(group.__setitem__, "fused"), group["fused"], False)
                self.set_aside.add(_join(prefix, f"param_groups.{g}.fused"))
                self._fused.update(id(self.swap.get(id(p), p)) for p in group["params"])
            for kind, key, value in ((TRACED_CAPTURABLE, "capturable", True), (TRACED_FOR_LOOP, "foreach", False)):
                if type(opt) in kind and group.get(key, value) != value:
                    self._set(functools.partial(group.__setitem__, key), group[key], value)
                    self.set_aside.add(_join(prefix, f"param_groups.{g}.{key}"))
            stand_ins = {}
            for name, (key, index) in lifted_scalars(opt, group).items():
                stand_in = self.scalars.get(_join(prefix, f"param_groups.{g}.{name}"))
                if stand_in is not None:
                    self.signs[id(stand_in)] = _sign(group[key] if index is None else group[key][index])
                    self.floats.add(id(stand_in))
                    stand_ins.setdefault(key, list(group[key]) if index is not None else None)
                    if index is None:
                        stand_ins[key] = stand_in
                    else:
                        stand_ins[key][index] = stand_in
            for key, stand_in in stand_ins.items():
                self._set(functools.partial(group.__setitem__, key), group[key],
                          tuple(stand_in) if isinstance(stand_in, list) else stand_in)
            if stand_ins and group.get("foreach"):  # foreach paths refuse tensor rates unless capturable;
                # the for-loop path does what the foreach one does (capture splits foreach ops per tensor)
                self._set(functools.partial(group.__setitem__, "foreach"), group["foreach"], False)
                self.set_aside.add(_join(prefix, f"param_groups.{g}.foreach"))
                if isinstance(opt, torch.optim.SGD):  # (and to the gradients: `optimizers._sgd_step`)
                    ids = {id(self.swap.get(id(p), p)) for p in group["params"]}
                    FOREACH_SGD.update(ids)
                    self._undo.append(functools.partial(FOREACH_SGD.difference_update, ids))
            self._swap_held_tensors(group)
            params = group["params"]
            for i, p in enumerate(params):
                self._real_params[id(self.swap.get(id(p), p))] = p
                if id(p) in self.swap:
                    self._set(functools.partial(params.__setitem__, i), p, self.swap[id(p)])
            self._param_lists.append((prefix, g, group, params, list(params)))
        if isinstance(opt.defaults, dict):
            self._swap_held_tensors(opt.defaults)
        entry_type = _Float64Scalars if type(opt) in TRACED_CAPTURABLE else dict
        stand_in_state = collections.defaultdict(entry_type)
        for p, entries in opt.state.items():
            if not isinstance(entries, dict) or not isinstance(p, torch.Tensor):  # (under a key of the optimizer's own:
                stand_in_state[p] = self.swap.get(id(entries), entries) if isinstance(entries, torch.Tensor) else entries
                if not isinstance(entries, torch.Tensor) and not _is_scalar(entries) and _is_plain_data(entries):
                    self._own_before[id(entries)] = copy.deepcopy(entries)  # (a tensor's stand-in, or the data itself,
                continue  # which a step may change in place: `_own_data`)
            stand_in_state[self.swap.get(id(p), p)] = entry_type(
                {k: self.swap.get(id(v), v) if isinstance(v, torch.Tensor) else _with_tensors(
                    v, [self.swap.get(id(t), t) for _, t in _tensor_items(v)])
                 if _tensor_sequence(v) else v for k, v in entries.items()})
        real_state = opt.state
        opt.state = stand_in_state
        self._undo.append(functools.partial(setattr, opt, "state", real_state))
        self._optimizers.append((opt, stand_in_state, real_state))

    def _swap_held_tensors(self, group: dict) -> None:
        """The tensors an optimizer's group or defaults holds (`_group_tensors`), their stand-ins
        put in their place while the trace runs; a 0-d one's sign answers a comparison."""
        for key, v in list(group.items()):
            held = _group_tensors(key, v)
            for _, x in held:
                if id(x) in self.swap and (sign := _tensor_sign(x)) is not None:
                    self.signs[id(self.swap[id(x)])] = sign
            if any(id(x) in self.swap for _, x in held):
                self._set(functools.partial(group.__setitem__, key), v, self.swap[id(v)] if held[0][0] is None else
                          type(v)(self.swap.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in v))

    def assigned(self) -> tuple[dict, dict]:
        """What the traced function left in each slot, read in the substituted world: name ->
        value (None where it emptied a slot); and, for an optimizer's state it created, name ->
        (optimizer, parameter, key), the place to create it at."""
        self._keys_back()
        self._unwrap_escaped()
        edits = self._rebound() + self._container_edits() + self._param_list_edits()  # (before any slot is read: a
        # list cleared holds none of them)
        if edits:
            raise CaptureError(edits, headline="cannot lift the state the function reads")
        if deleted := [name for name, slot in self.state.slots.items() if not _readable(slot)]:
            raise CaptureError([Problem(name, "is deleted by the function (`del`): hpfun writes the state it lifts "
                                        "back after every call, and a program cannot delete it",
                                        "delete it outside the sharded function, or set it to None inside (hpfun "
                                        "then sets it to None at every call)") for name in deleted],
                               headline="the function deletes state")
        for slot in self.state.slots.values():  # (a place assigned under a torch.func transform: `_unwrap_escaped`)
            if isinstance(v := slot.read(), torch.Tensor) and (u := _unwrapped(v)) is not v:
                slot.write(u)
        real_of = {id(stand_in): real_id for real_id, stand_in in self.swap.items()}
        out, new_state, problems = {}, {}, []
        shared = {name for name, _ in self.state.shared_writes}  # (further keys of optimizer state holding a tensor)
        for name, slot in self.state.slots.items():
            if slot.follows is None or name.endswith(".grad"):
                out[name] = _read_substituted(slot, name, self.swap, self.state)
        for opt, stand_in_state, real_state in self._optimizers:
            prefix = next(r.name for r in self.state.roots if r.value is opt)
            seen = set()
            for p, entries in stand_in_state.items():
                if not isinstance(p, torch.Tensor):  # a key of the optimizer's own
                    if isinstance(entries, torch.Tensor) and _is_name(p):
                        name = f"{_join(prefix, 'state')}.{p}"
                        out[name] = _unwrapped(entries)
                        if name not in self.state.slots:  # made by the step: put there after every call
                            new_state[name] = (None, None, ("optimizer state", prefix, p))
                    elif isinstance(entries, torch.Tensor) and type(p) in (tuple, frozenset) and any(
                            isinstance(k, torch.Tensor) for k in p):  # (`self.state[(p, "m")]`)
                        key = ", ".join(self.state.param_names.get(real_of.get(id(k), id(k)), "a tensor")
                                        if isinstance(k, torch.Tensor) else repr(k) for k in p)
                        problems.append(Problem(f"{_join(prefix, 'state')}[({key})]", "holds a tensor the step made, "
                                                "under a key holding a parameter: hpfun lifts an optimizer's state "
                                                "kept under a parameter, or under a name of its own",
                                                "keep it in the parameter's own state, as torch.optim does: "
                                                "`self.state[p]['m'] = ...`"))
                    elif isinstance(entries, torch.Tensor):
                        problems.append(Problem(f"{_join(prefix, 'state')}[{p!r}]", "holds a tensor the step made, "
                                                "under a key hpfun cannot name", "key it by a string without dots"))
                    elif _holds_fake(entries):  # (`self.state["acc"] = {"n": t}`)
                        problems.append(Problem(f"{_join(prefix, 'state')}[{p!r}]", f"holds a {type(entries).__name__} "
                                                "of tensors the step made: hpfun lifts a tensor kept under a key of the "
                                                "optimizer's own, not a container of them", "keep each tensor under its "
                                                "own key (`self.state['acc_n'] = t`), or in a parameter's state"))
                    elif _is_plain_data(entries):  # a number of its own (`self.state["k"] = self.state.get("k", 0)
                        # + 1`), or a list or dict of them: made by the step, put as eager's step leaves it; changed by
                        # a later call (rebound, or edited in place), refused as a changed step count is (the program
                        held = real_state.get(p, _MISSING)  # bakes the data in)
                        was = self._own_before.get(id(held), held)
                        if held is _MISSING:
                            self.new_numbers.append((real_state, p, None, entries))
                        elif not (type(was) is type(entries) and was == entries):
                            problems.append(changed_state(f"{_join(prefix, 'state')}[{p!r}]", opt, was, entries))
                            if was is not held:  # (edited in place: set back)
                                real_state[p] = was
                    continue
                entries = entries.stored() if isinstance(entries, _Float64Scalars) else entries
                owner = self.state.param_names.get(real_of.get(id(p), id(p)))
                real_p = self._real_params.get(id(p))
                for key, v in entries.items():
                    if owner is not None and v is None:  # a key set to None (`st["m2"] = None`): so set by every
                        name = f"{_join(prefix, 'state')}.{owner}.{key}"  # call where it held a tensor, put where
                        if name in self.state.slots or name in shared:  # eager puts it where the step made it
                            out[name] = None
                            seen.add(name)
                        elif real_p is not None and key not in real_state.get(real_p, {}):
                            self.new_numbers.append((real_state, real_p, key, None))
                        continue
                    if owner is not None and _tensor_sequence(v):  # a list of tensors: each its own state
                        problems += self._state_sequence(f"{_join(prefix, 'state')}.{owner}.{key}", v, real_state,
                                                         real_p, owner, key, out, new_state, seen)
                        continue
                    if owner is not None and v is not None and not isinstance(v, torch.Tensor):
                        name = f"{_join(prefix, 'state')}.{owner}.{key}"
                        held = real_state.get(real_p, {}).get(key, _MISSING) if real_p is not None else _MISSING
                        if held is v and not _is_scalar(v):  # not lifted, and left as it was (LBFGS's history)
                            continue
                        if not _is_scalar(v):
                            problems.append(_untraceable_state(name, v, opt))
                        elif held is _MISSING and real_p is not None:  # made by the step (its first): put
                            self.new_numbers.append((real_state, real_p, key, v))  # where eager puts it
                        elif not (type(held) is type(v) and held == v):
                            problems.append(changed_state(name, opt, held, v))
                    if owner is None or not isinstance(v, torch.Tensor):
                        continue
                    name = f"{_join(prefix, 'state')}.{owner}.{key}"
                    v = _unwrapped(v)
                    if name not in self.state.slots and key == "step" and id(p) in self._fused and v.dim() == 0:
                        v = v.to(torch.float32)  # as the fused kernel's state makes it (the loop's is the default dtype)
                    out[name] = v
                    seen.add(name)
                    if name not in self.state.slots:
                        new_state[name] = (prefix, owner, key)
            for name, slot in self.state.slots.items():  # state the step removed
                if slot.follows is not None and not name.endswith(".grad") and name.startswith(_join(prefix, 'state') + '.') and name not in seen:
                    out[name] = REMOVED
            for name in shared:  # (and a further key holding one of its tensors)
                if name.startswith(_join(prefix, 'state') + '.') and name not in seen:
                    out[name] = REMOVED
        if problems:
            raise CaptureError(problems, headline="cannot lift the state the function reads")
        for name, (value, setter) in self.created().items():
            if name not in out:
                out[name] = value
                new_state[name] = (None, None, setter)
        for name, read, write, held in self.state.aliases:  # a second place of a lifted tensor that the step
            if name not in out:
                try:  # rebound (`self.stats = {"last": loss}` where it held `self.ema`'s tensor): put there
                    v = read()
                except Exception:  # noqa: BLE001 (a place the step took away: as eager leaves it)
                    continue
                if _is_fake(v) and v is not self.swap.get(held):
                    out[name] = _unwrapped(v)
                    new_state[name] = (None, None, ("set", write))
                elif v is None or _is_scalar(v):  # (emptied, or set to a number: set so by every call)
                    out[name] = v
        return out, new_state

    def _state_sequence(self, name: str, v, real_state, real_p, owner: str, key, out: dict, new_state: dict,
                        seen: set) -> list:
        """A list or tuple of tensors in a parameter's state (or a dict of them by name): each
        tensor written back to its item where the list was lifted with as many items (the dict
        with the same keys); one the step made (its first) put whole after the call, as eager's
        step leaves it, each tensor in its parameter's layout (`owner`, as a tensor of the state
        is); one of another length (other keys) refused."""
        pairs = _tensor_items(v)
        items = [f"{name}.{i}" for i, _ in pairs]
        lifted = [item in self.state.slots for item in items]
        under = {n for n in self.state.slots if n.startswith(name + ".")}
        if all(lifted) and under == set(items):
            for item, (_, t) in zip(items, pairs, strict=True):
                out[item] = _unwrapped(t)
                seen.add(item)
            return []
        if under or real_p is None:
            what = "keys" if isinstance(v, dict) else "length"
            held = sorted(n[len(name) + 1:] for n in under)
            now = [str(i) for i, _ in pairs] if isinstance(v, dict) else [str(len(v))]
            change = (f" ({', '.join(held)} before, {', '.join(now)} now)" if isinstance(v, dict) else
                      f" ({len(held)} before, {len(v)} now)") if under else ""
            return [Problem(name, f"is a {type(v).__name__} of {len(v)} tensors whose {what} the step changed{change}: "
                            "hpfun lifts each of its tensors in its place",
                            f"keep the {'dict' if isinstance(v, dict) else 'list'}'s {what} from step to step "
                            "(or one tensor under each key)")]
        whole = _Assembly(_with_tensors(v, [_unwrapped(t) for _, t in pairs]))
        place = ("set", functools.partial(_put_state_entry, real_state, real_p, key))
        for j, (item, (_, t)) in enumerate(zip(items, pairs, strict=True)):
            out[item] = _unwrapped(t)
            new_state[item] = (None, owner, ("part", place, whole, j))
        return []

    def _unwrap_escaped(self) -> None:
        """A tensor put in a place inside a torch.func transform (`self.t = self.t.to(x.device)` in
        a loss under torch.func.grad, as diffusers' schedulers do) is the transform's wrapper,
        which outlives it, as in eager: every place the function reaches holds the traced tensor
        it wraps instead (the wrapper is no value of the trace, and was kept as a constant). Here
        the modules and containers; `assigned` unwraps what the slots hold once their lists are
        known to be whole."""
        for _, mod, _, _, _ in self._modules:
            for store in (mod._parameters, mod._buffers, vars(mod)):
                for key, v in list(store.items()):
                    if not (isinstance(key, str) and key.startswith("__")) and (u := _scrubbed(v)) is not v:
                        store[key] = u
        for _, lst, _ in self._inner_lists:
            _scrubbed(lst)
        for _, _, container, _ in self._watched:
            _scrubbed(container)
        for _, obj in self.state.opaque:  # (a dict or a plain object a helper closes over: the objects
            _scrubbed(obj)  # hpfun does not lift, whose new tensors are refused by `ObjectValues.leaked`)
        for _, read in self._places:
            try:
                _scrubbed(read())
            except ValueError:  # (an empty cell)
                continue

    def restore(self) -> None:
        for _, read in self._places:  # a set the trace added a stand-in to (`seen.add(p)`): the tensor it stands for
            try:
                held = read()
            except ValueError:
                continue
            if type(held) is set and any(_is_fake(v) for v in held):
                members = [self._stood_for.get(id(v), v) for v in held]
                held.clear()
                held.update(v for v in members if not _is_fake(v))
        for _, lst, held in self._module_lists():  # (a list cleared or cut: its swapped places first)
            if not self._kept_prefix(lst, held):
                lst[:] = [self.swap.get(id(v), v) for v in held]
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._take_back()
        self._repoint_weak(self._stood_for, list(self.swap.values()))  # a weak reference the forward kept to a lifted tensor (`self.wref =
        # weakref.ref(self.lin.weight)`): to the tensor, not its stand-in, which dies
        for root in self.state.roots:  # an RNN keeps a list of its weights (`_flat_weights`), set when
            if isinstance(root.value, torch.nn.Module):  # one is assigned: the trace's stand-ins were left in it
                for m in root.value.modules():
                    if isinstance(m, torch.nn.RNNBase) and any(_is_fake(w) for w in m._flat_weights):
                        _reset_flat_weights(m)

    def put_back(self) -> None:
        """After a refused trace: each module's attributes, the dicts and lists it holds, and those
        the function reaches, as they were before it (a record the step kept, `self.last =
        Rec(t=y)`, was left emptied of the trace's tensors where the module held another; a helper
        the step put in a global dict, left there without its tensor)."""
        def set_back(container, items) -> None:
            if _is_dict(container) and type(items) is dict and (container.keys() != items.keys() or any(
                    container[k] is not v for k, v in items.items())):
                container.clear()
                container.update(items)
            elif type(container) is list and type(items) is list and (
                    len(container) != len(items) or any(map(operator.is_not, container, items))):
                container[:] = items

        for _, mod, held, _, containers in self._modules:
            now = vars(mod)
            for k in [k for k in now if k not in held]:
                del now[k]
            for k, v in held.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
            for container, items in containers.values():
                set_back(container, items)
        for _, _, container, items in self._watched:
            set_back(container, items)

    def left_over(self) -> list[str]:
        """After `restore`: the places that still hold a tensor of the trace, each taken out (a
        stand-in in a list of lists, an optimizer made or a param group added inside the function,
        a global rebound to a new list): state hpfun cannot write back, which the program would
        otherwise leave as the first call's placeholders, silently. A global or closed-over list
        or dict rebound is set back to the one it held."""
        found: list[str] = []
        seen: set = set()
        for root in self.state.roots:  # a subclass given its own tensor where it inherited one
            if isinstance(root.value, _Inherited) and _is_fake(vars(root.value.cls).get(root.value.attr)):
                sub, owner = root.value.cls.__name__, root.value.owner.__name__
                found.append(f"{root.name} (set on {sub}, which inherits it from {owner}: assign it on {owner}, where "
                             "hpfun reads and writes it)")
                delattr(root.value.cls, root.value.attr)
        for var, read, container, held in self._watched:
            try:
                now = read()
            except ValueError:
                continue
            if now is not container and _holds_fake(now) and id(container) in self._writers \
                    and not _holds_tensor(held):  # (put whole at every call: `created`)
                _rebind(read, container)
                continue
            if now is not container and _holds_fake(now):
                # rebound (`G = G[1:] + [v]`): its places are written back by their slots; a place no slot
                # has (the list held one tensor twice, lifted once) would keep the old value
                items = now.items() if _is_dict(now) else enumerate(now) if type(now) is list else ()
                found += [f"{var}[{k!r}] (rebound: its old {type(container).__name__} had no tensor of its own there)" for k, v in items
                          if _holds_fake(v) and f"{var}.{k}" not in self.state.slots]
                _rebind(read, container)
        for prefix, mod, _, _, _ in self._modules:  # a submodule made inside (`self.head = nn.Linear(...)`): the
            before = self._submodules.get(id(mod), {})  # one held before is put back (its stand-in weights are gone)
            for key, sub in list(mod._modules.items()):
                if key in before and before[key] is sub or not _holds_fake_state(sub):
                    continue
                found.append(f"{_join(prefix, key)} (a module made inside the function)")
                if key in before:
                    mod._modules[key] = before[key]
                else:
                    del mod._modules[key]
        for var, _, container, items in self._watched:  # a module made inside, kept in a global or closed-over
            inside = container.items() if _is_dict(container) else enumerate(container)  # list or dict, or
            made = [k for k, v in inside if v is not (items.get(k) if type(items) is dict else  # on a plain object:
                                                      items[k] if k < len(items) else None)  # taken out whole (its
                    and _holds_made_module(v)]
            if made:  # weights were taken out, leaving a Linear without weight for eager code)
                found += [f"{var}[{k!r}] (a module made inside the function)" for k in made]
                container.clear()
                container.update(items) if _is_dict(container) else container.extend(items)
            _drop_made_modules(container, var, found)  # (in a dict or list it holds)
        for var, obj, held in self._plain_held:
            for attr, v in list(attributes(obj).items()):
                if _holds_made_module(v) and held.get(attr) is not v:
                    found.append(f"{_join(var, attr)} (a module made inside the function)")
                    set_attribute(obj, attr, held[attr]) if attr in held else del_attribute(obj, attr)
                elif type(v) in (dict, list) and held.get(attr) is v:  # (one it held, a module added to it)
                    _drop_made_modules(v, _join(var, attr), found)
                    found += _made_helpers(v, _join(var, attr), seen, before=self._held_before)
                elif type(v) in (dict, list) and held.get(attr) is not v and _holds_fake(v) and attr in held:
                    found.append(f"{_join(var, attr)} (a {type(v).__name__} assigned anew holding tensors: hpfun "
                                 f"writes back into the places of the one it held; update that one in place)")
                    set_attribute(obj, attr, held[attr])
                elif held.get(attr) is not v and _is_plain_object(v) and not callable(v):
                    inside: list = []  # (a helper made lazily, `self.tracker = Tracker()`, holding the step's tensors)
                    _take_fakes(v, _join(var, attr), inside, seen)
                    found += [f"{where} (in a {type(v).__name__} the function made: make it before the first call, "
                              "in __init__, and hpfun lifts its tensors as state)" for where in inside]
                    if inside:
                        set_attribute(obj, attr, held[attr]) if attr in held else del_attribute(obj, attr)
        for prefix, mod, held, _, containers in self._modules:  # a helper a step made and put in a module's list or
            for attr, (container, items) in containers.items():  # dict (`self.d["c"] = Cache(w)`): taken out whole,
                if vars(mod).get(attr) is container:  # as it was not there (emptied, eager code read it and failed)
                    before = {id(w) for w in (items.values() if isinstance(items, dict) else items)}
                    found += _made_helpers(container, _join(prefix, attr), seen, before=before, lifted=False)
            for attr, v in list(vars(mod).items()):  # or set as its attribute (`self.helper = Tally(w)`): put back
                if held.get(attr, _MISSING) is not v and _is_plain_object(v) and not callable(v):
                    inside: list = []
                    _take_fakes(v, _join(prefix, attr), inside, seen)
                    found += [f"{where} (in a {type(v).__name__} the function made: hpfun does not lift what such an "
                              "object holds; keep the tensor in a module's attribute or buffer, or return it)"
                              for where in inside]
                    if inside:
                        set_attribute(mod, attr, held[attr]) if attr in held else delattr(mod, attr)
        for root in self.state.roots:
            _take_fakes(root.value, root.name or type(root.value).__name__, found, seen)
        for var, read in self._places:
            try:
                _take_fakes(read(), var, found, seen)
            except ValueError:
                continue
        return found

    def moved_modules(self) -> tuple[dict, list[str]]:
        """After `restore`: the submodule places the step gave a module a place held before the call
        (`md["a"], md["b"] = md["b"], md["a"]`, a ModuleList rotated, `self.last = self.layers[-1]`),
        each put back as it was, so that tracing changes nothing: {root's name: ModuleMoves} to make
        by every call, as eager's calls do (the trace made the move and a cached call did not: from
        the second call on, the step ran on the other module, silently); and (place, what, fix) of
        each place given a module of another root's tree, which no call can find by name, or a new
        container of modules it held, which no call builds again, put back to be refused."""
        held = {id(sub) for before in self._submodules.values() for sub in before.values()}
        moves: dict = {}
        refused = []
        for prefix, mod, _, _, _ in self._modules:
            before = self._submodules.get(id(mod), {})
            for key, sub in list(mod._modules.items()):
                if sub is None or before.get(key) is sub or _holds_fake_state(sub):
                    continue
                if id(sub) not in held:  # a module made by the step: a new container of modules it held
                    if not any(id(m) in self._module_names for m in sub.modules() if m is not sub):
                        continue  # (`self.act = nn.GELU()`, stateless: as eager's, which makes one at every call)
                    refused.append((_join(prefix, key), f"is given a new {type(sub).__name__} built of modules "
                                    "it held (`nn.Sequential(*reversed(self.seq))`): a cached call would not build "
                                    "it again; it was put back", "build it outside the sharded function, between calls"))
                else:
                    (root, holder), (source_root, source) = self._module_names[id(mod)], self._module_names[id(sub)]
                    if source_root == root:
                        moves.setdefault(root, []).append((holder, key, source))
                    else:
                        refused.append((_join(prefix, key), "is given a module of another module tree: hpfun finds "
                                        "each module a step moves by its name in the tree the step reaches; it was "
                                        "put back", "move it outside the sharded function, between calls"))
                if key in before:
                    mod._modules[key] = before[key]
                else:
                    del mod._modules[key]
            if removed := [key for key in before if key not in mod._modules]:  # (`del self.layers[0]`, `md.pop("a")`)
                refused += [(_join(prefix, key), "is removed by the step (del, pop; a ModuleList renumbers the "
                             "entries after the one removed): a cached call would not remove it; it was put back",
                             "remove it outside the sharded function, between calls")
                            for key in removed]
                mod._modules.clear()
                mod._modules.update(before)
        return {root: ModuleMoves(tuple(m)) for root, m in moves.items()}, refused

    def put_numbers(self) -> None:
        """The numbers the traced step put in its optimizer's state (made at its first step: timm's
        Muon's `use_muon`), put there as eager's step leaves them; later calls read them as statics."""
        for real_state, p, key, v in self.new_numbers:
            if key is None:  # (under a key of the optimizer's own)
                real_state[p] = v
            else:
                real_state[p][key] = v


def _readable(slot) -> bool:
    """Whether a slot's place still exists (`del obj.t` inside the function: its getattr fails)."""
    try:
        slot.read()
    except AttributeError:
        return False
    return True


def _unwrapped(v):
    """The tensor a torch.func wrapper (grad's, functionalize's) holds, once its transform has
    ended; anything else as it is (vmap's batched tensors too; a weak proxy, which torch's C++
    would take for a tensor and crash on)."""
    while _is_tensor(v) and torch._C._functorch.is_functorch_wrapped_tensor(v) \
            and not torch._C._functorch.is_batchedtensor(v):
        v = torch._C._functorch.get_unwrapped(v)
    return v


def _scrubbed(v, depth: int = 3):
    """`v` with the wrappers in it unwrapped (`_unwrapped`): lists and dicts in place, a tuple
    (a namedtuple too) rebuilt where one changed."""
    if isinstance(v, torch.Tensor):
        return _unwrapped(v)
    if depth == 0:
        return v
    if type(v) in (list, dict):
        for key, item in list(v.items() if type(v) is dict else enumerate(v)):
            if (new := _scrubbed(item, depth - 1)) is not item:
                v[key] = new
    elif isinstance(v, tuple):
        items = [_scrubbed(item, depth - 1) for item in v]
        if any(a is not b for a, b in zip(items, v, strict=True)):
            return tuple(items) if type(v) is tuple else type(v)(*items)
    elif _is_plain_object(v) and not callable(v):
        for key, item in list(vars(v).items()):
            if (new := _scrubbed(item, depth - 1)) is not item:
                setattr(v, key, new)
    return v


def _reset_flat_weights(rnn: torch.nn.RNNBase) -> None:
    """Take the trace's stand-ins out of an RNN's list of its weights. A parametrized weight
    (weight_norm, orthogonal) is not computed here (this runs inside the trace, and computing it
    would read the real tensors there): its entry is emptied and its reference kept, which no
    longer names the weight, so the next forward computes it, as eager's does."""
    from torch.nn.utils import parametrize
    if not parametrize.is_parametrized(rnn):
        rnn._init_flat_weights()
        return
    for i, name in enumerate(rnn._flat_weights_names):
        if not parametrize.is_parametrized(rnn, name):
            w = getattr(rnn, name, None)
            rnn._flat_weights[i] = w
            rnn._flat_weight_refs[i] = weakref.ref(w) if w is not None else None
        else:
            rnn._flat_weights[i] = None


def _holds_tensor(v) -> bool:
    return any(isinstance(leaf, torch.Tensor) and type(leaf) not in WEAK_PROXIES
               for leaf in torch.utils._pytree.tree_leaves(v))


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _holds_fake_state(module) -> bool:
    return isinstance(module, torch.nn.Module) and any(
        _is_fake(t) for m in module.modules() for t in (*m._parameters.values(), *m._buffers.values()))


def _holds_made_module(v, depth: int = 3) -> bool:
    """Whether `v` is a module made inside the function (`_holds_fake_state`) or holds one in a
    tuple, list or dict (nested to `depth`)."""
    if _holds_fake_state(v):
        return True
    if depth and type(v) in (tuple, list, dict):
        return any(_holds_made_module(w, depth - 1) for w in (v.values() if type(v) is dict else v))
    return False


def _rebind(read, value) -> None:
    """Put `value` back where `read` (a closure cell's or a module global's reader) reads."""
    target = getattr(read, "func", None)
    if isinstance(read, functools.partial) and target is getattr and read.args[1:] == ("cell_contents",):
        read.args[0].cell_contents = value
    elif isinstance(read, functools.partial) and target is getattr and len(read.args) == 2:
        set_attribute(*read.args, value)  # (a plain object's attribute)
    elif isinstance(read, functools.partial) and getattr(target, "__name__", "") == "get" \
            and isinstance(getattr(target, "__self__", None), dict):
        target.__self__[read.args[0]] = value


def _made_attribute(obj, attr: str, v, held: dict) -> bool:
    """Whether the trace gave a plain object a tensor (or a tuple, list or dict of them) where it
    held none: state the step makes (a GradScaler's lazily made `_scale` is refused, with its fix)."""
    return held.get(attr) is None and (_is_fake(v) or isinstance(v, (tuple, list, dict)) and
                                       _holds_fake(v)) and not (attr.startswith("_") and is_grad_scaler(obj))


def _own_attributes(obj) -> dict:
    """An object's attributes, an optimizer's without its state, groups and defaults (which
    hpfun lifts and keys as such)."""
    if isinstance(obj, torch.optim.Optimizer):
        return {k: v for k, v in vars(obj).items() if k not in ("state", "param_groups", "defaults")}
    return attributes(obj)


def _is_dict(c) -> bool:
    """A dict, or an OrderedDict or defaultdict (a hand-written optimizer's `defaultdict(dict)`
    state): what hpfun watches for the tensors and keys a step puts there."""
    return type(c) in (dict, collections.OrderedDict, collections.defaultdict)


def _take_fakes(v, path: str, found: list, seen: set, depth: int = 0) -> None:
    """Find and take out every tensor of the trace inside `v` (modules, optimizers, containers
    and plain objects, a few levels deep), naming each place in `found`."""
    if depth > 6 or id(v) in seen or len(seen) > 50_000 or _is_scalar(v) or \
            isinstance(v, (type, types.ModuleType, types.FunctionType, types.MethodType, str, bytes)):
        return
    seen.add(id(v))
    if isinstance(v, torch.Tensor):
        if _is_fake(v.grad):
            found.append(f"{path}.grad")
            v.grad = None
        return
    if isinstance(v, torch.nn.Module):
        for store_name in ("_parameters", "_buffers"):
            store = getattr(v, store_name)
            for key in [k for k, t in store.items() if _is_fake(t)]:
                found.append(_join(path, key) + (" (a parameter the function registered: register it before the "
                                                 "first call, in __init__ or by one eager call, and hpfun lifts it)"
                                                 if store_name == "_parameters" else ""))
                del store[key]
            for key, t in store.items():
                _take_fakes(t, _join(path, key), found, seen, depth + 1)
        for key, sub in v._modules.items():
            _take_fakes(sub, _join(path, key), found, seen, depth + 1)
        items = {k: w for k, w in vars(v).items() if not k.startswith("__") and k not in _MODULE_INTERNALS}
        _take_from(v, items, path, found, seen, depth, attributes=True)
        return
    if isinstance(v, torch.optim.Optimizer):
        for g, group in enumerate(v.param_groups):
            _take_from(group, group, f"{path}.param_groups.{g}", found, seen, depth, attributes=False)
        for p, entries in list(v.state.items()):
            if _is_fake(p):
                found.append(f"{path}.state (of a parameter made inside the function)")
                del v.state[p]
            elif isinstance(entries, dict):
                _take_from(entries, entries, f"{path}.state", found, seen, depth, attributes=False)
        return
    if isinstance(v, (list, dict, tuple)):  # (an OrderedDict or defaultdict too)
        _take_from(v, dict(v) if isinstance(v, dict) else dict(enumerate(v)), path, found, seen, depth,
                   attributes=False)
        if own := _own_dict(v):  # a dict or list subclass's attributes (`self.cfg.last = t` on a config dict)
            _take_from(v, {k: w for k, w in own.items() if not k.startswith("__")}, path, found, seen, depth,
                       attributes=True)
    elif _is_config_object(v) and not callable(v):  # (slotted too)
        _take_from(v, attributes(v), path, found, seen, depth, attributes=True)


def _take_from(owner, items: dict, path: str, found: list, seen: set, depth: int, attributes: bool) -> None:
    def at(key):
        return f"{path}.{key}" if attributes else f"{path}[{key!r}]" if isinstance(owner, dict) else f"{path}[{key}]"

    fakes = [k for k, w in items.items() if _is_fake(w)]
    found += [at(key) for key in fakes]
    if fakes and isinstance(owner, dict) and type(owner) is not dict:
        found[-1] += (f" (an attribute of a {type(owner).__name__}, a dict subclass: set it before the first call, "
                      "and hpfun lifts it)" if attributes else f" (held in a dict of type {type(owner).__name__}: "
                      "hpfun takes the state a step makes from plain dicts; hold a dict there)")
    if fakes and attributes:
        for key in fakes:
            del_attribute(owner, key)
    elif fakes and type(owner) is list:
        owner[:] = [w for w in owner if not _is_fake(w)]
    elif fakes and isinstance(owner, dict):
        for key in fakes:
            del owner[key]
    for key, w in items.items():
        if not _is_fake(w):
            _take_fakes(w, at(key), found, seen, depth + 1)


def _items_of(v) -> list:
    """A list's, tuple's or dict's items (a dict's values); none for anything else."""
    return list(v.values()) if type(v) is dict else list(v) if type(v) in (list, tuple) else []


def _made_helpers(container, name: str, seen: set, depth: int = 3, before: frozenset | set = frozenset(),
                  lifted: bool = True) -> list:
    """The tensors of the trace inside plain objects a step put in `container` (a list or dict an
    object held: `self.tallies.append(Tally())`, or one level deeper, `[Tally()]`), each taken out
    with the object; a place each, named with the fix. An object whose id is in `before` was
    there before the trace: its tensors are taken out, the object stays. `lifted`: whether such
    an object made before the first call would have its tensors lifted (a plain object's list's
    are; a module's dict's are not)."""
    found: list = []
    for key, item in list(container.items() if type(container) is dict else enumerate(container))[::-1]:
        if depth > 1 and type(item) in (list, dict, tuple) and _holds_plain_object(item):
            inner = _made_helpers(item, f"{name}[{key!r}]", seen, depth - 1, before, lifted) if type(item) is not tuple else \
                [f"{name}[{key!r}] (a tuple holding an object the function made with tensors)"] if any(
                    _holds_fake(vars(w)) for w in item if _is_plain_object(w)) else []
            if inner:
                found += inner
                if type(container) is not tuple and id(item) not in before:
                    del container[key]
            continue
        if not _is_plain_object(item) or callable(item):
            continue
        inside: list = []  # (a helper made and added by the step: `self.tallies.append(Tally())`)
        _take_fakes(item, f"{name}[{key!r}]", inside, seen)
        if id(item) in before or not lifted:  # (one held before: its new tensors taken out, it stays where it was)
            found += [f"{where} (in a {type(item).__name__} a list or dict holds: hpfun does not lift what such "
                      "an object holds; keep the tensor in a module's attribute, a dict the function closes over, "
                      "or return it)" for where in inside]
            if id(item) in before:
                continue
        found += [f"{where} (in a {type(item).__name__} the function made: make it before the first call, in "
                  "__init__, and hpfun lifts its tensors as state)" for where in inside if lifted]
        if inside and type(container) is not tuple:
            del container[key]
    return found


def _holds_plain_object(container) -> bool:
    items = container.values() if type(container) is dict else container
    return any(_is_plain_object(w) and not callable(w) or type(w) in (list, dict, tuple) for w in items)


def _is_tensor(v) -> bool:
    """A tensor; not a weak proxy to one (`WEAK_PROXIES`)."""
    return isinstance(v, torch.Tensor) and type(v) not in WEAK_PROXIES


def _is_fake(v) -> bool:
    """A tensor of the trace (a stand-in, or one the trace made); not a weak proxy to one."""
    return isinstance(v, FakeTensor) and type(v) not in WEAK_PROXIES


def _holds_fake(v) -> bool:
    return _is_fake(v) or isinstance(v, (tuple, list, dict)) and \
        any(_is_fake(leaf) for leaf in torch.utils._pytree.tree_leaves(v))


def holds_trace_tensors(v, depth: int = 4) -> bool:
    """Whether `v` holds a tensor of the trace: itself, in its containers, or in the attributes
    of a plain object (a helper a forward makes lazily, `self.cache = Cache(self.w.detach())`),
    `depth` levels deep."""
    if _holds_fake(v):
        return True
    if depth <= 0 or isinstance(v, (torch.Tensor, torch.nn.Module, type, types.ModuleType, str, bytes)) or _is_scalar(v):
        return False
    if isinstance(v, (tuple, list, dict)):  # (a subclass's too: `class Record(dict)`)
        items = list(v.values()) if isinstance(v, dict) else list(v)
        return any(holds_trace_tensors(w, depth - 1) for w in items if not isinstance(w, (str, bytes)))
    return _is_config_object(v) and not callable(v) and \
        any(holds_trace_tensors(w, depth - 1) for w in attributes(v).values())


def _other_keys(old: dict, new: dict, var: str):
    """(where, "dict", what) for the first dict of `new` (itself, or one nested in it holding the
    trace's tensors) whose keys are not those of the dict at its place in `old`; None if none."""
    if new.keys() != old.keys():
        return var, "dict", f"other keys ({list(old)} before, {list(new)} now)"
    for key, v in new.items():
        held = old[key]
        if type(v) is dict and type(held) is dict and v is not held and _holds_fake(v):
            if (other := _other_keys(held, v, f"{var}[{key!r}]")) is not None:
                return other
    return None


def _merge(old: dict, new: dict) -> None:
    """`new`'s values put in `old`, a dict in both with the same keys merged in its turn (the
    places a rebound dict's slots write are the old dicts, nested ones too)."""
    for key, v in new.items():
        held = old.get(key)
        if type(v) is dict and type(held) is dict and v is not held and v.keys() == held.keys():
            _merge(held, v)
        else:
            old[key] = v


def _key_at(d: dict, i: int):
    """The `i`th key of `d` (None once it has fewer)."""
    return next(itertools.islice(iter(d), i, None), None)


def _drop_made_modules(container, path: str, found: list, depth: int = 3) -> None:
    """Take out of `container` (a dict or list) and the dicts and lists inside it every module
    made inside the function (one holding the trace's stand-ins, or a tuple holding one), naming
    each place in `found`."""
    made = [k for k, w in (container.items() if type(container) is dict else enumerate(container))
            if _holds_fake_state(w) or type(w) is tuple and _holds_made_module(w)]
    found += [f"{path}[{k!r}] (a module made inside the function)" for k in made]
    if type(container) is dict:
        for k in made:
            del container[k]
    elif made:
        container[:] = [w for i, w in enumerate(container) if i not in made]
    if depth == 0:
        return
    for key, v in list(container.items() if type(container) is dict else enumerate(container)):
        if type(v) in (dict, list):
            _drop_made_modules(v, f"{path}[{key!r}]", found, depth - 1)


def _part_of(read, j: int):
    """Part `j` of the tuple (or frozenset, in its order) `read()` gives (None if it is none that long)."""
    held = read()
    if isinstance(held, frozenset):
        held = tuple(held)
    return held[j] if isinstance(held, tuple) and len(held) > j else None


def _key_objects(key, read, suffix: str = "", depth: int = 3) -> list:
    """(name suffix, object, reader) of each object of the user's in a dict key: the key itself, or
    a part of a tuple or frozenset key, nested to `depth` (`((k,), 0)`)."""
    if _is_user_object(key) and not callable(key):
        return [(suffix, key, read)]
    if not depth or not isinstance(key, (tuple, frozenset)):
        return []
    return [found for j, part in enumerate(key)
            for found in _key_objects(part, functools.partial(_part_of, read, j), f"{suffix}.{j}", depth - 1)]


def _same(value):
    return value


def _created_items(name: str, v, place: tuple) -> dict:
    """A value the step put at `place` (appended to a list, under a new key): a tensor, or a
    tuple, list or dict holding tensors (`acts.append((name, out.detach()))`), whose tensors are
    each written back (`put`), the rest as the trace made it."""
    if _is_fake(v):
        return {name: (v, place)}
    if not _holds_fake(v):
        return {}
    whole = _Assembly(v)
    return {f"{name}{torch.utils._pytree.keystr(path)}": (leaf, ("part", place, whole, j))
            for j, (path, leaf) in enumerate(torch.utils._pytree.tree_flatten_with_path(v)[0])
            if _is_fake(leaf)}


class _Assembly:
    """A tuple, list or dict of tensors the step puts somewhere whole: each call's tensors are
    gathered here (`put`) until it is complete, then put there as one value."""

    def __init__(self, value):
        self.leaves, self.spec = torch.utils._pytree.tree_flatten(value)
        self.parts = sum(_is_fake(leaf) for leaf in self.leaves)
        self.got: dict = {}

    def add(self, j: int, value):
        """The value, once its last part is in; else None."""
        self.got[j] = value
        if len(self.got) < self.parts:
            return None
        leaves = [self.got.get(i, leaf) for i, leaf in enumerate(self.leaves)]
        self.got = {}
        return torch.utils._pytree.tree_unflatten(leaves, self.spec)


def put(state: State, place: tuple, value) -> None:
    """Write a tensor the step made at its `place` (`Substitution.created`) in this call's modules."""
    if place[0] == "part":  # one tensor of a tuple, list or dict put whole
        whole = place[2].add(place[3], value)
        if whole is not None:
            put(state, place[1], whole)
        return
    if place[0] == "append":  # a list the function (or a hook) appended to: this call's value too
        place[1]().append(value)
        return
    if place[0] == "key":
        place[1]()[place[2]] = value
        return
    if place[0] == "set":  # a plain object's dict attribute given a dict of tensors where it held none
        place[1](value)
        return
    if place[0] == "group":
        _, name, g, key = place
        state.root(name).param_groups[g][key] = value
        return
    if place[0] == "optimizer state":  # under a key of the optimizer's own
        state.root(place[1]).state[place[2]] = value
        return
    kind, fqn, attr, *key = place
    for root in state.roots:
        if isinstance(root.value, torch.nn.Module) and (not root.name or fqn == root.name
                                                        or fqn.startswith(root.name + ".")):
            try:
                mod = root.value.get_submodule(fqn[len(root.name):].lstrip("."))
            except AttributeError:
                continue
            if kind == "buffer":
                mod._buffers[attr] = value
            elif kind == "item":
                vars(mod)[attr][key[0]] = value
            else:
                setattr(mod, attr, value)
            return


def _read_substituted(slot: Slot, name: str, swap: dict, state: State):
    if name.endswith(".grad") and slot.follows is not None:
        stand_in = state.slots[slot.follows].read()  # the parameter's place holds its stand-in now
        return None if stand_in is None else stand_in.grad
    return slot.read()


class ObjectValues:
    """The public Python values (numbers, strings, flags, lists of them) held by the library
    objects the function reaches and hpfun does not walk (`State.opaque`: an LR scheduler, a
    progress bar), read before a trace. A trace that changes one (`scheduler.step()` counting
    `last_epoch`) would bake the value it computed into every call, silently: `changed` names
    them for an error, and `restore` sets them back (private ones too), so that a refused trace
    leaves no side effect. A change of a private attribute alone is not an error: it is
    bookkeeping a call may fill (a logger's `_cache` of enabled levels)."""

    def __init__(self, opaque, sets=(), groups=(), states=()):
        self.held = []  # (name, object, attribute, the value held, a copy of it)
        self.objects = []  # (name, object, its attributes, {attribute: (dict or list, a copy)})
        self.sets = [(s, list(s)) for s in sets]  # (a set the function reaches, its members)
        # (an optimizer's param groups, as they were: a counter a refused step incremented in one, timm's Adan
        # `group["step"] += 1`, is set back with them, or stepping the optimizer outside after the error counts twice)
        self.groups = [(g, dict(g)) for g in groups]
        # (and the dicts and lists of numbers they hold, edited in place: `group["stats"]["n"] += 1`)
        self.groups += [(v, copy.deepcopy(v)) for g in groups for k, v in g.items()
                        if k != "params" and type(v) in (dict, list) and _is_plain_data(v)]
        # (and those in a parameter's optimizer state, to any depth: `state[p]["meta"]["inner"]["n"] += 1`)
        self.groups += [(v, copy.deepcopy(v)) for entries in states if type(entries) is dict
                        for v in entries.values() if type(v) in (dict, list) and _is_plain_data(v)]
        for name, obj in opaque:
            if type(obj) in (dict, list):  # a container hpfun does not lift (a user object's `self.stats = {}`, LBFGS's history)
                self.objects.append((name, None, {}, {None: (obj, copy.copy(obj))}))
                continue
            d = _fields_of(obj)
            if d is None:
                continue
            for attr, v in list(d.items()):
                if _is_scalar(v) or type(v) is list and all(map(_is_scalar, v)):
                    self.held.append((name, obj, attr, v, copy.copy(v)))
            self.objects.append((name, obj, dict(d.items()), {a: (v, copy.copy(v)) for a, v in d.items()
                                                      if isinstance(v, (dict, list))}))

    def leaked(self) -> list[str]:
        """Where the trace left a tensor it made in these objects (`self.stats["step"] = t` in
        an object hpfun does not walk): the names, each set back as it was."""
        out = []
        for name, obj, attrs_before, containers in self.objects:
            d = _fields_of(obj) if obj is not None else {}
            for attr, v in list(d.items()):
                if _is_fake(v) and attrs_before.get(attr) is not v:
                    out.append(f"{name}.{attr}")
                    if attr in attrs_before:
                        d[attr] = attrs_before[attr]
                    else:
                        del d[attr]
            for attr, (container, was) in containers.items():
                inside = list(container.items()) if type(container) is dict else list(enumerate(container))
                fresh = [k for k, v in inside if _is_fake(v)]
                if fresh:
                    out += [f"{name}{'' if attr is None else '.' + attr}[{k!r}]" for k in fresh]
                    _refill(container, was)
        return out

    def changed(self) -> list[tuple[str, object, list]]:
        """(name, object, [(attribute, value before, value now)]) of each object whose values the
        trace changed."""
        out: dict = {}
        for name, obj, attr, held, was in self.held:
            if attr.startswith("_"):
                continue
            now = _fields_of(obj).get(attr, _MISSING)
            if now is not held or (type(held) is list and held != was):
                if not (_is_scalar(now) and now == was and type(now) is type(was)):
                    out.setdefault(id(obj), (name, obj, []))[2].append((attr, was, now))
        return list(out.values())

    def restore(self) -> None:
        for _, obj, attr, held, was in self.held:
            if type(held) is list:
                held[:] = was
            _fields_of(obj)[attr] = held

    def restore_containers(self) -> None:
        """Set back the contents of the plain dicts and lists the function reaches (a counter in
        a dict it incremented), for a trace that is refused."""
        for _, obj, _, containers in self.objects:
            if obj is None:
                (container, was), = containers.values()
                _refill(container, was)
        for container, was in [*self.sets, *self.groups]:
            _refill(container, was)

    def undo(self) -> None:
        """Set every object back as it was before a trace that raised: its attributes (added ones
        removed), the contents of its dicts and lists (a GradScaler's per-optimizer state), and
        the plain containers: the eager code after the error finds no stand-in in them."""
        for container, was in [*self.sets, *self.groups]:
            _refill(container, was)
        for _, obj, before, containers in self.objects:
            for container, was in containers.values():
                _refill(container, was)
            if obj is not None:
                d = _fields_of(obj)
                for attr in [a for a in list(d) if a not in before]:
                    del d[attr]
                d.update(before)
        self.restore()


def _declares_slots(cls: type) -> bool:
    """Whether `cls` or a base of it (not `object`) declares non-empty `__slots__`."""
    return any(vars(c).get("__slots__") for c in cls.__mro__[:-1])


def _fields_of(obj):
    """An object's attributes as a dict to read and write: its `__dict__`, or for one keeping
    them in `__slots__`, a view setting and deleting them on the object; None for an object with
    neither."""
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and not _slot_values(obj):
        return d
    if not isinstance(d, dict) and not _declares_slots(type(obj)):
        return None
    return _Fields(obj)


class _Fields:
    """`_fields_of` for an object with `__slots__`: its attributes, read, set and deleted on it."""

    def __init__(self, obj):
        self.obj = obj

    def items(self):
        return attributes(self.obj).items()

    def get(self, key, default=None):
        return attributes(self.obj).get(key, default)

    def __iter__(self):
        return iter(attributes(self.obj))

    def __setitem__(self, key, value):
        set_attribute(self.obj, key, value)

    def __delitem__(self, key):
        del_attribute(self.obj, key)

    def update(self, items: dict):
        for key, value in items.items():
            set_attribute(self.obj, key, value)


def _refill(container, was) -> None:
    container.clear()
    container.extend(was) if isinstance(container, list) else container.update(was)


GRAD_SCALER_FIX = ("a torch.amp.GradScaler keeps its scale in a tensor of its own, which hpfun does not lift: "
                   "scale the loss with a tensor argument instead, and step the scaler outside: "
                   "`scale = scaler.scale(torch.ones(()))` before the call, `(loss * scale).backward()` inside, "
                   "`scaler.step(opt); scaler.update()` after it (or train in bfloat16, which needs no scaler; "
                   "on a distributed mesh whose gradients are split, ZeRO or tensor parallel, the scaler outside "
                   "checks each rank's own blocks and ranks can disagree: there, train in bfloat16)")


def is_grad_scaler(obj) -> bool:
    return isinstance(obj, torch.amp.GradScaler)


def held_at(obj, levels: int = 6, seconds: float = 2.0) -> str | None:
    """Where a Python module's globals reach `obj` (`pyro.poutine.runtime._PYRO_PARAM_STORE
    ._params['loc']`), found by walking its referrers up to `levels` objects, for at most
    `seconds` (an error's path only: each level scans the heap once); None if none is found."""
    modules = {id(vars(m)): name for name, m in sorted(sys.modules.items(), key=lambda e: e[0] == "__main__")
               if isinstance(m, types.ModuleType)}  # (`__main__` over its alias `__mp_main__`)
    deadline = time.perf_counter() + seconds
    # (object, the path from it to obj, and for a dict, the key it holds the next object under: an object's
    # or class's attribute dict is named by its owner, found at the next step)
    entries, seen = [(obj, "", None)], {id(obj)}
    for _ in range(levels):
        found = []
        if time.perf_counter() > deadline:
            return None
        referrers = gc.get_referrers(*(o for o, _, _ in entries))  # (one scan of the heap for the level)
        for o, suffix, key in entries:
            if time.perf_counter() > deadline:
                return None
            for r in referrers:
                if id(r) in seen or r is entries or r is found or isinstance(r, (types.FrameType, BaseException)):
                    continue
                if key is not None and (getattr(r, "__dict__", None) is o or isinstance(r, type)
                                        and vars(r).get(key, _MISSING) is o.get(key)):
                    seen.add(id(r))  # the owner of the attribute dict o (`Dopri5.TABLEAU`: a class's, a proxy of o)
                    found.append((r, f".{key}{suffix}", None))
                    continue
                held = suffix if key is None else f"[{key!r}]{suffix}"
                if type(r) is dict:
                    k = next((k for k, v in r.items() if v is o), _MISSING)
                    if k is _MISSING:
                        continue
                    if id(r) in modules:
                        return f"{modules[id(r)]}.{k}{held}"
                    seen.add(id(r))
                    found.append((r, held, k))
                elif type(r) in (list, tuple):
                    i = next((i for i, v in enumerate(r) if v is o), None)
                    if i is None:
                        continue
                    seen.add(id(r))
                    found.append((r, f"[{i}]{held}", None))
                elif (k := next((k for k, v in attributes(r).items() if v is o), None)) is not None:
                    seen.add(id(r))  # (an object holding it as an attribute: Python 3.11 keeps an instance's
                    found.append((r, f".{k}{held}", None))  # attributes in the object, not in a dict)
        # objects and classes first: an error's frames hold the tensor in argument tuples and locals dicts too
        found.sort(key=lambda e: (type(e[0]) in (list, tuple)) + 2 * (type(e[0]) is dict))
        entries = found[:48]
        if not entries:
            return None
    return None


def unlifted_tensor_error(state: State | None, where: str, arguments: tuple = (), attributes: tuple = (),
                          tensor: torch.Tensor | None = None) -> CaptureError:
    """A real tensor reached the trace through something hpfun does not walk: say what it could
    be. `arguments`: (path, value) of the call's arguments, whose own objects' tensors are not
    flattened (only a pytree's: tuples, lists, dicts, dataclasses); `attributes`: (path, container)
    of the tensors a UserDict or UserList argument holds as attributes, beside its items;
    `tensor`: the tensor read, if known (where a module's globals hold it is said)."""
    suspects = []
    for name, obj in (state.opaque if state else ()):
        found = _tensor_attributes(obj, name, depth=3)  # (a transformers cache: its layers' keys)
        if found:
            suspects.append(f"{name} (a {type(obj).__name__}) holds tensors: {', '.join(found[:4])}")
    held = [Problem(path, "is a tensor attribute of a UserDict or UserList argument, which hpfun hands to the "
                    "function as it is: only the container's items are inputs, split by the specs"
                    + (f"; a tensor read at {where}" if where else ""),
                    ("put the tensor among its items (`batch.append(t)`)" if isinstance(container, collections.UserList)
                     else f"put the tensor among its items (`batch[{path.rsplit('.', 1)[-1]!r}] = t`)")
                    + ", or pass it as an argument of its own") for path, container in attributes]
    for path, obj in arguments:
        if isinstance(obj, (torch.Tensor, Sharded, torch.nn.Module, torch.optim.Optimizer, type, types.ModuleType)) or \
                not (found := _tensor_attributes(obj, path, depth=3)):
            continue
        cls = type(obj).__name__
        if _is_block_mask(obj):  # (its mask_mod's reads: an argument's code is not walked for state)
            fix = ("close over the BlockMask instead of passing it (hpfun then lifts the tensors its mask_mod reads, "
                   "as the function's own), or make it inside the function with create_block_mask")
        elif _is_user_object(obj):
            fix = (f"make {cls} a dataclass (its tensors are then inputs, given specs like any argument), pass the "
                   "tensors as arguments, or close over the object (hpfun lifts the tensors it holds)")
        else:  # a library's object (a transformers cache): its tensors, passed themselves, rebuild it inside
            fix = (f"pass the tensors it holds as arguments (a tuple or list of them) and build the {cls} from them "
                   "inside the function (and return its tensors, where the function returns one)")
        held.append(Problem(path, f"is an argument of a class hpfun does not flatten (a {cls}) and holds tensors: "
                            f"{', '.join(found[:4])}; only its numbers, strings and flags are read (they key the cache)"
                            + (f"; a tensor read at {where}" if where else ""), fix))
    if held:
        return CaptureError(held, headline="cannot capture the function")
    fix = ("pass the tensor as an argument, or hold it in an nn.Module (parameter, buffer or attribute), a "
           "closed-over or global tensor variable, or a dict/list of them: hpfun lifts those and reads them at every call")
    lifted = next((name for name, v in (state.values().items() if state and tensor is not None else ())
                   if v is tensor), None)
    if lifted is not None:  # (state reached by a reference of its own: `weakref.ref(lin.weight)()`)
        return CaptureError([Problem(where or "the function", f"reads {lifted}, state hpfun lifts, through a reference "
                                     "hpfun does not replace (a weakref, a table keyed by id, a reference taken before "
                                     "the call): inside the function hpfun puts a stand-in at its place, and this "
                                     "reference still gives the real tensor",
                                     f"read it at its place inside the function ({lifted}, module.parameters()), or "
                                     "pass it as an argument"), *_objects_modules_hold(state)],
                            headline="cannot capture the function")
    place = held_at(tensor) if tensor is not None else None
    if place and ("._parameters[" in place or "._buffers[" in place):  # a module's, which the walk did not reach: read
        fix = ("hpfun lifts the modules the function reaches through its closures and globals (and the code they "  # by
               "call), not through code given as an argument (a function, a config's method, a bound method): "  # code
               "close over that code instead (a global, or `functools.partial` of the function), or reach the "  # given
               "module from the function itself")  # as an argument)
    problems = [Problem(where or "the function", "reads a tensor that is neither an argument nor state hpfun can lift "
                        "(a module's parameter or buffer, an optimizer's state, a closed-over or global tensor)"
                        + (f"; it is a {tuple(tensor.shape)} tensor that {place} holds"
                           if place else ""), fix)]
    scalers = {name for name, obj in (state.opaque if state else ()) if is_grad_scaler(obj)}
    states = tuple(_join(r.name, "state") + "." for r in (state.roots if state else ()) if _is_optimizer(r.value))
    problems += [Problem(s, "is in an optimizer's state, and holds its tensors deeper than hpfun lifts: under each key "
                         "of a parameter's state, a tensor, a number, a list or tuple of tensors, or a dict of tensors "
                         "by name", "keep each tensor at one of those places (`state['ema_m']`, `state['ema'] = "
                         "{'m': m}`), or step this optimizer outside the sharded function")
                 if states and s.startswith(states) else
                 Problem(s, "is closed over or global, and is not a tensor, module, optimizer or Python scalar",
                         GRAD_SCALER_FIX if s.split(" (a ")[0] in scalers else "") for s in suspects]
    problems += _objects_modules_hold(state)
    return CaptureError(problems, headline="cannot capture the function")


def _objects_modules_hold(state: State | None) -> list[Problem]:
    """A module's attributes that are objects of another kind holding tensors (a kornia
    augmentation's `torch.distributions.Uniform(low, high)`): suspects for a tensor read that
    hpfun did not lift, named with the tensors they hold."""
    out, seen = [], set()
    for root in state.roots if state else ():
        if not isinstance(root.value, torch.nn.Module):
            continue
        for mod_name, mod in root.value.named_modules():
            for attr, v in vars(mod).items():
                if isinstance(v, (list, tuple, dict)) and not attr.startswith("__") and id(v) not in seen:
                    seen.add(id(v))  # (a container of containers of tensors: only its first level is lifted)
                    items = v.values() if isinstance(v, dict) else v
                    inner = [f"{_join(_join(root.name, mod_name), attr)}"
                             f"{f'[{k!r}]' if isinstance(v, dict) else f'[{k}]'}"
                             for k, w in (v.items() if isinstance(v, dict) else enumerate(v))
                             if isinstance(w, (list, tuple, dict)) and _tensor_attributes(w, "", depth=2)]
                    objects = [f"{_join(_join(root.name, mod_name), attr)}{f'[{k!r}]' if isinstance(v, dict) else f'[{k}]'}"
                               for k, w in (v.items() if isinstance(v, dict) else enumerate(v))
                               if not isinstance(w, (torch.Tensor, torch.nn.Module, list, tuple, dict, str, type))
                               and not _is_scalar(w) and _tensor_attributes(w, "", depth=2)]
                    if objects:  # (a dict of distributions: pyro's priors, `{"w": Normal(loc, scale)}`)
                        name = _join(_join(root.name, mod_name), attr)
                        out.append(Problem(f"{name} (a {type(v).__name__} of objects)", f"holds tensors inside "
                                           f"{', '.join(objects[:3])}, which hpfun does not lift: it lifts a module's "
                                           "parameters, buffers and tensor attributes (and dicts, lists and tuples of "
                                           "them), not tensors inside other objects", "hold the tensors on the module "
                                           "(`self.register_buffer('prior_loc', ...)`) and build the object from them "
                                           "where it is used, or pass them as arguments"))
                    if inner and items:
                        name = _join(_join(root.name, mod_name), attr)
                        out.append(Problem(f"{name} (a {type(v).__name__} of containers)", f"holds tensors inside "
                                           f"{', '.join(inner[:3])}, which hpfun does not lift: it lifts the tensors of "
                                           "a module's list, tuple or dict one level deep, not inside a container in it",
                                           "hold them one level deep (a flat list, or a dict of tensors keyed by "
                                           "name: `self.k = {'0.0': t, ...}`), or register them as buffers"))
                    continue
                if type(v) in (collections.deque, set, frozenset) and id(v) not in seen and \
                        any(_unregistered_module(None)(m) for m in list(v)[:PLAIN_CONTAINER_ITEMS]):
                    seen.add(id(v))  # (modules in a container hpfun does not walk: their parameters are not lifted)
                    name = _join(_join(root.name, mod_name), attr)
                    out.append(Problem(f"{name} (a {type(v).__name__})", f"holds modules in a {type(v).__name__}, "
                                       "which hpfun does not lift: it lifts modules registered as submodules, and "
                                       "those a module holds in a list, tuple, dict, namedtuple or dataclass",
                                       "hold them in an nn.ModuleList (or a list or dict)"))
                    continue
                if attr.startswith("__") or attr in _MODULE_INTERNALS or id(v) in seen or _is_scalar(v) or \
                        isinstance(v, (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType,
                                       types.MethodType, functools.partial, list, tuple, dict, set, str)):
                    continue
                seen.add(id(v))
                name = _join(_join(root.name, mod_name), attr)
                if found := _tensor_attributes(v, name, depth=2):
                    out.append(Problem(f"{name} (a {type(v).__name__})", f"holds tensors ({', '.join(found[:4])}), which "
                                       "hpfun does not lift: it lifts a module's parameters, buffers and tensor "
                                       "attributes (and dicts, lists and tuples of them), not tensors inside other "
                                       "objects", "hold the tensors on the module (`self.register_buffer('low', "
                                       "...)`) and build the object from them where it is used, or pass them as "
                                       "arguments"))
    return out


def _tensor_attributes(obj, name: str, depth: int = 2) -> list[str]:
    if type(obj) in (list, tuple, dict, collections.deque):  # (a deque: a queue of recent values)
        items = list(obj.items() if type(obj) is dict else enumerate(obj))
        found = [f"{name}[{k!r}]" for k, v in items if isinstance(v, torch.Tensor)][:1]
        if not found and depth > 1 and items:  # a list of objects holding tensors (a cache's layers): the first
            found = _tensor_attributes(items[0][1], f"{name}[{items[0][0]!r}]", depth - 1)
        return found
    try:
        items = vars(obj).items()
    except TypeError:
        return []
    out = []
    for k, v in items:
        if isinstance(v, torch.Tensor):
            out.append(f"{name}.{k}")
        elif depth > 1 and not isinstance(v, (type, types.ModuleType, types.FunctionType)):
            out += _tensor_attributes(v, f"{name}.{k}", depth - 1)
    return out


def fakes_inside(value, name: str, skip: int = 0, limit: int = 4096) -> list[str]:
    """The places inside `value` (through dicts, lists, tuples and objects' attributes, not
    modules or optimizers, which hpfun lifts) that hold a tensor of the trace: what the function
    stored in an object hpfun does not write back. `skip`: levels not to report (already checked
    and set back by `ObjectValues.leaked`)."""
    out, seen, stack = [], set(), [(value, name, 0)]
    while stack and len(seen) < limit:
        v, path, depth = stack.pop()
        if _is_fake(v):
            if depth > skip:
                out.append(path)
            continue
        if isinstance(v, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, type, types.ModuleType,
                          types.FunctionType)) or _is_scalar(v) or id(v) in seen or depth > 6:
            continue
        seen.add(id(v))
        if type(v) is dict:
            items = [(f"{path}[{k!r}]", w) for k, w in v.items()]
        elif type(v) in (list, tuple):
            items = [(f"{path}[{i}]", w) for i, w in enumerate(v)]
        elif (hasattr(v, "__dict__") or _slot_values(v)) and not callable(v):
            items = [(f"{path}.{k}", w) for k, w in attributes(v).items()]
        else:
            continue
        stack += [(w, p, depth + 1) for p, w in items]
    return sorted(out)
