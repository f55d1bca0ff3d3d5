"""The GPT: shapes, names, causality, per-name initialisation, and GPT-3 XL on the meta device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2ptrain.model.gpt import GPT
from p2ptrain.model.init import initial_value
from p2ptrain.planning.model_shapes import model_shape

TINY = dataclasses.replace(model_shape("tiny"), seq_len=16)


def test_logits_have_batch_sequence_vocab_shape():
    model = GPT(TINY, seed=0)
    tokens = torch.randint(0, TINY.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    assert model(tokens).shape == (3, 16, TINY.vocab_size)
    assert model(tokens[:, :5]).shape == (3, 5, TINY.vocab_size)  # shorter sequences are fine


def test_longer_sequence_than_the_model_is_refused():
    with pytest.raises(ValueError, match="longer than"):
        GPT(TINY, seed=0)(torch.zeros(1, 17, dtype=torch.long))


def test_parameter_names_are_the_documented_ones():
    names = set(dict(GPT(TINY, device="meta").named_parameters()))
    assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias", "head.weight"} <= names
    assert "head.bias" not in names  # untied head without bias
    for i in range(TINY.num_layers):
        assert f"blocks.{i}.attn.qkv.weight" in names and f"blocks.{i}.mlp.proj.bias" in names
    assert not any(name.startswith(f"blocks.{TINY.num_layers}.") for name in names)


def test_prediction_at_a_position_ignores_later_tokens():
    model = GPT(TINY, seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_same_seed_same_parameters_other_seed_other_parameters():
    a, b, c = GPT(TINY, seed=3).state_dict(), GPT(TINY, seed=3).state_dict(), GPT(TINY, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.2.attn.qkv.weight"], c["blocks.2.attn.qkv.weight"])


def test_building_a_model_leaves_the_global_rng_alone():
    before = torch.random.get_rng_state()
    GPT(TINY, seed=0)
    assert torch.equal(before, torch.random.get_rng_state())


def test_initial_values_follow_the_gpt2_scheme():
    state = GPT(model_shape("tiny"), seed=0).state_dict()
    assert torch.equal(state["blocks.0.ln1.weight"], torch.ones(64))
    assert torch.equal(state["blocks.0.attn.qkv.bias"], torch.zeros(192))
    assert abs(state["head.weight"].std().item() - 0.02) < 0.002
    residual_std = 0.02 / (2 * 8) ** 0.5  # projections into the residual stream are scaled by depth
    assert abs(state["blocks.5.mlp.proj.weight"].std().item() - residual_std) < 0.1 * residual_std
    # each parameter is a function of (seed, name) alone
    assert torch.equal(
        state["blocks.5.attn.proj.weight"], initial_value("blocks.5.attn.proj.weight", (64, 64), 0, 8)
    )


def test_gpt3_xl_builds_on_meta_with_the_expected_parameter_count():
    shape = model_shape("gpt3-xl")
    model = GPT(shape, device="meta")
    assert all(p.is_meta for p in model.parameters())
    d, layers, vocab, seq = shape.hidden_size, shape.num_layers, shape.vocab_size, shape.seq_len
    per_block = (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
    expected = vocab * d + seq * d + layers * per_block + 2 * d + vocab * d
    assert model.num_parameters() == expected
    assert 1.3e9 < expected < 1.45e9  # 1.315e9 as in the paper, plus the untied head (0.103e9)
