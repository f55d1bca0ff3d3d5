"""prepare → train → export → transformers: a BPE tokenizer trained on a corpus the test writes, a model
trained on it by ``p2ptrain train``, exported, and loaded by ``transformers.GPT2LMHeadModel`` with our logits;
the llama family exported as ``LlamaForCausalLM`` and GPT-2's tanh GELU as ``gelu_new``, both read back by
``HFCheckpoint``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from p2ptrain.cli import main
from p2ptrain.export import build_model, export_checkpoint, gather_checkpoint
from p2ptrain.model.gpt import GPT
from p2ptrain.model.hf_checkpoint import HFCheckpoint
from p2ptrain.model.stage import stage_state_dict
from p2ptrain.planning.model_shapes import model_shape
from p2ptrain.runtime.checkpoint import PARAM, save_stage

pytestmark = pytest.mark.integration

WORDS = "a lamp burned in the tower while the keeper wrote of ships and storms and the long grey sea".split()


def p2ptrain(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "p2ptrain", *args], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("roundtrip")
    rng = np.random.default_rng(0)
    (root / "corpus").mkdir()
    for k in range(4):
        (root / "corpus" / f"{k}.txt").write_text(" ".join(rng.choice(WORDS, size=3000)) + "\n")
    p2ptrain("data", "prepare", str(root / "corpus"), str(root / "data"), "--train-tokenizer", "320")
    run = json.loads(p2ptrain("train", "--data", str(root / "data"), "--steps", "4", "--seq-len", "32",
                              "--batch-size", "8", "--eval-every", "2", "--threads", "1", "--save",
                              str(root / "ckpt"), "--json").stdout)
    return root, run


def test_train_on_prepared_bpe_reports_validation_and_throughput(trained):
    root, run = trained
    vocab = json.loads((root / "data" / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    assert 300 < vocab <= 320  # training stops early when no pair is left to merge
    assert run["config"]["vocab_size"] == vocab and run["data_id"].startswith(f"bpe-{vocab}:")
    assert [step for step, _ in run["val_losses"]] == [2, 4] and run["val_losses"][1][1] < run["val_losses"][0][1]
    assert run["tokens_per_s"] > 0 and run["throughput"]["peak_source"] in ("measured", "datasheet")
    assert 0 < run["mfu"] < 1


def test_exported_model_gives_our_logits_in_transformers(trained):
    transformers = pytest.importorskip("transformers", reason="pip install '.[test]' (transformers) to load exports")
    root, _ = trained
    p2ptrain("export", str(root / "ckpt"), str(root / "hf"), "--data", str(root / "data"))
    assert {p.name for p in (root / "hf").iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(root / "hf")).eval()
    ours = build_model(gather_checkpoint(root / "ckpt"))
    tokens = torch.randint(0, ours.shape.vocab_size, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max() <= 1e-5
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "hf" / "tokenizer.json"))
    assert tokenizer.decode(tokenizer.encode("the keeper wrote")) == "the keeper wrote"


def test_generate_samples_from_the_checkpoint(trained):
    root, _ = trained
    args = ["generate", str(root / "ckpt"), "--data", str(root / "data"), "--prompt", "the keeper", "--tokens", "12"]
    first, again = (CliRunner().invoke(main, args, catch_exceptions=False) for _ in range(2))
    assert first.exit_code == again.exit_code == 0, first.output
    assert first.stdout.startswith("the keeper") and len(first.stdout) > len("the keeper\n")
    assert first.stdout == again.stdout  # seeded: the second draw is the first again


def test_stages_of_any_split_gather_into_the_same_export(trained, tmp_path):
    root, _ = trained
    whole = gather_checkpoint(root / "ckpt")
    layers = ((0, 3), (3, 8))
    for stage in range(2):
        part = stage_state_dict(whole.state, whole.shape, stage, 2, layers)
        save_stage(tmp_path / "ckpt", 9, stage, 2, whole.model, 0, {PARAM + k: v for k, v in part.items()})
    info = export_checkpoint(tmp_path / "ckpt" / "step-00000009", tmp_path / "hf")
    assert info["step"] == 9 and info["shape"]["vocab_size"] == whole.shape.vocab_size
    gathered = gather_checkpoint(tmp_path / "ckpt")
    assert gathered.state.keys() == whole.state.keys()
    assert all(torch.equal(gathered.state[k], whole.state[k]) for k in whole.state)


def test_bad_checkpoints_are_refused_in_one_line(tmp_path):
    """One real process (what a user sees on stderr), the other refusals in this one."""
    (tmp_path / "empty").mkdir()
    done = subprocess.run([sys.executable, "-m", "p2ptrain", "export", str(tmp_path / "empty"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    for args in (["export", str(tmp_path / "missing"), str(tmp_path / "out")],
                 ["generate", str(tmp_path / "empty"), "--prompt", "x"]):
        result = CliRunner().invoke(main, args, catch_exceptions=False)  # anything but a click error raises here
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert result.exit_code == 2 and len(errors) == 1, result.output


def perturbed(model: GPT, seed: int) -> dict[str, torch.Tensor]:
    """``model``'s parameters moved off their initial values (norm gains off 1), as training would."""
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


def test_llama_exports_as_llama_for_causal_lm_with_our_logits(tmp_path):
    transformers = pytest.importorskip("transformers", reason="pip install '.[test]' (transformers) to load exports")
    shape = model_shape("llama-tiny")
    state = perturbed(GPT(shape, seed=3), seed=4)
    for stage in range(2):
        part = stage_state_dict(state, shape, stage, 2)
        save_stage(tmp_path / "ckpt", 5, stage, 2, "llama-tiny", 3, {PARAM + k: v for k, v in part.items()})
    info = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert info["architecture"] == "LlamaForCausalLM" and info["shape"]["family"] == "llama"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["num_key_value_heads"], config["intermediate_size"]) == ("llama", 2, 192)
    assert not config["tie_word_embeddings"] and not config["attention_bias"] and not config["mlp_bias"]
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours = build_model(gather_checkpoint(tmp_path / "ckpt"))
    tokens = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max() <= 1e-5
    back = HFCheckpoint.open(tmp_path / "hf")  # the reader is export's inverse
    assert back.shape == shape and not back.tied
    assert all(torch.equal(t, state[k]) for k, t in back.tensors(state).items())


def test_gelu_new_exports_as_gpt2s_activation_with_our_logits(tmp_path):
    """A run of preset tiny started from GPT-2 weights computes gelu_new (its manifest says so): the export
    says so too."""
    transformers = pytest.importorskip("transformers", reason="pip install '.[test]' (transformers) to load exports")
    shape = dataclasses.replace(model_shape("tiny"), activation="gelu_new")
    ours = GPT(shape, seed=0)
    ours.load_state_dict(perturbed(ours, seed=1))
    save_stage(tmp_path / "ckpt", 2, 0, 1, "tiny", 0, {PARAM + k: v for k, v in ours.state_dict().items()},
               shape=shape)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["activation_function"] == "gelu_new"
    assert gather_checkpoint(tmp_path / "ckpt").shape == shape
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours.eval()(tokens)).abs().max() <= 1e-5
    back = HFCheckpoint.open(tmp_path / "hf")
    assert back.shape == shape and not back.tied
    assert all(torch.equal(t, ours.state_dict()[k]) for k, t in back.tensors(ours.state_dict()).items())
