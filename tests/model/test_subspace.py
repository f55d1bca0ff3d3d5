"""The subspace-constrained residual stream (``model.subspace``): stage boundaries carry k values a token both
ways, any split computes exactly what the full model computes, the export absorbs it into ordinary weights
that transformers runs with our logits, and bad settings are refused in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from p2ptrain.export import build_model, export_checkpoint, gather_checkpoint
from p2ptrain.model.gpt import GPT
from p2ptrain.model.stage import build_stage, stage_state_dict
from p2ptrain.model.subspace import absorb, fixed_parts
from p2ptrain.planning.model_shapes import model_shape
from p2ptrain.planning.workload import parameter_count, workload_from_model
from p2ptrain.runtime.checkpoint import PARAM, save_stage
from p2ptrain.runtime.config import TrainConfig

K = 8


def subspace_shape(preset: str, k: int = K):
    return dataclasses.replace(model_shape(preset), subspace=k)


def perturbed(model: GPT, seed: int) -> dict[str, torch.Tensor]:
    """``model``'s parameters moved off their initial values, as training would."""
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_any_split_chains_to_the_full_model_bit_for_bit_with_k_values_a_token_both_ways(preset):
    shape = subspace_shape(preset)
    full = GPT(shape, seed=3)
    full.load_state_dict(perturbed(full, seed=4))
    tokens = torch.randint(0, shape.vocab_size, (2, shape.seq_len), generator=torch.Generator().manual_seed(5))
    targets = torch.randint(0, shape.vocab_size, tokens.shape, generator=torch.Generator().manual_seed(6))
    loss = torch.nn.functional.cross_entropy(full(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    want = dict(full.named_parameters())
    for layers in (((0, 3), (3, 8)), ((0, 1), (1, 5), (5, 8))):
        stages = [build_stage(shape, j, len(layers), seed=3, layers=layers) for j in range(len(layers))]
        for j, stage in enumerate(stages):
            stage.load_state_dict(stage_state_dict(full.state_dict(), shape, j, len(layers), layers))
        links, x = [], tokens
        for j, stage in enumerate(stages):  # each boundary a detached leaf, as its receiver holds it
            if j:
                x = x.detach().requires_grad_(True)
            y = stage(x, tokens)
            links.append((x, y))
            x = y
        for _, y in links[:-1]:
            assert y.shape == (2, shape.seq_len, K)  # k values a token go forward
        staged = torch.nn.functional.cross_entropy(links[-1][1].flatten(0, 1), targets.flatten())
        assert torch.equal(staged, loss)
        staged.backward()
        for j in range(len(stages) - 2, -1, -1):  # back down: each stage's output gradient is what the next sent
            sent = links[j + 1][0].grad
            assert sent.shape == (2, shape.seq_len, K)  # k values a token come back
            links[j][1].backward(sent)
        for stage in stages:
            for name, p in stage.named_parameters():
                assert torch.equal(p.grad, want[name].grad), name


def test_a_later_stage_without_the_token_ids_is_refused_in_one_line():
    stage = build_stage(subspace_shape("tiny"), 1, 2, seed=0)
    with pytest.raises(ValueError, match="token ids"):
        stage(torch.zeros(1, 8, K))
    with pytest.raises(ValueError, match="do not match"):
        stage(torch.zeros(1, 8, K), torch.zeros(1, 7, dtype=torch.long))


def test_the_fixed_parts_are_the_shapes_own_and_no_state():
    shape = subspace_shape("tiny")
    a, b = fixed_parts(shape), fixed_parts(shape)
    assert all(torch.equal(a[k], b[k]) for k in a) and a["basis"].shape == (64, K)
    model = GPT(shape, seed=1)
    assert not any(k.startswith("subspace.") for k in model.state_dict())  # never checkpointed nor sent
    assert model.state_dict()["tok_emb.weight"].shape == (256, K)
    assert torch.equal(model.subspace.basis, a["basis"]) and torch.equal(GPT(shape, seed=2).subspace.token, a["token"])


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "small"])
def test_parameter_count_and_the_planners_boundary_volume_follow_the_subspace(preset):
    shape = subspace_shape(preset)
    assert parameter_count(shape) == GPT(shape, device="meta").num_parameters()
    plain = workload_from_model(model_shape(preset), num_stages=2, num_replicas=2)
    sub = workload_from_model(shape, num_stages=2, num_replicas=2)
    assert sub.activation_gb == pytest.approx(plain.activation_gb * K / shape.hidden_size)


@pytest.mark.parametrize("preset, architecture", [("tiny", "GPT2LMHeadModel"), ("llama-tiny", "LlamaForCausalLM")])
def test_the_export_absorbs_the_subspace_and_transformers_gives_our_logits(preset, architecture, tmp_path):
    transformers = pytest.importorskip("transformers", reason="pip install '.[test]' (transformers) to load exports")
    shape = subspace_shape(preset)
    state = perturbed(GPT(shape, seed=3), seed=4)
    for stage in range(2):
        part = stage_state_dict(state, shape, stage, 2)
        save_stage(tmp_path / "ckpt", 5, stage, 2, preset, 3, {PARAM + k: v for k, v in part.items()}, shape)
    ours = build_model(gather_checkpoint(tmp_path / "ckpt"))
    assert ours.shape.subspace == K
    info = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert info["architecture"] == architecture and info["shape"]["subspace"] == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config.get("n_embd", config.get("hidden_size")) == shape.hidden_size
    theirs = getattr(transformers, architecture).from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max() <= 1e-5
    plain_state, plain = absorb(state, shape)
    assert plain == dataclasses.replace(shape, subspace=0)
    assert plain_state["blocks.0.attn.proj.weight"].shape == (shape.hidden_size, shape.hidden_size)


def test_bad_subspace_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="subspace must be 0 .* below hidden_size 64"):
        TrainConfig(subspace=64)
    (tmp_path / "hf").mkdir()
    with pytest.raises(ValueError, match="init_from"):
        TrainConfig(subspace=8, init_from=str(tmp_path / "hf"))
    assert TrainConfig(subspace=8).shape.boundary_width == 8 and TrainConfig().shape.boundary_width == 64
