"""Hugging Face models called as written: LlamaForCausalLM and GPT2LMHeadModel from tiny configs
(no weights), float64, trained two steps sharded beside the same steps run eagerly, unsharded.

Both step styles: the stock one (`model(ids, labels=ids).loss`, `loss.backward()`, AdamW's
`step()` and `zero_grad()`, the model and optimizer closed over) and the functional one
(`torch.func.grad_and_value` over `torch.func.functional_call`, the parameters a dict argument
laid out by the same name patterns). Layouts: data parallel, Megatron tensor parallel by the
README's plans, and both on a 2x2 mesh.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import hpfun
from hpfun import P
from hpfun.testing.models import GPT2_TP, LLAMA_TP

transformers = pytest.importorskip("transformers")

PLANS = {"llama": LLAMA_TP, "gpt2": GPT2_TP}
LAYOUTS = {  # mesh, spec of the token batch, whether the plan applies
    "dp": (hpfun.Mesh.simulated((2,), ("dp",)), P("dp"), False),
    "tp": (hpfun.Mesh.simulated((2,), ("tp",)), P(), True),
    "dp-x-tp": (hpfun.Mesh.simulated((2, 2), ("dp", "tp")), P("dp"), True),
}
VOCAB, BATCH, SEQ = 128, 4, 8


def build(kind: str, attn: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn)
        return transformers.LlamaForCausalLM(config).double()
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_implementation=attn,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).double()


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def worst(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _train(m, o, ids):
    """The stock causal-LM step, labels the inputs."""
    loss = m(ids, labels=ids).loss
    loss.backward()
    o.step()
    o.zero_grad()
    return loss.detach()


def stock(kind, attn, layout):
    """The step as PyTorch users write it; hpfun decorates it once."""
    mesh, batch_spec, planned = LAYOUTS[layout]
    model, ref = build(kind, attn), build(kind, attn)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)

    @hpfun.shard(mesh=mesh, in_specs=(batch_spec, batch_spec), out_specs=P(),
                 state_specs=PLANS[kind] if planned else None)
    def train_step(ids, labels):
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    for i in range(2):
        ids = tokens(i)
        loss = train_step(ids, ids).full()
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return model, ref, losses, train_step


def functional(kind, attn, layout):
    """The functional step: parameters as a dict argument, laid out by the same patterns."""
    mesh, batch_spec, planned = LAYOUTS[layout]
    model, ref = build(kind, attn), build(kind, attn)
    plan = PLANS[kind] if planned else P()

    def loss_fn(params, ids):
        logits = torch.func.functional_call(model, params, (ids,)).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    @hpfun.shard(mesh=mesh, in_specs=(plan, batch_spec), out_specs=(plan, P()))
    def train_step(params, ids):
        loss, grads = torch.func.grad_and_value(loss_fn)(params, ids)[::-1]
        return {k: p - 0.5 * grads[k] for k, p in params.items()}, loss

    params = {k: v.detach() for k, v in model.named_parameters()}
    losses = []
    for i in range(2):
        ids = tokens(i)
        params, loss = train_step(params, ids)
        ref_loss = F.cross_entropy(ref(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        ref_loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.5 * p.grad
                p.grad = None
        losses.append((loss.full().item(), ref_loss.item()))
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(params[k].full())
    return model, ref, losses, train_step


CASES = [(kind, attn, layout) for kind in ("llama", "gpt2") for attn in ("eager", "sdpa") for layout in LAYOUTS]


@pytest.mark.parametrize("style", [stock, functional], ids=["stock", "functional"])
@pytest.mark.parametrize("kind, attn, layout", CASES, ids=["-".join(c) for c in CASES])
def test_two_steps_equal_eager(kind, attn, layout, style):
    """Every parameter after two steps equals the unsharded eager steps' within 1e-10, and so
    does the loss, except that HF's own loss (`labels=`) is computed in float32 by design (it
    casts the logits): summed in two halves under data parallel, it may differ from eager's
    single sum in its last float32 bit; the gradients it sends back are the same."""
    model, ref, losses, _ = style(kind, attn, layout)
    tolerance = 1e-10 if style is functional else 2 * torch.finfo(torch.float32).eps
    for loss, ref_loss in losses:
        assert abs(loss - ref_loss) <= tolerance * max(1.0, abs(ref_loss)), losses
    assert worst(model, ref) < 1e-10


def test_llama_tensor_parallel_collectives_are_megatrons():
    """Megatron's schedule, exactly: per layer two all-reduces forward (attention and MLP
    outputs) and two backward (their inputs' gradients); the replicated head needs none."""
    _, _, _, train_step = stock("llama", "sdpa", "tp")
    collectives = train_step.lower(tokens(0), tokens(0)).collectives
    assert [c.kind for c in collectives] == ["all_reduce"] * 8
    assert all(c.axes == ("tp",) and c.bytes == BATCH * SEQ * 32 * 8 for c in collectives)


def test_gpt2_fused_qkv_is_gathered():
    """GPT-2's c_attn computes q, k and v in one (32, 96) matmul; split in two contiguous
    halves, a rank holds q and half of k, not whole heads. So per layer, forward: c_attn's
    output is gathered before it is cut into q, k and v, then Megatron's two all-reduces;
    backward: the three gradients (split by heads) are gathered before they are joined for
    c_attn's backward (the same bytes as one gather of the joined gradient), then Megatron's
    two all-reduces."""
    _, _, _, train_step = stock("gpt2", "sdpa", "tp")
    collectives = train_step.lower(tokens(0), tokens(0)).collectives
    forward = [c for c in collectives if c.kind == "all_gather" and c.op == "aten.split_with_sizes.default"]
    backward = [c for c in collectives if c.kind == "all_gather" and c.op == "aten.cat.default"]
    assert len(forward) == 2 and len(backward) == 6 and len(collectives) == 2 + 6 + 8
    assert [c.kind for c in collectives].count("all_reduce") == 8
    assert sum(c.bytes for c in backward) == sum(c.bytes for c in forward) == 2 * BATCH * SEQ * 96 * 8 // 2


BERT_TP = {  # BERT's names overlap: the more specific pattern decides (attention.output.dense over output.dense)
    "layer.*.attention.self.*.weight": P("tp", None), "layer.*.attention.self.*.bias": P("tp"),
    "layer.*.attention.output.dense.weight": P(None, "tp"),
    "layer.*.intermediate.dense.weight": P("tp", None), "layer.*.intermediate.dense.bias": P("tp"),
    "layer.*.output.dense.weight": P(None, "tp"),
}


def test_bert_megatron_plan_written_with_overlapping_names():
    """BertForSequenceClassification, Megatron-split by a plan whose `output.dense` pattern also
    matches `attention.output.dense` (the more specific pattern decides): two steps equal eager,
    with Megatron's four all-reduces per layer over tp."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, num_labels=3)
    model = transformers.BertForSequenceClassification(config).double().eval()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))

    def train(m, o, ids, labels):
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    step = hpfun.shard(lambda ids, labels: train(model, opt, ids, labels), mesh=mesh, in_specs=(P("dp"), P("dp")),
                       out_specs=P(), state_specs=BERT_TP)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids, labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, 3, (BATCH,), generator=g)
        assert abs(step(ids, labels).full().item() - train(ref, ref_opt, ids, labels).item()) < 1e-12
    assert worst(model, ref) < 1e-10
    lowered = step.lower(ids, labels)
    layouts = {i["path"]: i["layout"] for i in lowered.inputs}
    for name in ("attention.output.dense.weight", "output.dense.weight", "intermediate.dense.weight"):
        want = "[R, S(0)]" if name.startswith("intermediate") else "[R, S(1)]"
        assert layouts[f"model.bert.encoder.layer.0.{name}"] == want, name
    assert sum(c.kind == "all_reduce" and c.axes == ("tp",) for c in lowered.collectives) == 8


MIXTRAL_TP = {"experts.gate_up_proj": P(None, "tp", None), "experts.down_proj": P(None, None, "tp")}


def test_mixtral_experts_split_over_tp_equal_eager():
    """MixtralForCausalLM's experts (transformers' grouped matmul, a library op with a rule by
    name) split along their hidden features over tp, tokens over dp: two AdamW steps equal
    eager, and each expert matmul runs on its block of features (no gather of the experts).
    float32: eager runs torch's _grouped_mm, which has no float64 kernel (traced, transformers
    takes its fallback op); measured 5e-7 on the loss, 2e-6 on the parameters."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))

    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    step = hpfun.shard(lambda ids: _train(model, opt, ids), mesh=mesh, in_specs=(P("dp"),), out_specs=P(),
                       state_specs=MIXTRAL_TP)
    for i in range(2):
        ids = tokens(i)
        assert abs(step(ids).full().item() - _train(ref, ref_opt, ids).item()) < 1e-5
    assert worst(model, ref) < 1e-4
    program = step.lower(ids).program
    grouped = [n for n in program.module.graph.nodes if "grouped_mm" in str(n.target)]
    assert len(grouped) == 4  # gate_up and down, forward and backward
    gathered = [str(c) for c in program.collectives if c.op.startswith("transformers.") and "tp" in c.axes]
    assert not gathered, gathered  # replicate-only, the expert weights would be gathered over tp for them


def test_llama_with_clip_grad_norm_on_dp_x_tp_equals_eager():
    """clip_grad_norm_ in the Llama step on a 2x2 dp x tp mesh: each split gradient's norm is
    all-reduced where it lies, and those small all-reduces bucket with the gradients'. A bucket
    fused after an earlier one moved its inputs had its wait placed before its collective (the
    program failed at its first call); two AdamW steps now equal eager."""
    model = build("llama", "eager")
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))

    def train(m, o, ids):
        loss = m(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        o.step()
        o.zero_grad()
        return loss.detach()

    mesh, spec, _ = LAYOUTS["dp-x-tp"]
    step = hpfun.shard(lambda ids: train(model, opt, ids), mesh=mesh, in_specs=(spec,), out_specs=P(),
                       state_specs=LLAMA_TP)
    for i in range(2):
        ids = tokens(i)
        got, want = step(ids).full().item(), train(ref, ref_opt, ids).item()
        assert abs(got - want) <= 2 * torch.finfo(torch.float32).eps * abs(want)  # HF's float32 loss, summed in halves
    assert worst(model, ref) < 1e-10


def test_bfloat16_mixtral_experts_run_torchs_grouped_mm_split_over_tp():
    """In bfloat16 transformers calls torch's own `_grouped_mm` while compiled (and so while
    traced), which had no rule: every bfloat16 MoE step was refused. Its rule splits the experts'
    features over tp as the fallback op's does; two SGD steps within bfloat16 rounding of eager
    (measured: 1e-6 relative on the loss, 1.4e-3 on the parameters)."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = hpfun.shard(lambda ids: _train(model, opt, ids), mesh=hpfun.Mesh.simulated((2, 2), ("dp", "tp")),
                       in_specs=(P("dp"),), out_specs=P(), state_specs=MIXTRAL_TP)
    for i in range(2):
        ids = tokens(i)
        got, want = step(ids).full().item(), _train(ref, ref_opt, ids).item()
        assert abs(got - want) < 1e-4 * abs(want), (got, want)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert (a.float() - b.float()).norm() <= 5e-3 * b.float().norm()
    program = step.lower(ids).program
    assert sum("_grouped_mm" in str(n.target) for n in program.module.graph.nodes) == 6  # forward, both gradients
    assert not [str(c) for c in program.collectives if "grouped_mm" in c.op and "tp" in c.axes]


def test_eager_experts_are_refused_naming_the_default_implementation():
    """transformers' eager experts loop (`experts_implementation="eager"`) reads which experts
    got tokens with nonzero(): refused, naming the line and the implementation that traces (the
    default grouped matmuls)."""
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, experts_implementation="eager")
    model = transformers.MixtralForCausalLM(config)
    step = hpfun.shard(lambda ids: model(ids, labels=ids).loss, mesh=hpfun.Mesh.simulated((2,), ("dp",)),
                       in_specs=(P("dp"),), out_specs=P())
    with pytest.raises(hpfun.CaptureError, match=r"nonzero\(\).*leave experts_implementation unset"):
        step(tokens(0))


def test_a_model_with_only_an_eager_experts_loop_is_refused_without_the_other_implementation():
    """SwitchTransformers has no grouped experts: the refusal does not send the user to an option
    the model lacks."""
    from hpfun.capture import _has_grouped_experts
    import transformers.models.mixtral.modeling_mixtral as mixtral
    import transformers.models.switch_transformers.modeling_switch_transformers as switch

    assert _has_grouped_experts(mixtral.__file__) and not _has_grouped_experts(switch.__file__)
    config = transformers.SwitchTransformersConfig(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_decoder_layers=2, num_heads=4, num_experts=4,
                                                   decoder_sparse_step=1, encoder_sparse_step=1)
    model = transformers.SwitchTransformersForConditionalGeneration(config).eval()
    step = hpfun.shard(lambda ids: model(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids).logits,
                       mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=(P("dp"),), out_specs=P("dp"))
    with pytest.raises(hpfun.CaptureError, match=r"nonzero\(\).*transformers gives it no other implementation"):
        step(tokens(0))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_an_all_ones_mask_is_skipped_as_eager_skips_it(mode):
    """transformers skips an all-ones attention mask in eager (a bidirectional Gemma then attends
    to every token) but not while tracing; hpfun reads a mask made from the arguments, so it
    decides as eager does (PaliGemma's logits differed by 6e-2, silently), and a mask with
    padding at a later call compiles again. Evaluated under torch.inference_mode too (the read
    raised torch's "Inference tensors do not track version counter")."""
    vision = transformers.SiglipVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=4)
    text = transformers.GemmaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(transformers.PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_id=90, projection_dim=32)).double().eval()
    ids = torch.cat([torch.full((2, 16), 90), torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))], 1)
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def logits(ids, pixels, mask):
        return model(input_ids=ids, pixel_values=pixels, attention_mask=mask).logits

    f = hpfun.shard(logits, mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=(P("dp"), P("dp"), P("dp")),
                    out_specs=P("dp"))
    padded = torch.ones_like(ids)
    padded[:, -2:] = 0
    for mask in (torch.ones_like(ids), padded):
        with mode():
            want = logits(ids, pixels, mask)
            got = f(ids, pixels, mask).full()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert f.trace_count == 2


def test_a_returned_model_output_keeps_its_tensors_and_drops_its_cache():
    """`return model(ids, labels=ids)`: the loss and logits come back sharded, equal to eager;
    the DynamicCache in it holds the trace's stand-ins, so it comes back as None with a warning
    that names it and says use_cache=False (before, it came back holding fake tensors)."""
    model = build("llama", "sdpa")
    ids = tokens(0)
    step = hpfun.shard(lambda ids: model(ids, labels=ids), mesh=LAYOUTS["dp"][0], in_specs=(P("dp"),), out_specs=None)
    with pytest.warns(UserWarning, match=r"outputs\['cache'\] is a DynamicCache \(a model's past_key_values\).*use_cache=False"):
        out = step(ids)
    ref = model(ids, labels=ids)
    assert torch.equal(out.logits.full(), ref.logits) and abs(out.loss.full().item() - ref.loss.item()) < 1e-6
    assert out.get("cache") is None and out.get("past_key_values") is None


def test_a_models_own_tensor_parallel_plan_reads_as_state_specs():
    """`hpfun.tp_plan(model)` reads transformers' plan (model.tp_plan): Llama's is Megatron's
    seven splits plus the vocabulary of the embedding and the head; two AdamW steps on dp x tp
    with it equal eager (a tied head is the embedding's tensor: specified once). Qwen3-MoE's expert weights (3-D, gate and up packed) split their
    features per expert, and the norms its plan all-reduces add no layout. A model without a
    plan is an error saying to write state_specs."""
    plan = hpfun.tp_plan(build("llama", "sdpa"))
    assert {k.removeprefix("model."): v for k, v in plan.items() if ".layers." in k} == LLAMA_TP
    assert plan["model.embed_tokens.weight"] == plan["lm_head.weight"] == P("tp", None)
    model, ref = build("llama", "sdpa"), build("llama", "sdpa")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))

    step = hpfun.shard(lambda ids: _train(model, opt, ids), mesh=LAYOUTS["dp-x-tp"][0], in_specs=(P("dp"),),
                       out_specs=P(), state_specs=hpfun.tp_plan(model))
    for i in range(2):
        ids = tokens(i)
        assert abs(step(ids).full().item() - _train(ref, ref_opt, ids).item()) < 1e-6
    # HF takes the loss in float32: over a split vocabulary its sums run in another order (6e-8 measured)
    assert worst(model, ref) < 1e-6
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32)
    # transformers 5.24 shipped this expert plan; 5.25 moved experts to expert parallelism (an
    # ep_plan hpfun does not read), so the test gives the plan itself
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                                 "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}
    moe = hpfun.tp_plan(transformers.Qwen3MoeForCausalLM(config))
    assert moe["model.layers.*.mlp.experts.gate_up_proj"] == P(None, "tp", None)
    assert moe["model.layers.*.mlp.experts.down_proj"] == P(None, None, "tp")
    assert not any("norm" in k for k in moe)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        tie_word_embeddings=True))
    assert "lm_head.weight" not in hpfun.tp_plan(tied)  # one tensor, named as torch lists it first
    with pytest.raises(hpfun.SpecError, match="has no tensor-parallel plan"):
        hpfun.tp_plan(torch.nn.Linear(2, 2))
    with pytest.raises(hpfun.SpecError, match=r"call it on the model: state_specs=tp_plan\(model\)"):
        hpfun.shard(lambda ids: ids, mesh=LAYOUTS["dp-x-tp"][0], in_specs=(P("dp"),), out_specs=P("dp"),
                    state_specs=hpfun.tp_plan)  # the function itself, not its plan


class _LoRA(torch.nn.Module):
    """PEFT's LoRA layer, as peft lays it out: the layer as `base_layer`, two small matrices beside."""

    def __init__(self, base: torch.nn.Linear, r: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, r, bias=False).double()
        self.lora_B = torch.nn.Linear(r, base.out_features, bias=False).double()
        torch.nn.init.normal_(self.lora_B.weight, std=0.1)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def _peft_like(model):
    """PEFT's PeftModel around `model`: the transformers model at `base_model.model`, q_proj and
    v_proj wrapped, only the adapters trained."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = _LoRA(layer.self_attn.v_proj)
    outer = torch.nn.Module()
    outer.base_model = torch.nn.Module()
    outer.base_model.model = model
    outer.forward = lambda ids, labels=None: model(ids, labels=labels)
    return outer


def test_the_plan_of_a_model_a_peft_wrapper_holds_names_the_wrapped_weights():
    """`hpfun.tp_plan` of a PEFT model (the transformers model at `base_model.model`, LoRA layers
    holding the split layer as `base_layer`): the model's plan under the wrapper's names, the
    adapters whole (it was an empty plan, silently: a replicated program). Two AdamW steps of
    the adapters on dp x tp equal eager."""
    torch.manual_seed(1)
    model, ref = _peft_like(build("llama", "sdpa")), _peft_like(build("llama", "sdpa"))
    ref.load_state_dict(model.state_dict())
    plan = hpfun.tp_plan(model)
    assert plan["base_model.model.model.layers.*.self_attn.q_proj.base_layer.weight"] == P("tp", None)
    assert plan["base_model.model.model.layers.*.self_attn.o_proj.weight"] == P(None, "tp")
    assert len(plan) == len(hpfun.tp_plan(build("llama", "sdpa"))) and not any("lora" in k for k in plan)
    opt, ref_opt = (torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, ref))
    step = hpfun.shard(lambda ids: _train(model, opt, ids), mesh=LAYOUTS["dp-x-tp"][0], in_specs=(P("dp"),),
                       out_specs=P(), state_specs=plan)
    layouts = {i["path"]: i["layout"] for i in step.lower(tokens(0)).inputs}
    assert layouts["model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == "[R, S(0)]"
    for i in range(2):
        ids = tokens(i)
        assert abs(step(ids).full().item() - _train(ref, ref_opt, ids).item()) < 1e-6
    assert worst(model, ref) < 1e-6


class _OwnLoRA(torch.nn.Module):
    """A LoRA written by hand: the layer as `base`, the adapters as its own parameters."""

    def __init__(self, base: torch.nn.Linear, r: int = 2):
        super().__init__()
        self.base = base
        self.A = torch.nn.Parameter(torch.zeros(r, base.in_features, dtype=torch.float64))
        self.B = torch.nn.Parameter(torch.zeros(base.out_features, r, dtype=torch.float64))

    def forward(self, x):
        return self.base(x) + x @ self.A.t() @ self.B.t()


def test_the_plan_of_a_layer_wrapped_by_the_users_own_module_splits_the_layer():
    """A hand-written LoRA around q_proj (the layer as `self.base`, the adapters its own
    parameters): the layer's weight is split, the adapters stay whole (they were split as if
    they were the layer's weight, and the layer left whole, silently)."""
    model = build("llama", "sdpa")
    for layer in model.model.layers:
        layer.self_attn.q_proj = _OwnLoRA(layer.self_attn.q_proj)
    plan = hpfun.tp_plan(model)
    assert plan["model.layers.*.self_attn.q_proj.base.weight"] == P("tp", None)
    assert not any(k.endswith((".A", ".B")) for k in plan)


def test_the_architecture_sweep_reports_ok_cases_and_what_it_kept_whole():
    """`python -m hpfun.testing.hf_sweep` (make hf-nightly) on one architecture: data parallel
    equals eager; so does ZeRO-3 by wildcard on GPT-NeoX, whose rotary `inv_freq` buffer (1 row at
    this size) does not divide over 2 ranks: it is kept whole, and the row lists it."""
    from hpfun.testing import hf_sweep

    outcome, detail = hf_sweep.run_case("llama", "dp")
    assert outcome == "ok" and "kept whole" not in detail, detail
    outcome, detail = hf_sweep.run_case("gpt_neox", "zero3")
    assert outcome == "ok" and "kept whole: model.gpt_neox.rotary_emb.inv_freq" in detail, detail


def test_autocast_data_parallel_gradients_are_ddps():
    """A Llama step under `torch.autocast("cpu", bfloat16)`, batch split over 2 ranks: each rank's
    matmuls round in bfloat16 on its own rows, so the gradients are what data parallelism
    computes (each half's gradient, averaged), bit for bit, and eager's only up to bfloat16
    rounding."""
    from hpfun.testing import hf_sweep

    model, ref, ddp = (hf_sweep._build("llama") for _ in range(3))
    ref.load_state_dict(model.state_dict())
    ddp.load_state_dict(model.state_dict())
    batch = hf_sweep.CASES["llama"][1]()

    def step(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(**b).loss
        loss.backward()
        return loss

    f = hpfun.shard(lambda b: step(model, b), mesh=hpfun.Mesh.simulated((2,), ("dp",)),
                    in_specs=({k: P("dp") for k in batch},), out_specs=P())
    loss = f(batch).full()
    assert loss.dtype == torch.float32 and torch.allclose(loss, step(ref, batch), rtol=1e-3)
    halves = []
    for rows in (slice(0, 2), slice(2, 4)):
        ddp.zero_grad()
        step(ddp, {k: v[rows] for k, v in batch.items()})
        halves.append([p.grad.clone() for p in ddp.parameters()])
    for p, q, g0, g1 in zip(model.parameters(), ref.parameters(), *halves, strict=True):
        assert torch.equal(p.grad, (g0 + g1) / 2)
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-2 * q.grad.abs().max().item())


def test_generate_inside_names_the_loop_outside():
    """generate() stops when every sequence has finished, read from the tokens the model chose:
    refused, naming the fix; the fix (the forward sharded, the greedy loop outside) gives
    generate()'s tokens."""
    model = build("gpt2", "eager").eval()
    mesh, _, _ = LAYOUTS["dp"]
    ids = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(0))
    generate = hpfun.shard(lambda ids: model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0),
                           mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    with pytest.raises(hpfun.CaptureError, match="run the generation loop outside the sharded function") as info:
        generate(ids)
    assert f"{__file__}:" in str(info.value) and "(in transformers/generation/" in str(info.value)  # the user's line first
    step = hpfun.shard(lambda ids: model(ids, use_cache=False).logits[:, -1], mesh=mesh, in_specs=P("dp"),
                       out_specs=P("dp"))
    tokens = ids
    for _ in range(2):
        tokens = torch.cat([tokens, step(tokens).full().argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0))


def test_switching_the_attention_implementation_compiles_again():
    """model.set_attn_implementation(...) between calls (transformers keeps it in the config's
    private `_attn_implementation_internal`) runs the newly chosen attention: a custom one
    registered with AttentionInterface, then sdpa again, each equal to eager."""
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def hot(module, q, k, v, mask, **kwargs):  # sdpa at temperature 2
        kwargs["scaling"] = kwargs.get("scaling", module.scaling) / 2
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    AttentionInterface.register("hpfun_test_hot_sdpa", hot)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, attn_implementation="sdpa")).double().eval()
    f = hpfun.shard(lambda ids: model(ids).logits, mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=(P("dp"),),
                    out_specs=P("dp"))
    ids = torch.randint(0, 64, (4, 6))
    for impl in ("sdpa", "hpfun_test_hot_sdpa", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            want = model(ids).logits
        torch.testing.assert_close(f(ids).full(), want, rtol=1e-12, atol=1e-12, msg=impl)


def test_a_cache_passed_as_an_argument_names_its_tensors_and_the_way_out():
    """A DynamicCache passed to a decode step is not flattened: the error names the cache's
    tensors and the user's line, and says to pass the tensors and build the cache inside, which
    gives eager's logits."""
    model = build("llama", "sdpa").eval()
    mesh, _, _ = LAYOUTS["dp"]
    ids = tokens(0)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
    decode = hpfun.shard(lambda tok, cache: model(tok[:, None], past_key_values=cache, use_cache=True).logits[:, -1],
                         mesh=mesh, in_specs=(P("dp"), P("dp")))
    with pytest.raises(hpfun.CaptureError) as info, torch.no_grad():
        decode(nxt, cache)
    text = str(info.value)
    assert "args[1]: is an argument of a class hpfun does not flatten (a DynamicCache)" in text
    assert "args[1].layers[0].keys" in text and f"{__file__}:" in text and "build the DynamicCache" in text
    kv = tuple((layer.keys, layer.values) for layer in cache.layers)

    def rebuilt(tok, kv):
        return model(tok[:, None], past_key_values=transformers.DynamicCache(kv), use_cache=True).logits[:, -1]

    with torch.no_grad():
        got = hpfun.shard(rebuilt, mesh=mesh, in_specs=(P("dp"), P("dp")))(nxt, kv)
        want = model(nxt[:, None], past_key_values=transformers.DynamicCache(kv), use_cache=True).logits[:, -1]
    torch.testing.assert_close(got.full(), want, rtol=1e-12, atol=1e-12)


def test_a_transformers_check_that_fails_keeps_its_message():
    """transformers' `torch_compilable_check` drops its message while compiling, and hpfun
    traces as if compiling: BART's classification head with rows of different numbers of <eos>
    said only `Expected cond to be True`. The error now says what eager's does; equal rows run."""
    torch.manual_seed(0)
    model = transformers.BartForSequenceClassification(transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0,
        eos_token_id=2, num_labels=3)).double().eval()
    ids, y = torch.randint(3, 64, (2, 8)), torch.tensor([0, 1])
    ids[:, -1] = 2
    f = hpfun.shard(lambda ids, y: model(input_ids=ids, labels=y).loss, mesh=hpfun.Mesh.simulated((2,), ("dp",)),
                    in_specs=(P("dp"), P("dp")), out_specs=P())
    torch.testing.assert_close(f(ids, y).full(), model(input_ids=ids, labels=y).loss, rtol=1e-12, atol=0)
    ids[1, 3] = 2  # (row 1: two <eos>)
    with pytest.raises(ValueError, match="same number of <eos> tokens"):
        model(input_ids=ids, labels=y)
    with pytest.raises(hpfun.CaptureError, match="ValueError .*same number of <eos> tokens"):
        f(ids, y)
