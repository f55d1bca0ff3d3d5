"""``--init-from``: a run starts from a Hugging Face folder that ``transformers`` wrote (GPT-2 with its tanh
GELU and tied head, LLaMA; a preset's shape or one no preset has) or from one of our checkpoints, at the loss
``transformers`` computes for the first batch; the result exports and loads back; what does not fit is refused
in one line, exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers
from click.testing import CliRunner

from p2ptrain.cli import main
from p2ptrain.export import build_model, gather_checkpoint
from p2ptrain.model.tokenizer import train_bpe
from p2ptrain.planning.model_shapes import ModelShape, model_shape
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import build_data

FLAGS = ["--steps", "3", "--batch-size", "4", "--micro-batches", "2", "--device", "cpu", "--threads", "1", "--json"]


@pytest.fixture(autouse=True)
def _cublas_variable_already_set(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def invoke(*args: str):
    return CliRunner().invoke(main, ["-q", *args], catch_exceptions=False)


def hf_folder(tmp_path, family: str, s=None):
    """A transformers model of the tiny preset's (or llama-tiny's) sizes, or of shape ``s``, its config's defaults
    otherwise (GPT-2: gelu_new, a tied head; LLaMA: a tied head too), saved as safetensors; and the model."""
    torch.manual_seed(1)
    if family == "gpt2":
        s = s or model_shape("tiny")
        config = transformers.GPT2Config(vocab_size=s.vocab_size, n_positions=s.seq_len, n_embd=s.hidden_size,
                                         n_layer=s.num_layers, n_head=s.num_heads)
        model = transformers.GPT2LMHeadModel(config)
    else:
        s = s or model_shape("llama-tiny")
        config = transformers.LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                                          intermediate_size=s.ffn_hidden_size, num_hidden_layers=s.num_layers,
                                          num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                                          max_position_embeddings=s.seq_len, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
    folder = tmp_path / f"hf-{family}"
    model.save_pretrained(folder)
    return folder, model.eval()


def first_loss(model, preset: str) -> float:
    """transformers' mean cross-entropy on the run's first global batch."""
    rows = build_data(TrainConfig(model=preset, global_batch_size=4, micro_batches=2)).global_batch(0)
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)))


@pytest.mark.parametrize("family, preset", [("gpt2", "tiny"), ("llama", "llama-tiny")])
def test_a_run_starts_at_transformers_loss_and_its_export_loads_back(tmp_path, family, preset):
    folder, hf = hf_folder(tmp_path, family)
    result = invoke("train", "--model", preset, "--init-from", str(folder), "--save", str(tmp_path / "ckpt"), *FLAGS)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["losses"][0] == pytest.approx(first_loss(hf, preset), abs=1e-5)
    assert document["config"]["init_from"] == str(folder)
    if family == "gpt2":
        assert document["config"]["activation"] is None  # unsaid: the checkpoint's was taken
    out = tmp_path / "out"
    assert invoke("export", str(tmp_path / "ckpt"), str(out)).exit_code == 0
    cls = transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM
    back = cls.from_pretrained(out).eval()
    if family == "gpt2":
        assert back.config.activation_function == "gelu_new"  # exported as it was loaded
    ours = build_model(gather_checkpoint(tmp_path / "ckpt"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(back(input_ids=ids).logits, ours(ids), atol=1e-5)


# shapes no preset has: 6 blocks 384 wide (heads of 64), 64 positions, the built-in data's 256 byte tokens
CUSTOM = {"gpt2": ModelShape(num_layers=6, hidden_size=384, num_heads=6, seq_len=64, vocab_size=256),
          "llama": ModelShape(num_layers=6, hidden_size=384, num_heads=6, seq_len=64, vocab_size=256, family="llama",
                              num_kv_heads=2, ffn_hidden_size=1024)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, preset", [("gpt2", "tiny"), ("llama", "llama-tiny")])
def test_a_shape_no_preset_has_trains_alone_and_in_two_by_two_workers_and_exports_back(tmp_path, family, preset):
    """The folder's shape is trained (the preset gives the family's recipe): the first loss is transformers',
    the 2 × 2 workers' losses are the single process's, and the export loads back with the same logits."""
    folder, hf = hf_folder(tmp_path, family, CUSTOM[family])
    single = invoke("train", "--model", preset, "--init-from", str(folder), "--save", str(tmp_path / "ckpt"), *FLAGS)
    assert single.exit_code == 0, single.output
    single = json.loads(single.stdout)
    assert single["losses"][0] == pytest.approx(first_loss(hf, preset), abs=1e-5)
    split = subprocess.run([sys.executable, "-m", "p2ptrain", "-q", "train", "--model", preset, "--init-from",
                            str(folder), *FLAGS, "--stages", "2", "--replicas", "2"],
                           capture_output=True, text=True, timeout=240)
    assert split.returncode == 0, split.stderr[-3000:]
    split = json.loads(split.stdout)
    assert split["replicas_identical"] is True
    for got, want in zip(split["losses"], single["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (split["losses"], single["losses"])
    out = tmp_path / "out"
    assert invoke("export", str(tmp_path / "ckpt"), str(out)).exit_code == 0
    back = (transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM).from_pretrained(out)
    ours = build_model(gather_checkpoint(tmp_path / "ckpt"))
    assert ours.shape.num_layers == 6 and ours.shape.hidden_size == 384
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(back.eval()(input_ids=ids).logits, ours(ids), atol=1e-5)


def test_a_run_starts_from_our_own_checkpoint(tmp_path):
    assert invoke("train", "--model", "tiny", "--save", str(tmp_path / "a"), *FLAGS).exit_code == 0
    trained = gather_checkpoint(tmp_path / "a")
    result = invoke("train", "--model", "tiny", "--init-from", str(tmp_path / "a"), *FLAGS)
    assert result.exit_code == 0, result.output
    rows = build_data(TrainConfig(global_batch_size=4, micro_batches=2)).global_batch(0)
    with torch.no_grad():
        logits = build_model(trained)(rows[:, :-1])
    want = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)))
    assert json.loads(result.stdout)["losses"][0] == pytest.approx(want, abs=1e-5)


def test_what_does_not_fit_is_refused_in_one_line(tmp_path):
    folder, _ = hf_folder(tmp_path, "gpt2")
    cases = {
        "not a folder": (["--model", "tiny", "--init-from", str(tmp_path / "nothing")], "not a folder"),
        "empty folder": (["--model", "tiny", "--init-from", str(tmp_path)], "neither a Hugging Face folder"),
        "other family": (["--model", "llama-tiny", "--init-from", str(folder)], "family gpt (the preset's: llama;"),
        "other activation": (["--model", "tiny", "--init-from", str(folder), "--config", str(tmp_path / "t.toml")],
                             "the checkpoint computes gelu_new, not the activation gelu asked for"),
        "longer sequences": (["--model", "tiny", "--init-from", str(folder), "--seq-len", "128"],
                             "has 64 learned positions"),
        "warm-up past the end": (["--model", "tiny", "--warmup-steps", "9"], "warmup_steps=9 exceeds the run's 3"),
    }
    (tmp_path / "t.toml").write_text('activation = "gelu"\n')
    pt = tmp_path / "pt"
    shutil.copytree(folder, pt)
    for f in pt.glob("*.safetensors"):
        f.unlink()
    torch.save({}, pt / "pytorch_model.bin")
    cases["no safetensors"] = (["--model", "tiny", "--init-from", str(pt)], "safetensors")
    tok = tmp_path / "tok"
    shutil.copytree(folder, tok)
    train_bpe(iter(["hello world"] * 20), 300).save(tok / "tokenizer.json")
    cases["other tokenizer"] = (["--model", "tiny", "--init-from", str(tok)],
                                "the data was not tokenized with the checkpoint's tokenizer")
    for name, (args, message) in cases.items():
        result = invoke("train", *args, *FLAGS)
        assert result.exit_code == 2, (name, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (name, result.output)
