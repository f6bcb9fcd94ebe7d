"""fallback="replicate": ops without a rule run on gathered inputs, with a warning naming their cost."""

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.propagate import FallbackWarning

MESH = hpfun.Mesh.simulated((2,), ("dp",))


def uses_unruled_ops(x):
    return torch.special.airy_ai(x) + torch.special.spherical_bessel_j0(x * 2)


def test_without_fallback_every_missing_op_is_reported():
    """The default: one error listing every op that lacks a rule."""
    with pytest.raises(hpfun.MissingRuleError) as info:
        hpfun.shard(uses_unruled_ops, mesh=MESH, in_specs=P("dp"))(torch.randn(8, 4))
    assert len(info.value.problems) == 2


def test_fallback_runs_replicated_with_a_warning_naming_ops_and_bytes():
    """Each op without a rule runs on gathered inputs; the warning lists them with their cost."""
    x = torch.randn(8, 4)
    f = hpfun.shard(uses_unruled_ops, mesh=MESH, in_specs=P("dp"), fallback="replicate")
    with pytest.warns(FallbackWarning) as record:
        out = f(x)
    text = str(record[0].message)
    assert "aten.special_airy_ai.default: gathers 64 B per rank" in text
    assert "aten.special_spherical_bessel_j0.default" in text and "test_fallback.py" in text
    torch.testing.assert_close(out.full(), uses_unruled_ops(x))
    # x is gathered once: x * 2 runs on it whole rather than be gathered again for spherical_bessel_j0
    assert [c.kind for c in f.lower(x).collectives] == ["all_gather"]


def test_fallback_option_is_checked():
    with pytest.raises(hpfun.SpecError, match="fallback"):
        hpfun.shard(uses_unruled_ops, mesh=MESH, in_specs=P("dp"), fallback="gather")
