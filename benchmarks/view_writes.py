"""First call of a step that writes into views, with and without the second trace.

    python benchmarks/view_writes.py [--reps 2] [--layers 2]

The chunked gated delta rule of transformers' linear-attention models (Qwen3-Next, Kimi Linear)
writes each row of a matrix into a slice in a Python loop (`attn[..., i, :i] = ...`). hpfun's
functionalizing walk scatters such writes back into the tensor they view; before, any write
into a view made it trace the whole step a second time through torch's functionalization. Each
model's first call (tiny config, AdamW through `loss.backward(); opt.step()`, data parallel on
a simulated 2-rank mesh) is timed both ways in one process, interleaved: `walk` as shipped, and
`second trace` with the walk made to decline, which is what every such step did before. The
losses and weights of both are checked against eager.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import transformers

import hpfun
import hpfun.capture
from hpfun import P


def kimi_linear(layers: int):
    config = transformers.KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, moe_intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, linear_head_dim=16, linear_num_heads=2,
        layer_types=(["linear_attention", "full_attention"] * layers)[:layers],
        mlp_layer_types=(["dense"] + ["sparse"] * layers)[:layers])
    return transformers.KimiLinearForCausalLM(config)


def qwen3_next(layers: int):
    config = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=(["linear_attention", "full_attention"] * layers)[:layers])
    return transformers.Qwen3NextForCausalLM(config)


MODELS = {"Kimi Linear": kimi_linear, "Qwen3-Next": qwen3_next}


def first_call(make, layers: int, second_trace: bool) -> tuple[float, float]:
    """Seconds of the first sharded call, and the largest difference from eager (loss, weights)."""
    torch.manual_seed(0)
    model = make(layers)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))

    def step(m, o, ids):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    f = hpfun.shard(lambda ids: step(model, opt, ids), mesh=hpfun.Mesh.simulated((2,), ("dp",)),
                    in_specs=(P("dp"),), out_specs=P())
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    walk = hpfun.capture.functionalize
    if second_trace:
        hpfun.capture.functionalize = lambda gm: None
    try:
        start = time.perf_counter()
        loss = f(ids).full()
        seconds = time.perf_counter() - start
    finally:
        hpfun.capture.functionalize = walk
    diff = max(abs(loss - step(ref, ref_opt, ids)).item(),
               max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True)))
    return seconds, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | walk (s) | second trace (s) | ratio | largest difference from eager |")
    print("|---|---|---|---|---|")
    for name, make in MODELS.items():
        times = {False: [], True: []}
        diffs = []
        for _ in range(args.reps):
            for second in (False, True):
                seconds, diff = first_call(make, args.layers, second)
                times[second].append(seconds)
                diffs.append(diff)
        walk, twice = statistics.median(times[False]), statistics.median(times[True])
        runs = lambda ts: " / ".join(f"{t:.1f}" for t in ts)  # noqa: E731
        print(f"| {name}, {args.layers} layers | {runs(times[False])} | {runs(times[True])} | {walk / twice:.2f} | "
              f"{max(diffs):.1e} |", flush=True)


if __name__ == "__main__":
    main()
