"""Stages: the partition rule, per-name initialisation, chaining, and state dict slices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2ptrain.model.gpt import GPT
from p2ptrain.model.stage import build_stage, stage_layer_range, stage_state_dict
from p2ptrain.planning.model_shapes import model_shape

TINY = dataclasses.replace(model_shape("tiny"), seq_len=16)


@pytest.mark.parametrize("num_layers", [1, 2, 3, 7, 8, 12, 24])
def test_partition_covers_every_layer_once_in_order_and_balanced(num_layers):
    for num_stages in range(1, num_layers + 1):
        ranges = [stage_layer_range(num_layers, j, num_stages) for j in range(num_stages)]
        assert [layer for r in ranges for layer in r] == list(range(num_layers))
        sizes = [len(r) for r in ranges]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        assert sizes == sorted(sizes, reverse=True)  # the extra layers go to the front


def test_partition_examples_from_the_docstring():
    assert [len(stage_layer_range(24, j, 8)) for j in range(8)] == [3] * 8
    assert [stage_layer_range(8, j, 3) for j in range(3)] == [range(0, 3), range(3, 6), range(6, 8)]


@pytest.mark.parametrize("layers, stage, stages", [(8, 0, 9), (8, 0, 0), (8, 3, 3), (8, -1, 2)])
def test_impossible_partitions_are_refused(layers, stage, stages):
    with pytest.raises(ValueError):
        stage_layer_range(layers, stage, stages)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5, 8])
def test_stages_hold_the_full_models_parameters_under_the_same_names(num_stages):
    full = GPT(TINY, seed=7).state_dict()
    seen: set[str] = set()
    for j in range(num_stages):
        stage = build_stage(TINY, j, num_stages, seed=7)
        assert stage.has_embeddings == (j == 0) and stage.has_head == (j == num_stages - 1)
        state = stage.state_dict()
        assert not seen & set(state)
        seen |= set(state)
        for name, tensor in state.items():
            assert torch.equal(tensor, full[name]), name
    assert seen == set(full)


def test_a_middle_stage_holds_only_its_blocks():
    names = set(build_stage(TINY, 1, 3, seed=0, device="meta").state_dict())
    assert {name.split(".")[1] for name in names} == {"3", "4", "5"}
    assert all(name.startswith("blocks.") for name in names)


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_chained_stages_compute_the_full_models_logits(num_stages):
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(num_stages))
    with torch.no_grad():
        expected = GPT(TINY, seed=1)(tokens)
        x = tokens
        for j in range(num_stages):
            x = build_stage(TINY, j, num_stages, seed=1)(x)
            if j < num_stages - 1:
                assert x.shape == (2, 16, TINY.hidden_size)
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)


def test_state_dict_slices_load_into_stages_and_stages_merge_back():
    trained = GPT(TINY, seed=2).state_dict()  # stands for any full model's state
    merged = {}
    for j in range(4):
        stage = build_stage(TINY, j, 4, seed=99)  # other seed: loading must overwrite everything
        stage.load_state_dict(stage_state_dict(trained, TINY, j, 4), strict=True)
        merged.update(stage.state_dict())
    full = GPT(TINY, seed=99)
    full.load_state_dict(merged, strict=True)
    assert all(torch.equal(full.state_dict()[k], trained[k]) for k in trained)


def test_slicing_a_state_dict_that_lacks_the_stages_entries_fails():
    with pytest.raises(KeyError, match="lacks"):
        stage_state_dict({}, TINY, 0, 2)


@pytest.mark.parametrize("layers", [((0, 1), (1, 8)), ((0, 6), (6, 7), (7, 8)), ((0, 2), (2, 3), (3, 4), (4, 8))])
def test_uneven_splits_chain_to_the_full_model_and_hold_their_blocks(layers):
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = GPT(TINY, seed=1)(tokens)
        x = tokens
        for j, (a, b) in enumerate(layers):
            stage = build_stage(TINY, j, len(layers), seed=1, layers=layers)
            assert stage_layer_range(TINY.num_layers, j, len(layers), layers) == range(a, b)
            assert {int(k.split(".")[1]) for k in stage.state_dict() if k.startswith("blocks.")} == set(range(a, b))
            x = stage(x)
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)


def test_a_bad_split_is_refused_by_the_stage_and_the_train_config():
    from p2ptrain.runtime.config import TrainConfig

    with pytest.raises(ValueError, match="layers end at block 6 but the model has 8 blocks"):
        build_stage(TINY, 0, 2, seed=0, layers=((0, 3), (3, 6)))
    with pytest.raises(ValueError, match="one \\[first, end\\) range per stage \\(3\\)"):
        TrainConfig(stages=3, layers=((0, 3), (3, 8)))
    assert TrainConfig(stages=2, layers=[[0, 3], [3, 8]]).layers == ((0, 3), (3, 8))  # TOML lists become tuples
