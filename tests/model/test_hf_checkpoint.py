"""Hugging Face folders read back: transformers' GPT2LMHeadModel and LlamaForCausalLM saved to disk, read by
``HFCheckpoint`` into our GPT (whole, or one stage at a time) with transformers' logits; bad folders refused
in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from p2ptrain.model.gpt import GPT
from p2ptrain.model.hf_checkpoint import HFCheckpoint
from p2ptrain.planning.model_shapes import model_shape

transformers = pytest.importorskip("transformers", reason="pip install '.[test]' (transformers) to test HF folders")

LLAMA_THETA = 500.0  # not the default: the rotary base must come from the config


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn anew (norm gains around 1, biases around 0), so a name mixed up shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.1 * noise if ("ln" in name or "norm" in name) and name.endswith("weight") else 0.05 * noise)
    return model.eval()


def gpt2_model() -> torch.nn.Module:
    tiny = model_shape("tiny")
    config = transformers.GPT2Config(n_layer=tiny.num_layers, n_embd=tiny.hidden_size, n_head=tiny.num_heads,
                                     n_positions=tiny.seq_len, vocab_size=tiny.vocab_size, bos_token_id=0,
                                     eos_token_id=0)  # gelu_new and a tied head, as GPT-2 has
    return randomised(transformers.GPT2LMHeadModel(config), 0)


def llama_model(tied: bool) -> torch.nn.Module:
    s = model_shape("llama-tiny")
    config = transformers.LlamaConfig(
        num_hidden_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads, intermediate_size=s.ffn_hidden_size, vocab_size=s.vocab_size,
        max_position_embeddings=s.seq_len, rms_norm_eps=s.norm_eps, rope_theta=LLAMA_THETA,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    return randomised(transformers.LlamaForCausalLM(config), 1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder, transformers' model) for a GPT-2 and a tied and an untied Llama."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, model in (("gpt2", gpt2_model()), ("llama", llama_model(False)), ("llama-tied", llama_model(True))):
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


def our_model(ckpt: HFCheckpoint, layers: range | None = None) -> GPT:
    model = GPT(ckpt.shape, layers, device="meta").to_empty(device="cpu")
    model.load_state_dict(ckpt.tensors(name for name, _ in model.named_parameters()))
    return model.eval()


def batch(seq: int = 64) -> torch.Tensor:
    return torch.randint(0, 256, (3, seq), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-tied"])
def test_our_model_from_the_folder_gives_transformers_logits(folders, name):
    folder, theirs = folders[name]
    ckpt = HFCheckpoint.open(folder)
    if name == "gpt2":
        assert ckpt.architecture == "GPT2LMHeadModel"
        assert ckpt.shape == dataclasses.replace(model_shape("tiny"), activation="gelu_new")
    else:
        assert ckpt.architecture == "LlamaForCausalLM"
        assert ckpt.shape == dataclasses.replace(model_shape("llama-tiny"), rope_theta=LLAMA_THETA)
    assert ckpt.tied == (name != "llama")
    assert any("tied" in note for note in ckpt.notes()) == ckpt.tied
    ours = our_model(ckpt)
    with torch.no_grad():
        assert (ours(batch()) - theirs(batch()).logits).abs().max() <= 1e-5
    if ckpt.tied:  # untied on load: the head is a copy, not the embedding itself
        assert torch.equal(ours.head.weight, ours.tok_emb.weight)
        assert ours.head.weight.data_ptr() != ours.tok_emb.weight.data_ptr()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_two_stages_load_only_their_names_and_chain_to_the_same_logits(folders, name):
    folder, theirs = folders[name]
    ckpt = HFCheckpoint.open(folder)
    first, second = our_model(ckpt, range(0, 3)), our_model(ckpt, range(3, 8))
    assert not any(n.startswith("blocks.3.") for n in ckpt.tensors(n for n, _ in first.named_parameters()))
    with torch.no_grad():
        assert (second(first(batch(20))) - theirs(batch(20)).logits).abs().max() <= 1e-5


def test_sharded_bf16_folder(folders, tmp_path):
    _, theirs = folders["llama"]
    theirs.to(torch.bfloat16).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    theirs.float()
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ckpt = HFCheckpoint.open(tmp_path / "sharded")
    assert any("bfloat16" in note for note in ckpt.notes())
    tensors = ckpt.tensors(["blocks.7.attn.qkv.weight", "head.weight"])
    assert all(t.dtype == torch.float32 for t in tensors.values())
    want = torch.cat([theirs.model.layers[7].self_attn.q_proj.weight, theirs.model.layers[7].self_attn.k_proj.weight,
                      theirs.model.layers[7].self_attn.v_proj.weight]).bfloat16().float()
    assert torch.equal(tensors["blocks.7.attn.qkv.weight"], want)


def test_digest_and_tokenizer(folders, tmp_path):
    folder, _ = folders["gpt2"]
    copy = shutil.copytree(folder, tmp_path / "copy")
    ckpt = HFCheckpoint.open(folder)
    assert len(ckpt.digest) == 64 and ckpt.digest == HFCheckpoint.open(copy).digest
    assert ckpt.digest != HFCheckpoint.open(folders["llama"][0]).digest
    assert ckpt.tokenizer_file is None
    (copy / "tokenizer.json").write_text("{}")
    assert HFCheckpoint.open(copy).tokenizer_file == copy / "tokenizer.json"


def test_keys_without_the_transformer_prefix_are_read(folders, tmp_path):
    folder, theirs = folders["gpt2"]
    copy = shutil.copytree(folder, tmp_path / "bare")
    state = load_file(copy / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in state.items()}, copy / "model.safetensors")
    with torch.no_grad():
        assert (our_model(HFCheckpoint.open(copy))(batch()) - theirs(batch()).logits).abs().max() <= 1e-5


def test_a_tied_head_saved_under_the_heads_name_serves_as_the_embedding(folders, tmp_path):
    folder, theirs = folders["llama-tied"]
    copy = shutil.copytree(folder, tmp_path / "head-named")
    state = load_file(copy / "model.safetensors")
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, copy / "model.safetensors")
    with torch.no_grad():
        assert (our_model(HFCheckpoint.open(copy))(batch()) - theirs(batch()).logits).abs().max() <= 1e-5


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def drop_tensor(folder, key):
    state = load_file(folder / "model.safetensors")
    del state[key]
    save_file(state, folder / "model.safetensors")


BAD_CONFIGS = [
    ("gpt2", {"activation_function": "relu"}, "activation_function 'relu' is not supported"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx = true"),
    ("gpt2", {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn = true"),
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights = false"),
    ("gpt2", {"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "unsupported architecture BertForMaskedLM"),
    ("llama", {"attention_bias": True}, "attention_bias = true"),
    ("llama", {"mlp_bias": True}, "mlp_bias = true"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling of type 'linear'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_parameters of type 'llama3'"),
    ("llama", {"head_dim": 32}, "head_dim 32"),
    ("llama", {"num_key_value_heads": 3}, "must divide num_heads"),
    ("llama", {"hidden_size": "wide"}, "hidden_size must be an integer"),
]


@pytest.mark.parametrize("name, changes, message", BAD_CONFIGS)
def test_configs_we_do_not_build_are_refused_in_one_line(folders, tmp_path, name, changes, message):
    folder = shutil.copytree(folders[name][0], tmp_path / name)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=message) as error:
        HFCheckpoint.open(folder)
    assert "\n" not in str(error.value)


def test_bad_folders_are_refused_in_one_line(folders, tmp_path):
    gpt2 = folders["gpt2"][0]

    def refused(path, message, read=None):
        with pytest.raises(ValueError, match=message) as error:
            ckpt = HFCheckpoint.open(path)
            ckpt.tensors(read or ["tok_emb.weight"])
        assert "\n" not in str(error.value)

    refused(tmp_path / "missing", "is not a folder")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "has no config.json")
    bad_json = shutil.copytree(gpt2, tmp_path / "bad-json")
    (bad_json / "config.json").write_text("{not json")
    refused(bad_json, "is not valid JSON")
    pytorch = tmp_path / "pytorch"
    pytorch.mkdir()
    shutil.copy(gpt2 / "config.json", pytorch)
    (pytorch / "pytorch_model.bin").write_bytes(b"")
    refused(pytorch, "does not read: convert them to safetensors")
    (pytorch / "pytorch_model.bin").unlink()
    refused(pytorch, r"has no \*.safetensors")
    missing = shutil.copytree(gpt2, tmp_path / "missing-tensor")
    drop_tensor(missing, "transformer.h.5.mlp.c_fc.bias")
    HFCheckpoint.open(missing).tensors(["blocks.4.mlp.fc.bias"])  # other tensors still load
    refused(missing, "lacks tensor transformer.h.5.mlp.c_fc.bias", ["blocks.5.mlp.fc.bias"])
    wrong = shutil.copytree(gpt2, tmp_path / "wrong-shape")
    edit_config(wrong, n_positions=32)
    refused(wrong, r"tensor transformer.wpe.weight .* has shape \[64, 64\], its config says \[32, 64\]", ["pos_emb.weight"])
    with pytest.raises(KeyError, match="is not a parameter"):
        HFCheckpoint.open(gpt2).tensors(["blocks.8.attn.qkv.weight"])
