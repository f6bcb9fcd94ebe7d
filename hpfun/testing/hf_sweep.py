"""Hugging Face models as their users call them, sharded, against the same step run eagerly.

Each architecture is built tiny from its own config class (random weights, float32), in eval
mode (dropout draws differ: hpfun's random numbers are its own), and trained for two steps with
the stock loop (`model(**batch).loss`, `loss.backward()`, `opt.step()`, `opt.zero_grad()`) by
SGD with momentum: beside an identical eager copy, on a simulated mesh, in each mode:

- `dp`: the batch split over 2 ranks, the state replicated;
- `tp`: dp x tp = 2 x 2, the model's own tensor-parallel plan (`hpfun.tp_plan`); models without
  one are skipped;
- `zero3`: the batch and every lifted tensor split over 2 ranks (`{"*": P("dp")}`), each
  parameter gathered at its use (`gather_params="dp"`); the tensors 2 does not divide are kept
  whole, and listed.

A case is `ok` when the losses and every parameter agree within `TOLERANCE` (relative to the
larger of 1 and the eager value's magnitude: DeiT's tokens move by thousands), `wrong` when they
do not, `refused` when hpfun raised one of its own errors (a plan that does not divide a tensor,
a value read into Python), and `error` for anything else. SGD, not AdamW, because Adam turns a
gradient that is zero up to rounding (a key projection's bias) into a step of the full learning
rate, either way.

    python -m hpfun.testing.hf_sweep [--modes dp tp zero3] [NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings

import torch

import hpfun
from hpfun import P

TOLERANCE = 1e-4
VOCAB = 128


def _lm(config: str, model: str, **extra):
    """A causal or masked LM of `transformers.<config>` with small common sizes."""
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, pad_token_id=0)
    return lambda t: getattr(t, model)(getattr(t, config)(**{**sizes, **extra}))


def _gqa(config: str, model: str, **extra):
    return _lm(config, model, num_key_value_heads=2, **extra)


def _tokens(seed: int = 0, length: int = 16) -> torch.Tensor:
    return torch.randint(3, VOCAB, (4, length), generator=torch.Generator().manual_seed(seed))


def _text():
    ids = _tokens()
    return {"input_ids": ids, "labels": ids}


def _classes():
    return {"input_ids": _tokens(), "labels": torch.tensor([0, 1, 1, 0])}


def _spans():
    return {"input_ids": _tokens(), "start_positions": torch.tensor([1, 2, 3, 4]),
            "end_positions": torch.tensor([5, 6, 7, 8])}


def _seq2seq():
    return {"input_ids": _tokens(), "labels": _tokens(1, 8)}


def _image():
    g = torch.Generator().manual_seed(2)
    return {"pixel_values": torch.randn(4, 3, 32, 32, generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}


def _t5(t):
    return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_heads=4, decoder_start_token_id=0))


def _bart(t):
    return t.BartForConditionalGeneration(t.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))


def _whisper(t):
    return t.WhisperForConditionalGeneration(t.WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0))


def _audio():
    return {"input_features": torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(4)), "labels": _tokens(1, 8)}


def _clip(t):
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64)
    vision = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    return t.CLIPModel(t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def _contrastive():
    return {"input_ids": _tokens(), "pixel_values": _image()["pixel_values"], "return_loss": True}


_VIT = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _vision(config: str, model: str):
    return lambda t: getattr(t, model)(getattr(t, config)(**_VIT, num_labels=3))


def _masked_image():
    """ViT-MAE's batch with its masking noise given: drawn inside, it would be hpfun's numbers, not torch's."""
    return {"pixel_values": _image()["pixel_values"], "noise": torch.rand(4, 16, generator=torch.Generator().manual_seed(3))}


def _encoder_decoder(config: str, model: str):
    return lambda t: getattr(t, model)(getattr(t, config)(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        decoder_start_token_id=0))


def _siglip(t):
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64)
    return t.SiglipModel(t.SiglipConfig(text_config=text, vision_config=_VIT))


# name -> (model from the transformers module, batch)
CASES = {
    "llama": (_gqa("LlamaConfig", "LlamaForCausalLM"), _text),
    "mistral": (_gqa("MistralConfig", "MistralForCausalLM", sliding_window=8), _text),
    "qwen2": (_gqa("Qwen2Config", "Qwen2ForCausalLM"), _text),
    "qwen3": (_gqa("Qwen3Config", "Qwen3ForCausalLM", head_dim=8), _text),
    "gemma": (_gqa("GemmaConfig", "GemmaForCausalLM", head_dim=8), _text),
    "gemma2": (_gqa("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=8), _text),
    "gemma3": (_gqa("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=8), _text),
    "phi": (_lm("PhiConfig", "PhiForCausalLM"), _text),
    "phi3": (_gqa("Phi3Config", "Phi3ForCausalLM"), _text),
    "gpt_neox": (_lm("GPTNeoXConfig", "GPTNeoXForCausalLM"), _text),
    "mixtral": (_gqa("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2), _text),
    "deepseek_v3": (_lm("DeepseekV3Config", "DeepseekV3ForCausalLM", moe_intermediate_size=16, num_key_value_heads=4,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8), _text),
    "olmo2": (_gqa("Olmo2Config", "Olmo2ForCausalLM"), _text),
    "stablelm": (_gqa("StableLmConfig", "StableLmForCausalLM"), _text),
    "cohere": (_gqa("CohereConfig", "CohereForCausalLM"), _text),
    "starcoder2": (_gqa("Starcoder2Config", "Starcoder2ForCausalLM"), _text),
    "granite": (_gqa("GraniteConfig", "GraniteForCausalLM"), _text),
    "qwen2_moe": (_gqa("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=16), _text),
    "llama_cls": (_gqa("LlamaConfig", "LlamaForSequenceClassification", num_labels=2), _classes),
    "gpt2": (lambda t: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                      n_positions=64)), _text),
    "gpt2_cls": (lambda t: t.GPT2ForSequenceClassification(t.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=2, pad_token_id=0)), _classes),
    "gpt_bigcode": (lambda t: t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                                        n_positions=64, multi_query=True)), _text),
    "falcon": (lambda t: t.FalconForCausalLM(t.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                            num_attention_heads=4)), _text),
    "bloom": (lambda t: t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)), _text),
    "gptj": (lambda t: t.GPTJForCausalLM(t.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                      n_positions=64)), _text),
    "opt": (lambda t: t.OPTForCausalLM(t.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                   num_attention_heads=4, max_position_embeddings=64,
                                                   word_embed_proj_dim=32)), _text),
    "mamba": (lambda t: t.MambaForCausalLM(t.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8,
                                                         num_hidden_layers=2, expand=2, conv_kernel=4)), _text),
    "bert": (_lm("BertConfig", "BertForMaskedLM"), _text),
    "bert_qa": (_lm("BertConfig", "BertForQuestionAnswering"), _spans),
    "roberta": (_lm("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1), _text),
    "albert": (_lm("AlbertConfig", "AlbertForMaskedLM", embedding_size=16), _text),
    "electra": (_lm("ElectraConfig", "ElectraForMaskedLM", embedding_size=32), _text),
    "deberta_v2": (_lm("DebertaV2Config", "DebertaV2ForMaskedLM"), _text),
    "distilbert": (lambda t: t.DistilBertForMaskedLM(t.DistilBertConfig(vocab_size=VOCAB, dim=32, hidden_dim=64,
                                                                        n_layers=2, n_heads=4,
                                                                        max_position_embeddings=64)), _text),
    "roformer": (_lm("RoFormerConfig", "RoFormerForMaskedLM", embedding_size=32), _text),
    "modernbert": (_lm("ModernBertConfig", "ModernBertForMaskedLM", local_attention=8, global_attn_every_n_layers=2,
                       bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2), _text),
    "t5": (_t5, _seq2seq),
    "bart": (_bart, _seq2seq),
    "whisper": (_whisper, _audio),
    "vit": (lambda t: t.ViTForImageClassification(t.ViTConfig(image_size=32, patch_size=8, hidden_size=32,
                                                              intermediate_size=64, num_hidden_layers=2,
                                                              num_attention_heads=4, num_labels=3)), _image),
    "swin": (lambda t: t.SwinForImageClassification(t.SwinConfig(image_size=32, patch_size=4, embed_dim=16,
                                                                 depths=[1, 1], num_heads=[2, 2], window_size=4,
                                                                 num_labels=4)), _image),
    "convnext": (lambda t: t.ConvNextForImageClassification(t.ConvNextConfig(num_channels=3, num_stages=2,
                                                                             hidden_sizes=[8, 16], depths=[1, 1],
                                                                             num_labels=3)), _image),
    "dinov2": (lambda t: t.Dinov2ForImageClassification(t.Dinov2Config(image_size=32, patch_size=8, hidden_size=32,
                                                                      intermediate_size=64, num_hidden_layers=2,
                                                                      num_attention_heads=4, num_labels=4)), _image),
    "beit": (lambda t: t.BeitForImageClassification(t.BeitConfig(image_size=32, patch_size=8, hidden_size=32,
                                                                intermediate_size=64, num_hidden_layers=2,
                                                                num_attention_heads=4, num_labels=4,
                                                                use_relative_position_bias=True)), _image),
    "resnet": (lambda t: t.ResNetForImageClassification(t.ResNetConfig(num_channels=3, embedding_size=8,
                                                                      hidden_sizes=[8, 16], depths=[1, 1],
                                                                      num_labels=4)), _image),
    "mobilenet_v2": (lambda t: t.MobileNetV2ForImageClassification(t.MobileNetV2Config(
        num_channels=3, image_size=32, depth_multiplier=0.25, num_labels=4)), _image),
    "segformer": (lambda t: t.SegformerForImageClassification(t.SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        num_attention_heads=[1, 2], num_labels=4)), _image),
    "clip": (_clip, _contrastive),
    "siglip": (_siglip, _contrastive),
    "deit": (_vision("DeiTConfig", "DeiTForImageClassification"), _image),
    "vit_mae": (lambda t: t.ViTMAEForPreTraining(t.ViTMAEConfig(**_VIT, decoder_hidden_size=16,
                decoder_num_hidden_layers=1, decoder_num_attention_heads=2, decoder_intermediate_size=32)), _masked_image),
    "swinv2": (lambda t: t.Swinv2ForImageClassification(t.Swinv2Config(image_size=32, patch_size=4, embed_dim=16,
               depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=3)), _image),
    "convnextv2": (lambda t: t.ConvNextV2ForImageClassification(t.ConvNextV2Config(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)), _image),
    "regnet": (lambda t: t.RegNetForImageClassification(t.RegNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=4, num_labels=3)), _image),
    "poolformer": (lambda t: t.PoolFormerForImageClassification(t.PoolFormerConfig(
        hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], num_labels=3)), _image),
    "fnet": (_lm("FNetConfig", "FNetForMaskedLM", use_tpu_fourier_optimizations=False), _text),
    "xlnet": (lambda t: t.XLNetLMHeadModel(t.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4,
                                                          d_inner=64)), _text),
    "big_bird": (_lm("BigBirdConfig", "BigBirdForMaskedLM", attention_type="original_full"), _text),
    "mpnet": (_lm("MPNetConfig", "MPNetForMaskedLM"), _text),
    "esm": (_lm("EsmConfig", "EsmForMaskedLM", position_embedding_type="rotary", mask_token_id=2), _text),
    "biogpt": (_lm("BioGptConfig", "BioGptForCausalLM"), _text),
    "gpt_neo": (lambda t: t.GPTNeoForCausalLM(t.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)), _text),
    "mpt": (lambda t: t.MptForCausalLM(t.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                                                    expansion_ratio=2, max_seq_len=64)), _text),
    "persimmon": (_lm("PersimmonConfig", "PersimmonForCausalLM"), _text),
    "olmoe": (_gqa("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2, eos_token_id=2), _text),
    "jamba": (_gqa("JambaConfig", "JambaForCausalLM", num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
                   attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_dt_rank=4), _text),
    "mamba2": (lambda t: t.Mamba2ForCausalLM(t.Mamba2Config(vocab_size=VOCAB, hidden_size=32, state_size=8,
               num_hidden_layers=2, num_heads=8, head_dim=8, n_groups=1, expand=2, chunk_size=8)), _text),
    "recurrent_gemma": (_lm("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", num_key_value_heads=2, lru_width=32,
                            attention_window_size=8, block_types=["recurrent", "attention"]), _text),
    "nemotron": (_gqa("NemotronConfig", "NemotronForCausalLM"), _text),
    "longformer": (_lm("LongformerConfig", "LongformerForMaskedLM", attention_window=4, pad_token_id=1), _text),
    "prophetnet": (lambda t: t.ProphetNetForConditionalGeneration(t.ProphetNetConfig(
        vocab_size=VOCAB, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=1,
        num_decoder_layers=1, num_encoder_attention_heads=4, num_decoder_attention_heads=4, ngram=2,
        max_position_embeddings=64, decoder_start_token_id=0)), _seq2seq),
    "mt5": (lambda t: t.MT5ForConditionalGeneration(t.MT5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                                                                num_layers=2, num_heads=4, decoder_start_token_id=0)),
            _seq2seq),
    "pegasus": (_encoder_decoder("PegasusConfig", "PegasusForConditionalGeneration"), _seq2seq),
    "mbart": (_encoder_decoder("MBartConfig", "MBartForConditionalGeneration"), _seq2seq),
}
MODES = ("dp", "tp", "zero3")


def _build(name: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return CASES[name][0](transformers).float().eval()


def _step(model, opt):
    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def run_case(name: str, mode: str, steps: int = 2) -> tuple[str, str]:
    """(outcome, detail) of one architecture in one mode: ok, wrong, refused, skipped or error."""
    model, ref = _build(name), _build(name)
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    batch = CASES[name][1]()
    options: dict = {}
    if mode == "dp":
        mesh, state_specs = hpfun.Mesh.simulated((2,), ("dp",)), None
    elif mode == "tp":
        mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
        try:
            state_specs = hpfun.tp_plan(model)
        except hpfun.SpecError:
            return "skipped", "no tensor-parallel plan"
    elif mode == "zero3":
        mesh, state_specs, options = hpfun.Mesh.simulated((2,), ("dp",)), {"*": P("dp")}, {"gather_params": "dp"}
    else:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    in_specs = ({k: P("dp") if isinstance(v, torch.Tensor) else None for k, v in batch.items()},)
    sharded = hpfun.shard(_step(model, opt), mesh=mesh, in_specs=in_specs, out_specs=P(), state_specs=state_specs,
                          **options)
    eager = _step(ref, ref_opt)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", hpfun.WildcardWarning)
            losses = [(sharded(batch).full().item(), eager(batch).item()) for _ in range(steps)]
    except hpfun.InternalError as err:  # hpfun's own failure: counted as an error, not a refusal
        return "error", " ".join(line.strip() for line in str(err).splitlines()[:2])
    except hpfun.HpfunError as err:  # its headline and first problem
        return "refused", " ".join(line.strip() for line in str(err).splitlines()[:2])
    except Exception as err:  # noqa: BLE001 - every failure is a row of the report
        return "error", f"{type(err).__name__}: {err}".splitlines()[0] + "\n" + traceback.format_exc(limit=-3)
    loss_diff = max(abs(a - b) / max(1.0, abs(b)) for a, b in losses)
    pairs = list(zip(model.parameters(), ref.parameters(), strict=True))
    param_diff = max((a - b).abs().max().item() / max(1.0, b.abs().max().item()) for a, b in pairs)
    detail = f"loss {loss_diff:.1e}, parameters {param_diff:.1e}"
    whole = [line.split()[0] for w in caught if issubclass(w.category, hpfun.WildcardWarning)
             for line in str(w.message).splitlines()[1:-1]]
    if whole:  # tensors the wildcard's spec does not divide
        detail += f"; kept whole: {', '.join(whole)}"
    return ("ok" if max(loss_diff, param_diff) <= TOLERANCE else "wrong"), detail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"architectures (default: all): {', '.join(CASES)}")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in CASES]
    if unknown:
        parser.error(f"unknown architectures {unknown}; known: {', '.join(CASES)}")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    counts: dict[str, int] = {}
    for name in args.names or list(CASES):
        for mode in args.modes:
            start = time.perf_counter()
            outcome, detail = run_case(name, mode)
            counts[outcome] = counts.get(outcome, 0) + 1
            print(f"{name:12s} {mode:6s} {outcome:8s} {time.perf_counter() - start:5.1f} s  {detail}", flush=True)
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 1 if counts.get("wrong") or counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
