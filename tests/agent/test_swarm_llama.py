"""The LLaMA-style family in a local swarm of real agents: the single-process losses (clipped, warm-up then
cosine, the preset's recipe), and its checkpoint exports as a ``LlamaForCausalLM`` with our logits."""

from __future__ import annotations

import pytest
import torch
import transformers
from agent_helpers import run_swarm

from p2ptrain.config import config_from_dict
from p2ptrain.export import build_model, export_checkpoint, gather_checkpoint
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration


@pytest.mark.timeout(420)
def test_a_llama_swarm_trains_like_one_process_and_exports(tmp_path):
    code, summary, stderr = run_swarm(tmp_path, "--agents", "4", "--stages", "2", "--steps", "6", "--scenario",
                                      "none", "--model", "llama-tiny", "--checkpoint-every", "3", timeout_s=360)
    assert code == 0 and summary is not None and summary["finished"], stderr[-3000:]
    cfg = config_from_dict(TrainConfig, summary["config"])
    assert cfg.shape.family == "llama" and cfg.optimizer.lr_schedule == "cosine" and cfg.optimizer.clip > 0
    reference = train_reference(cfg)
    assert max(reference.grad_norms) > cfg.optimizer.clip  # the clip acted
    assert summary["losses"] == pytest.approx(reference.losses, rel=1e-4)
    gathered = gather_checkpoint(tmp_path / "checkpoints")
    assert gathered.step == 6
    export_checkpoint(tmp_path / "checkpoints", tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, build_model(gathered)(ids), atol=1e-5)
