"""The llama family: shapes resolved and refused, forward, causality, stages, GQA, counts, and training."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2ptrain.model.gpt import GPT
from p2ptrain.planning import parameter_count
from p2ptrain.planning.model_shapes import MODEL_PRESETS, ModelShape, model_shape
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

LLAMA = dataclasses.replace(model_shape("llama-tiny"), seq_len=16)


def tokens(rows: int = 3, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, LLAMA.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))


def test_shape_fields_resolve_to_the_familys_defaults():
    gpt = ModelShape(num_layers=2, hidden_size=64, num_heads=4, seq_len=8)
    assert (gpt.family, gpt.activation, gpt.num_kv_heads, gpt.ffn_hidden_size) == ("gpt", "gelu", 4, 256)
    llama = ModelShape(num_layers=2, hidden_size=768, num_heads=12, seq_len=8, family="llama")
    assert (llama.activation, llama.num_kv_heads, llama.ffn_hidden_size) == ("silu", 12, 2048)  # 2/3·4h
    assert ModelShape(2, 64, 4, 8, family="llama").ffn_hidden_size == 192  # 170.7 up to a multiple of 64
    assert dataclasses.replace(LLAMA, seq_len=32).num_kv_heads == 2  # replace keeps what was resolved
    assert model_shape("tiny") == ModelShape(num_layers=8, hidden_size=64, num_heads=4, seq_len=64)


@pytest.mark.parametrize("fields, message", [
    ({"family": "bert"}, "unknown family"),
    ({"family": "llama", "activation": "gelu"}, "takes activation silu"),
    ({"activation": "relu"}, "takes activation gelu or gelu_new"),
    ({"num_kv_heads": 2}, "needs family llama"),
    ({"family": "llama", "num_kv_heads": 3}, "must divide num_heads"),
    ({"family": "llama", "num_heads": 64}, "even head size"),
    ({"family": "llama", "rope_theta": 0.0}, "rope_theta"),
    ({"norm_eps": -1.0}, "norm_eps"),
])
def test_shapes_we_do_not_build_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        ModelShape(**{"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_len": 8, **fields})
    assert "\n" not in str(error.value)


def test_logits_shape_names_and_no_biases_or_positions():
    model = GPT(LLAMA, seed=0)
    assert model(tokens()).shape == (3, 16, 256) and model(tokens(seq=5)).shape == (3, 5, 256)
    names = dict(model.named_parameters())
    assert "pos_emb.weight" not in names and not any(name.endswith(".bias") for name in names)
    assert names["blocks.0.attn.qkv.weight"].shape == (64 + 2 * 32, 64)  # q, then k and v of 2 heads of 16
    assert {f"blocks.3.mlp.{p}.weight" for p in ("gate", "up", "proj")} <= set(names)
    assert isinstance(model.ln_f, torch.nn.RMSNorm) and torch.equal(names["blocks.2.ln1.weight"], torch.ones(64))
    with pytest.raises(ValueError, match="longer than"):
        model(tokens(seq=17))


def test_prediction_at_a_position_ignores_later_tokens():
    model = GPT(LLAMA, seed=0)
    a = tokens(2)
    b = a.clone()
    b[:, 10:] = (b[:, 10:] + 1) % 256
    with torch.no_grad():
        x, y = model(a), model(b)
    torch.testing.assert_close(x[:, :10], y[:, :10], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(x[:, 10:], y[:, 10:])


def test_positions_matter():
    """Without positions attention is blind to the order of the keys: with rotary positions, swapping the two
    tokens before the last one changes the last one's output."""
    model = GPT(LLAMA, seed=0, layers=range(0, 1))
    with torch.no_grad():
        model.blocks["0"].attn.qkv.weight.mul_(30.0)  # scores far from uniform at initialisation's scale
        a, b = model(torch.tensor([[3, 9, 7]])), model(torch.tensor([[9, 3, 7]]))
        model.blocks["0"].attn.qkv.weight[:64 + 32].zero_()  # q and k 0: uniform attention, order-blind
        c, d = model(torch.tensor([[3, 9, 7]])), model(torch.tensor([[9, 3, 7]]))
    assert (a[0, 2] - b[0, 2]).abs().max() > 1e-4  # small: the residual stream is mostly the embedding
    torch.testing.assert_close(c[0, 2], d[0, 2])


def test_stages_start_at_the_full_models_slice_and_chain_to_its_logits():
    full = GPT(LLAMA, seed=5)
    state = full.state_dict()
    x = tokens()
    with torch.no_grad():
        want, out = full(x), x
        for a, b in ((0, 3), (3, 4), (4, 8)):
            stage = GPT(LLAMA, range(a, b), seed=5)
            assert all(torch.equal(t, state[name]) for name, t in stage.state_dict().items())
            out = stage(out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: SDPA's own GQA path runs on an accelerator"))])
def test_grouped_query_attention_is_attention_with_each_kv_head_repeated_for_consecutive_query_heads(device):
    """kv head j serves query heads 2j and 2j+1: a model with 4 kv heads holding each of the 2 twice, in
    that order, computes the same logits (on the CPU k and v are repeated; on CUDA SDPA's GQA path runs)."""
    gqa = GPT(LLAMA, seed=1).to(device)
    mha_shape = dataclasses.replace(LLAMA, num_kv_heads=4)
    mha = GPT(mha_shape, device="meta").to_empty(device=device)
    state = gqa.state_dict()
    for i in range(LLAMA.num_layers):
        q, k, v = state[f"blocks.{i}.attn.qkv.weight"].split((64, 32, 32))
        heads = lambda t: t.view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)  # noqa: E731
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, heads(k), heads(v)])
    mha.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(mha(tokens().to(device)), gqa(tokens().to(device)), rtol=0, atol=1e-5)
    assert gqa.num_parameters() < mha.num_parameters()


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_the_planners_parameter_count_is_the_models(name):
    shape = model_shape(name)
    assert parameter_count(shape) == GPT(shape, device="meta").num_parameters()


def test_preset_sizes():
    counts = {name: parameter_count(model_shape(name)) for name in ("gpt2", "llama-125m", "llama-1b")}
    assert counts["gpt2"] == 124_439_808 + 768 * 50257  # GPT-2's 124M, plus our untied head
    assert counts["llama-1b"] == 1_100_048_384  # TinyLlama-1.1B exactly (its head is untied too)
    assert 1.2e8 < counts["llama-125m"] < 1.4e8
    # llama-tiny by hand: 8 blocks of q,k,v 64·128, out 64², SwiGLU 3·64·192, two gains; embedding; norm, head
    assert parameter_count(model_shape("llama-tiny")) == 8 * (64 * 128 + 64 * 64 + 3 * 64 * 192 + 128) + 2 * 16384 + 64


def test_checkpointing_recomputes_the_same_gradients():
    x = tokens()
    grads = []
    for checkpointing in (False, True):
        model = GPT(LLAMA, seed=2, checkpointing=checkpointing)
        model(x).logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_bf16_autocast_runs_and_hands_fp32_on():
    out = GPT(LLAMA, range(0, 4), seed=0, precision="bf16")(tokens())
    assert out.dtype == torch.float32 and out.shape == (3, 16, 64)


def test_a_few_training_steps_reduce_the_loss():
    cfg = TrainConfig(model="llama-tiny", steps=12, global_batch_size=8, micro_batches=1, seq_len=32, device="cpu",
                      num_threads=1)
    losses = train_reference(cfg).losses
    assert losses[0] == pytest.approx(5.55, abs=0.15)  # ln 256 at the start
    assert max(losses[-3:]) < 0.85 * losses[0]
