"""hpfun on one CUDA GPU: what the CPU suite cannot check, checked against the unsharded run.

    python benchmarks/gpu.py [--device cuda] [--only NAME ...] [--json PATH]

Every check runs hpfun's per-shard programs on a simulated mesh whose shards all live on the
one GPU, and compares them with the same function run unsharded on that GPU:

- attention: CUDA's fused kernels (flash, memory-efficient, cuDNN), forward and backward,
  split on batch or heads, against the unsharded kernels; and `F.scaled_dot_product_attention`
  in float32 and bfloat16 inside a causal block: which kernel capture keeps, and that no rank's
  program makes a T x T tensor;
- rng: dropout drawn under three layouts (replicated, split rows, split columns), above and
  below the size where draws go through `torch.compile` (Triton on a GPU): bitwise equal to
  each other and to the CPU's draws;
- gpt: the reference GPT AdamW step, Megatron tensor parallel on a 2x2 dp x tp mesh, two steps,
  in float32 and float64;
- llama: a Hugging Face `LlamaForCausalLM` (sdpa attention) trained two steps under hpfun's
  tensor-parallel plan, against the same model trained eagerly (float32: AdamW divides by the
  root of the second moment, so float32 rounding in near-zero gradients shows at about 1e-4
  of a parameter's scale; the losses agree to 1e-5);
- memory: the lowered report's per-rank peak against `torch.cuda.max_memory_allocated` while
  one rank's program runs (`hpfun.memory.measure`), for the MLP, the GPT and the Llama step.

Runs with `--device cpu` as well (the same checks on the CPU), which is how the script itself
is tested where no GPU is lent. Prints one line per check, then a summary; `--json` writes
every figure.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import hpfun
from hpfun import P, memory
from hpfun.testing import models as m

aten = torch.ops.aten
DEVICE = torch.device("cuda")
RESULTS: dict = {}


def _to(tree, device=None, dtype=None):
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(device or DEVICE, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
    return tree_map(move, tree)


def _full(tree):
    return tree_map(lambda v: v.full() if isinstance(v, hpfun.Sharded) else v, tree,
                    is_leaf=lambda v: isinstance(v, hpfun.Sharded))


def _maxdiff(a, b) -> float:
    """Largest |a - b| over matching leaves, relative to the largest |b| (0.0: bitwise equal)."""
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    worst = 0.0
    for x, y in zip(la, lb):
        if not isinstance(x, torch.Tensor):
            continue
        x, y = x.detach().double().cpu(), y.detach().double().cpu()
        scale = max(y.abs().max().item(), 1e-30) if y.numel() else 1.0
        worst = max(worst, ((x - y).abs().max().item() / scale) if y.numel() else 0.0)
    return worst


def check(name):
    def wrap(fn):
        def run():
            start = time.perf_counter()
            try:
                figures = fn()
                status = "ok" if figures.pop("pass", True) else "FAIL"
            except Exception as e:  # a check that breaks is reported, and the others still run
                figures = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
                status = "ERROR"
            figures["seconds"] = round(time.perf_counter() - start, 2)
            RESULTS[name] = {"status": status, **figures}
            shown = {k: v for k, v in figures.items() if k != "trace"}
            print(f"[{status}] {name}: {json.dumps(shown, default=str)}", flush=True)
            if status == "ERROR":
                print(figures["trace"], flush=True)
        run.__name__ = name
        return run
    return wrap


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def _kernel_grads(kernel):
    def loss(q, k, v):
        if kernel == "flash":
            out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        elif kernel == "efficient":
            out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0]
        else:
            out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[0]
        return out.float().pow(2).sum()
    return lambda q, k, v: torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)


def attention_kernels():
    figures, ok = {}, True
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    g = torch.Generator().manual_seed(0)
    cases = [("flash", torch.bfloat16), ("efficient", torch.float32), ("efficient", torch.bfloat16),
             ("cudnn", torch.bfloat16)]
    for kernel, dtype in cases:
        q, k, v = (_to(torch.randn(2, 4, 128, 64, generator=g), dtype=dtype) for _ in range(3))
        fn = _kernel_grads(kernel)
        try:
            expected = fn(q, k, v)
        except Exception as e:  # this GPU or build lacks the kernel: say so, not a failure of hpfun
            figures[f"{kernel}_{dtype}"] = f"unsharded kernel unavailable: {type(e).__name__}"
            continue
        floor = _maxdiff(fn(q, k, v), expected)  # the kernel against itself (backward may use atomics)
        tol = max(floor, 1e-5 if dtype == torch.float32 else 1e-2)
        for split, spec in (("heads", P(None, "tp")), ("batch", P("tp"))):
            f = hpfun.shard(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3)
            lowered = f.lower(q, k, v)
            kept = sum(1 for n in lowered.program.module.graph.nodes if "attention" in str(n.target))
            diff = _maxdiff(_full(f(q, k, v)), expected)
            good = not lowered.collectives and kept == 2 and diff <= tol
            ok &= good
            figures[f"{kernel}_{str(dtype)[6:]}_{split}"] = {"max_rel_diff": diff, "unsharded_vs_itself": floor,
                                                             "kernels_kept": kept,
                                                             "collectives": len(lowered.collectives)}
    figures["pass"] = ok
    return figures


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes.update(tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _block_grads(params, x):
    def loss(params, x):
        b, t, d = x.shape
        q, k, v = (torch.matmul(x, params[w]).view(b, t, 4, d // 4).transpose(1, 2) for w in ("wq", "wk", "wv"))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return (out @ params["wo"]).float().pow(2).mean()
    return torch.func.grad(loss)(params, x)


def attention_sdpa():
    """F.scaled_dot_product_attention in a causal block: the kernel kept, no T x T tensor."""
    figures, ok = {}, True
    T, D = 96, 256  # T differs from every other size, so a trailing (T, T) can only be scores
    g = torch.Generator().manual_seed(1)
    mesh = hpfun.Mesh.simulated((2,), ("m",))
    for dtype in (torch.float32, torch.bfloat16):
        params = _to({w: torch.randn(D, D, generator=g) / 16 for w in ("wq", "wk", "wv", "wo")}, dtype=dtype)
        x = _to(torch.randn(4, T, D, generator=g), dtype=dtype)
        expected = _block_grads(params, x)
        for split in ("heads", "batch"):
            col, row = (P(None, "m"), P("m", None)) if split == "heads" else (P(), P())
            specs = ({"wq": col, "wk": col, "wv": col, "wo": row}, P("m") if split == "batch" else P())
            f = hpfun.shard(_block_grads, mesh=mesh, in_specs=specs, out_specs=specs[0])
            f(params, x)
            with _Shapes() as seen:
                got = _full(f(params, x))
            squares = sorted(s for s in seen.shapes if s[-2:] == (T, T))
            nodes = f.lower(params, x).program.module.graph.nodes
            kernels = sorted({str(n.target).split(".")[1] for n in nodes if "attention" in str(n.target)})
            diff = _maxdiff(got, expected)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            good = not squares and bool(kernels) and diff <= tol
            ok &= good
            figures[f"{str(dtype)[6:]}_{split}"] = {"kernels": kernels, "TxT_shapes": squares[:3],
                                                    "max_rel_diff": diff}
    figures["pass"] = ok
    return figures


# ---------------------------------------------------------------------------------------------
# Random numbers
# ---------------------------------------------------------------------------------------------


def rng_layouts():
    figures, ok = {}, True
    mesh = hpfun.Mesh.simulated((2, 2), ("a", "b"))

    def draw(x):
        return F.dropout(x, 0.4, training=True), torch.randn_like(x)

    for rows, cols in ((64, 96), (1024, 1024)):  # 6,144 elements drawn eagerly; 2^20 through torch.compile
        outs = {}
        for name, spec in (("replicated", P()), ("rows", P("a")), ("cols", P(None, ("a", "b")))):
            f = hpfun.shard(draw, mesh=mesh, in_specs=(spec,), out_specs=(spec, spec))
            for where in ("device", "cpu"):
                x = torch.ones(rows, cols, device=DEVICE if where == "device" else "cpu")
                with hpfun.random_seed(1234):
                    outs[name, where] = _full(f(x))
        ref = outs["replicated", "cpu"]
        diffs = {f"{n}_{w}": _maxdiff(v, ref) for (n, w), v in outs.items()}
        kept = outs["replicated", "device"][0].ne(0).float().mean().item()
        good = all(d == 0.0 for d in diffs.values()) and abs(kept - 0.6) < 0.05
        ok &= good
        figures[f"{rows}x{cols}"] = {"max_rel_diff_vs_cpu_replicated": max(diffs.values()), "kept_fraction": kept}
    figures["pass"] = ok
    return figures


# ---------------------------------------------------------------------------------------------
# Training steps against the unsharded run
# ---------------------------------------------------------------------------------------------


def gpt_step():
    figures, ok = {}, True
    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-12)):
        params = _to(m.gpt_init(), dtype=dtype)
        state = _to(m.adamw_init(m.gpt_init()), dtype=dtype)
        idx, tgt = _to(m.gpt_data())
        specs = m.gpt_specs(params, tp="tp")
        state_specs = {"m": specs, "v": specs, "step": P()}
        f = hpfun.shard(m.gpt_step, mesh=mesh, in_specs=(specs, state_specs, P("dp"), P("dp")),
                        out_specs=(specs, state_specs, P()))
        p1, s1, p2, s2 = params, state, params, state
        for _ in range(2):
            p1, s1, loss1 = _full(f(p1, s1, idx, tgt))
            p2, s2, loss2 = m.gpt_step(p2, s2, idx, tgt)
        diff = _maxdiff((p1, loss1), (p2, loss2))
        ok &= diff <= tol
        figures[str(dtype)[6:]] = {"max_rel_diff_params_loss": diff, "loss": float(loss2)}
    figures["pass"] = ok
    return figures


LLAMA = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _llama_pair():
    import transformers

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, attn_implementation="sdpa"))
    return model, copy.deepcopy(model)


def llama_step():
    model, eager = _llama_pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)

    def step(model, opt, ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    sharded = hpfun.shard(lambda ids: step(model, opt, ids), mesh=hpfun.Mesh.simulated((2,), ("tp",)),
                          in_specs=(P(),), out_specs=P(), state_specs=m.LLAMA_TP)
    ids = _to(torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1)))
    losses = []
    for _ in range(2):
        losses.append((float(_full(sharded(ids))), float(step(eager, eager_opt, ids).detach())))
    diff = _maxdiff(dict(model.named_parameters()), dict(eager.named_parameters()))
    nodes = sharded.lower(ids).program.module.graph.nodes
    kernels = sorted({str(n.target).split(".")[1] for n in nodes if "attention" in str(n.target)})
    return {"max_rel_diff_params": diff, "losses_sharded_eager": losses, "attention_kernels": kernels,
            "pass": diff <= 1e-3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in losses)}


# ---------------------------------------------------------------------------------------------
# Memory: the estimate against the allocator
# ---------------------------------------------------------------------------------------------


def _estimate_vs_measured(f, *args):
    est = f.lower(*args).memory()
    got = memory.measure(f, *args)
    return {"held_est": est.held, "held_measured": got.held, "peak_est": est.peak, "peak_measured": got.peak,
            "peak_est_over_measured": round(est.peak / got.peak, 4)}


def memory_estimates():
    figures = {}
    params, (x, y) = _to(m.mlp_init(d_in=256, d_hidden=1024, n_classes=64)), _to(m.mlp_data(256, 256, 64))
    f = hpfun.shard(m.mlp_step, mesh=hpfun.Mesh.simulated((4,), ("dp",)), in_specs=(None, P("dp"), P("dp")))
    figures["mlp_dp4"] = _estimate_vs_measured(f, params, x, y)

    sizes = dict(vocab=512, seq=128, d=256, layers=4)
    params = _to(m.gpt_init(**sizes))
    state, (idx, tgt) = _to(m.adamw_init(m.gpt_init(**sizes))), _to(m.gpt_data(8, **sizes))
    specs = m.gpt_specs(params, tp="tp")
    f = hpfun.shard(m.gpt_step, mesh=hpfun.Mesh.simulated((2, 2), ("dp", "tp")),
                    in_specs=(specs, None, P("dp"), P("dp")))
    figures["gpt_2x2"] = _estimate_vs_measured(f, params, state, idx, tgt)

    model, _ = _llama_pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @hpfun.shard(mesh=hpfun.Mesh.simulated((2,), ("tp",)), in_specs=(P(),), out_specs=P(), state_specs=m.LLAMA_TP)
    def step(ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ids = _to(torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(1)))
    step(ids)  # the optimizer's state exists from the first step on
    figures["llama_tp2"] = _estimate_vs_measured(step, ids)
    figures["pass"] = all(abs(v["peak_est_over_measured"] - 1) <= 0.10 and v["held_est"] == v["held_measured"]
                          for v in figures.values())
    return figures


CHECKS = {"attention_kernels": attention_kernels, "attention_sdpa": attention_sdpa, "rng": rng_layouts,
          "gpt": gpt_step, "llama": llama_step, "memory": memory_estimates}


def main():
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), default=list(CHECKS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    DEVICE = torch.device(args.device)
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(DEVICE)}
    if DEVICE.type == "cuda":
        env |= {"gpu": torch.cuda.get_device_name(DEVICE), "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version()}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(json.dumps(env), flush=True)
    for name in args.only:
        check(name)(CHECKS[name])()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"env": env, "checks": RESULTS}, fh, indent=1, default=str)
    print("summary: " + ", ".join(f"{k} {v['status']}" for k, v in RESULTS.items()))
    sys.exit(0 if all(v["status"] == "ok" for v in RESULTS.values()) else 1)


if __name__ == "__main__":
    main()
