"""The device mesh: a value (shape and axis names). Process groups live in the runtime."""

from __future__ import annotations

import math

import attrs

from hpfun.errors import LayoutError
from hpfun.runtime import groups

RUNTIMES = ("simulated", "distributed")


def _as_shape(value) -> tuple[int, ...]:
    if isinstance(value, int):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise LayoutError(f"a mesh shape is a tuple of integers, got {value!r}", headline="invalid mesh")
    return tuple(value)


def _as_names(value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise LayoutError(f"mesh axis names are a tuple of strings, got {value!r}", headline="invalid mesh")
    return tuple(value)


@attrs.frozen(cache_hash=True)
class Mesh:
    """An N-D grid of ranks with named axes.

    >>> mesh = Mesh.simulated((2, 2), ("dp", "tp"))
    >>> str(mesh), mesh.size, mesh.coords(3)
    ('{dp: 2, tp: 2}', 4, (1, 1))
    """

    shape: tuple[int, ...] = attrs.field(converter=_as_shape)
    axis_names: tuple[str, ...] = attrs.field(converter=_as_names)
    runtime: str = attrs.field(default="simulated", kw_only=True)

    def __attrs_post_init__(self):
        problems = []
        if not self.shape:
            problems.append("a mesh needs at least one axis")
        if len(self.shape) != len(self.axis_names):
            problems.append(f"shape {self.shape} has {len(self.shape)} axes but {len(self.axis_names)} names were given")
        if any(s < 1 for s in self.shape):
            problems.append(f"every axis size must be >= 1, got {self.shape}")
        if len(set(self.axis_names)) != len(self.axis_names):
            problems.append(f"axis names must be distinct, got {self.axis_names}")
        bad = [n for n in self.axis_names if not (isinstance(n, str) and n.isidentifier())]
        if bad:
            problems.append(f"axis names must be identifiers, got {bad}")
        if self.runtime not in RUNTIMES:
            problems.append(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if problems:
            raise LayoutError(problems, headline="invalid mesh")

    @classmethod
    def simulated(cls, shape, axis_names) -> "Mesh":
        """A mesh whose ranks all run inside this process (notebooks, tests)."""
        return cls(shape, axis_names, runtime="simulated")

    @classmethod
    def distributed(cls, shape, axis_names, *, timeout: float | None = None) -> "Mesh":
        """A mesh over the ranks of a `torch.distributed` job (launched by torchrun).

        Starts the default process group if needed (gloo on CPU, NCCL when CUDA is available)
        and builds a `DeviceMesh`; collectives time out after `timeout` seconds (default
        `HPFUN_TIMEOUT` or 300), so a failed or dead rank makes the others fail, not hang.
        """
        mesh = cls(shape, axis_names, runtime="distributed")
        groups.start(mesh, timeout=timeout)
        return mesh

    @classmethod
    def from_device_mesh(cls, device_mesh, *, timeout: float | None = None) -> "Mesh":
        """Adopt an existing `torch.distributed.DeviceMesh` (its axis names and ranks). Without
        `timeout`, hpfun's collectives run on its groups, with their timeouts (torch's default
        is 30 minutes); with it, on groups of the same ranks that time out after `timeout` seconds."""
        if not hasattr(device_mesh, "mesh_dim_names"):
            raise LayoutError(f"Mesh.from_device_mesh adopts a torch.distributed.DeviceMesh (init_device_mesh), got "
                              f"{type(device_mesh).__name__}" + (": it is a mesh already" if isinstance(device_mesh, Mesh) else ""),
                              headline="not a DeviceMesh")
        names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
        mesh = cls(tuple(device_mesh.mesh.shape), names, runtime="distributed")
        groups.adopt(mesh, device_mesh, timeout)
        return mesh

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_index(self, axis: str | int) -> int:
        """The position of a mesh axis given by name or index."""
        if isinstance(axis, int) and 0 <= axis < self.ndim:
            return axis
        if axis in self.axis_names:
            return self.axis_names.index(axis)
        raise LayoutError(f"mesh {self} has no axis {axis!r}; its axes are {list(self.axis_names)}")

    def axis_size(self, axis: str | int) -> int:
        return self.shape[self.axis_index(axis)]

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates of a rank (row-major, the last axis varies fastest)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.size:
            raise LayoutError(f"mesh {self} has ranks 0 to {self.size - 1}, not {rank!r}", headline="bad rank")
        out = []
        for size in reversed(self.shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def rank(self, coords) -> int:
        """The rank at mesh coordinates `coords` (one per axis, each within its axis)."""
        coords = tuple(coords)
        if len(coords) != len(self.shape) or not all(isinstance(c, int) and 0 <= c < n
                                                     for c, n in zip(coords, self.shape)):
            raise LayoutError(f"mesh {self} has coordinates of {len(self.shape)} entries, each within its axis "
                              f"{tuple(self.shape)}, not {coords!r}", headline="bad mesh coordinates")
        r = 0
        for c, size in zip(coords, self.shape, strict=True):
            r = r * size + c
        return r

    def groups(self, axes) -> list[list[int]]:
        """The rank groups that communicate over some axes (a name, index, tuple of them, or a
        comma-separated string), each group in rank order."""
        if isinstance(axes, str):
            axes = axes.split(",")
        elif isinstance(axes, int):
            axes = (axes,)
        chosen = {self.axis_index(a) for a in axes}
        groups: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            groups.setdefault(tuple(x for i, x in enumerate(c) if i not in chosen), []).append(r)
        return list(groups.values())

    def __str__(self) -> str:
        return "{" + ", ".join(f"{n}: {s}" for n, s in zip(self.axis_names, self.shape, strict=True)) + "}"
