"""What keeping a stage's state after every step costs a GPU trainer (``agent.stage_state.StateKeeper``):
a training step of one GPT-3 XL stage (1/8 of the model, 151 M parameters; 2 sequences of 2048 tokens)
alone, with the keeper's queued copy into pinned host memory (on a stream of its own, beside the next step),
and with a synchronous copy (how the keeper copied before). Side by side in one run, the mean of 6 steps in
a row after one, twice.

    python3 benchmarks/keeper_copy.py        # needs CUDA (benchmarks/cuda_check.sh runs it)
"""

import time

import torch

from p2ptrain.agent.churn.stage_state import StateKeeper
from p2ptrain.model.optim import build_optimizer
from p2ptrain.model.stage import build_stage
from p2ptrain.planning.model_shapes import model_shape
from p2ptrain.runtime.checkpoint import state_tensors
from p2ptrain.runtime.config import TrainConfig


def main() -> None:
    module = build_stage(model_shape("gpt3-xl"), 1, 8, 0, "cuda")
    optimizer = build_optimizer(module, TrainConfig().optimizer)
    x = torch.randn(2, 2048, 2048, device="cuda", requires_grad=True)
    keeper = StateKeeper(2)
    keeper.reset(1, 8, 0, {})
    step = 0

    def step_s(mode: str, n: int = 6) -> float:
        """Seconds a step, over ``n`` steps in a row after one (a copy may run beside the next step)."""
        nonlocal step
        for k in range(n + 1):
            if k == 1:
                torch.cuda.synchronize()
                started = time.perf_counter()
            out = module(x)
            out.backward(torch.ones_like(out))
            keeper.fence()  # as the trainer does before its update (``StageExecutor.before_update``)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if mode == "queued":
                keeper.record(step, module, optimizer)
            elif mode == "synchronous":
                state_tensors(module, optimizer)
        torch.cuda.synchronize()
        return (time.perf_counter() - started) / n

    parameters = sum(p.numel() for p in module.parameters())
    print(f"{torch.cuda.get_device_name(0)}: GPT-3 XL stage 1 of 8, {parameters / 1e6:.0f} M parameters")
    for _ in range(2):
        alone = step_s("none")
        queued, synchronous = step_s("queued"), step_s("synchronous")
        print(f"step alone {alone:.3f} s; with the queued copy {queued:.3f} s ({queued / alone:.2f}x); "
              f"with a synchronous copy {synchronous:.3f} s ({synchronous / alone:.2f}x)")
    started = time.perf_counter()
    keeper.get(1, 8, keeper.latest_step)
    print(f"reading the last kept state waited {time.perf_counter() - started:.3f} s")


if __name__ == "__main__":
    main()
