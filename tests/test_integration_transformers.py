"""``attn_implementation="fmha"`` in real transformers models (small random configs: 2 layers,
hidden 64, 4 query heads on 2 KV heads) against the same weights with ``"eager"``: logits (plain
and left-padded batches), a training step's loss and gradients, greedy ``generate()`` with the
dynamic and the static cache, packed sequences, and the paths that fall back to the exact mask.
On the CPU fmha runs its exact PyTorch reference, so fp32 agrees to rounding;
``test_gpu_integrations.py`` runs the same models in bf16 with the kernels."""

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fmha.integrations.transformers as fmha_hf  # noqa: E402

fmha_hf.register()

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
             initializer_range=0.25)  # weights large enough that scores spread: masks, caps and sinks matter
SEQ = 11
WINDOW = 5  # shorter than SEQ: the sliding layers drop keys


def model_configs(sizes=SMALL, window=WINDOW):
    """name -> config; each exercises what its family adds to Llama's attention."""
    t = transformers
    configs = {
        "llama": t.LlamaConfig(**sizes),
        "qwen2": t.Qwen2Config(**sizes),
        "qwen3": t.Qwen3Config(**sizes),  # q/k norms
        "mistral": t.MistralConfig(**sizes, sliding_window=window),  # every layer sliding
        # layers alternate sliding and full; scores capped at 2 tanh(s / 2) (so the cap matters)
        "gemma2": t.Gemma2Config(**sizes, sliding_window=window, attn_logit_softcapping=2.0,
                                 final_logit_softcapping=30.0, query_pre_attn_scalar=sizes["head_dim"]),
    }
    if hasattr(t, "GptOssConfig"):  # sinks, alternating sliding layers, MoE
        configs["gpt_oss"] = t.GptOssConfig(**{**sizes, "intermediate_size": sizes["hidden_size"]},
                                            sliding_window=window, num_local_experts=4,
                                            num_experts_per_tok=4)  # every expert: no routing flips in bf16
    return configs


CONFIGS = model_configs()


def model_pair(name, dtype=torch.float32, device="cpu", configs=CONFIGS, reference="eager", **from_config):
    """(``reference`` model, fmha model) of config ``name`` with the same random weights, in eval
    mode. Each gets its own copy of the config: transformers records the implementation in it."""
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(configs[name]),
                                                           attn_implementation=reference, **from_config)
    for module in theirs.modules():
        if hasattr(module, "sinks"):  # gpt-oss initializes them near 0; make them matter
            torch.nn.init.normal_(module.sinks, std=1.0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(configs[name]), attn_implementation="fmha",
                                                         **from_config)
    ours.load_state_dict(theirs.state_dict())
    return theirs.to(device, dtype).eval(), ours.to(device, dtype).eval()


def batch(device="cpu", pad_left=True, seq=SEQ, pad=4, vocab=SMALL["vocab_size"]):
    """Token ids (2, seq) and a padding mask: row 1 has ``pad`` pad tokens, on the left
    (generation) or on the right (training)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    if pad_left:
        mask[1, :pad] = 0
    else:
        mask[1, -pad:] = 0
    return ids.to(device), mask.to(device)


class PathCounts:
    """The attention paths the fmha model's layers took inside a ``with`` block."""

    def __enter__(self):
        self.before = fmha_hf.attention_paths()
        return self

    def __exit__(self, *exc):
        after = fmha_hf.attention_paths()
        self.counts = {k: after.get(k, 0) - self.before.get(k, 0) for k in after if after.get(k, 0) != self.before.get(k, 0)}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    return request.param, *model_pair(request.param)


def test_logits_match_eager_plain_and_left_padded(pair):
    name, eager, ours = pair
    ids, mask = batch()
    with torch.no_grad(), PathCounts() as plain:
        got = ours(ids).logits
    torch.testing.assert_close(got, eager(ids).logits, rtol=1e-5, atol=1e-5)
    assert plain.counts == {"dense": 2}
    with torch.no_grad(), PathCounts() as padded:
        got = ours(ids, attention_mask=mask).logits
    want = eager(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert padded.counts == {"varlen": 2}  # unpadded, not the exact 4-D fallback


def test_a_training_step_matches_eager(pair):
    name, eager, ours = pair
    ids, mask = batch(pad_left=False)
    labels = ids.masked_fill(mask == 0, -100)
    losses, grads = [], []
    for model in (eager, ours):
        model.train()
        model.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        model.eval()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[1].keys() == grads[0].keys()
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    if name == "gpt_oss":  # the sinks learn through fmha
        assert any("sinks" in n and g.abs().sum() > 0 for n, g in grads[1].items())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_matches_eager(pair, cache):
    name, eager, ours = pair
    ids, mask = batch()
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = eager.generate(ids, **kw)
    with PathCounts() as paths:
        got = ours.generate(ids, **kw)
    assert torch.equal(got, want)
    assert "exact" not in paths.counts


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_generate_with_padding_inside_a_sliding_caches_window(name, cache):
    """8 pad tokens of 11, a 5-key window: the sliding layers' caches hold padding while
    decoding, and their keys start past position 0 (a static cache's masks also go through the
    model twice); every step's scores equal eager's."""
    eager, ours = model_pair(name)
    ids, mask = batch(pad=8)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want, got = eager.generate(ids, **kw), ours.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.scores, want.scores):
        torch.testing.assert_close(step_got, step_want, rtol=1e-4, atol=1e-4)


def test_packed_sequences_match_eager_and_separate_sequences():
    """position_ids restarting inside a row (transformers' packing): each sequence attends only
    to itself, in every row of the batch; FlashAttention-style cu_seq_lens keywords give the same."""
    eager, ours = model_pair("llama")
    ids, _ = batch()
    row_lengths = ((4, 3, 4), (6, 5))
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in row_lengths])
    with torch.no_grad():
        with PathCounts() as paths:
            got = ours(ids, position_ids=position_ids, use_cache=False).logits
        want = eager(ids, position_ids=position_ids, use_cache=False).logits
        for r, row in enumerate(row_lengths):
            starts = torch.tensor((0,) + row).cumsum(0).tolist()
            alone = torch.cat([eager(ids[r:r + 1, a:b], use_cache=False).logits for a, b in zip(starts, starts[1:])], 1)
            torch.testing.assert_close(got[r:r + 1], alone, rtol=1e-5, atol=1e-5)
        cu = torch.tensor([0, 4, 7, 11, 17, 22], dtype=torch.int32)  # the rows flattened
        by_keywords = ours(ids, position_ids=position_ids, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                           max_length_q=6, max_length_k=6).logits
    assert paths.counts == {"varlen": 2}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_keywords, got, rtol=1e-5, atol=1e-5)


def test_bf16_logits_are_as_close_to_fp32_as_eagers_bf16():
    """bf16 end to end: fmha's logits are within bf16 error of the fp32 model's, no farther than
    eager's own bf16 logits are."""
    truth, _ = model_pair("qwen3")
    eager, ours = model_pair("qwen3", torch.bfloat16)
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad():
        want = truth(ids, attention_mask=mask).logits[real]
        got = ours(ids, attention_mask=mask).logits
        eager_bf16 = eager(ids, attention_mask=mask).logits[real].float()
    assert got.dtype == torch.bfloat16

    def error(x):
        return ((x.float() - want).norm() / want.norm()).item()

    assert error(got[real]) < 3e-2
    assert error(got[real]) < 1.5 * error(eager_bf16)


def test_a_custom_4d_mask_runs_exactly_on_the_fallback():
    """A mask fmha cannot state (here: each query sees only even keys up to itself) is computed
    with the exact 4-D mask, softcap included."""
    eager, ours = model_pair("gemma2")
    ids, _ = batch()
    i = torch.arange(SEQ)
    keep = (i[None, :] <= i[:, None]) & ((i[None, :] % 2 == 0) | (i[None, :] == i[:, None]))
    mask = torch.zeros(2, 1, SEQ, SEQ).masked_fill(~keep, torch.finfo(torch.float32).min)
    with torch.no_grad(), PathCounts() as paths:
        got = ours(ids, attention_mask=mask).logits
    assert paths.counts == {"exact": 2}
    torch.testing.assert_close(got, eager(ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)


def test_a_sliding_window_over_padding_between_tokens_falls_back_exactly():
    """Unpadding would pull keys from beyond a sliding window across padding in the middle of a
    row: such masks take the exact path (and stay equal to eager); full layers still unpad."""
    eager, ours = model_pair("mistral")
    ids, _ = batch()
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 3:6] = 0
    with torch.no_grad(), PathCounts() as paths:
        got = ours(ids, attention_mask=mask).logits
    assert paths.counts == {"exact": 2}
    real = mask.bool()
    torch.testing.assert_close(got[real], eager(ids, attention_mask=mask).logits[real], rtol=1e-5, atol=1e-5)


def test_set_attn_implementation_switches_a_loaded_model_to_fmha():
    eager, _ = model_pair("llama")
    model = copy.deepcopy(eager)
    model.set_attn_implementation("fmha")
    assert model.config._attn_implementation == "fmha"
    ids, _ = batch()
    with torch.no_grad(), PathCounts() as paths:
        got = model(ids).logits
    assert paths.counts == {"dense": 2}
    torch.testing.assert_close(got, eager(ids).logits, rtol=1e-5, atol=1e-5)


def test_attention_dropout_in_training_is_refused_with_what_to_change():
    config = copy.deepcopy(CONFIGS["llama"])
    config.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="fmha").train()
    ids, _ = batch()
    with pytest.raises(ValueError, match="attention_dropout = 0.0"):
        model(ids)
    with torch.no_grad():
        model.eval()(ids)  # eval passes dropout=0: fine


def test_mask_patterns_of_transformers_are_recognised():
    m = transformers.masking_utils
    assert fmha_hf._pattern(m.causal_mask_function) == fmha_hf._Pattern(causal=True)
    assert fmha_hf._pattern(m.bidirectional_mask_function) == fmha_hf._Pattern(causal=False)
    assert fmha_hf._pattern(m.sliding_window_causal_mask_function(7)) == fmha_hf._Pattern(causal=True, window=7)
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    # a packed row: the base pattern on the row's positions (transformers 5.17) or remapped to
    # each sequence's own (5.24, remap_positions_for_packed_sequence), then the same sequence only
    bases = [m.causal_mask_function, m.sliding_window_causal_mask_function(3)]
    if hasattr(m, "remap_positions_for_packed_sequence"):
        bases += [m.remap_positions_for_packed_sequence(base, torch.tensor([[0, 1, 0, 1, 2]])) for base in bases]
    for base, window in zip(bases, [None, 3, None, 3]):
        packed = m.and_masks(base, m.packed_sequence_mask_function(ids))
        assert fmha_hf._pattern(packed) == fmha_hf._Pattern(causal=True, window=window, packed_ids=ids)
    assert fmha_hf._pattern(m.and_masks(m.bidirectional_mask_function, m.packed_sequence_mask_function(ids))) is None
    assert torch.equal(fmha_hf._packed_offsets(ids), torch.tensor([0, 2, 5], dtype=torch.int32))
    # not stated exactly by fmha: the exact 4-D mask is used for these
    assert fmha_hf._pattern(m.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))) is None
    assert fmha_hf._pattern(m.sliding_window_bidirectional_mask_function(3)) is None
    assert fmha_hf._pattern(m.or_masks(m.causal_mask_function, m.bidirectional_mask_function)) is None


def test_importing_the_integration_does_not_import_transformers():
    script = ("import sys; sys.modules['transformers'] = None\n"  # as if it were not installed
              "import fmha.integrations.transformers as t\n"
              "try:\n    t.register()\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "ImportError: fmha.integrations.transformers.register() needs Hugging Face transformers" in run.stdout
