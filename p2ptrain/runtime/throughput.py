"""Tokens per second and model FLOPs utilisation (MFU), as ``train``, ``agent`` and ``swarm`` report them.

Model FLOPs per trained token (PaLM's appendix B, the convention MFU comparisons use): ``6·N`` for the
matmuls of forward and backward over the ``N`` parameters that multiply (every parameter but the token and,
in the gpt family, position embeddings, which are lookups), plus ``12·L·T·h`` for attention's scores and
weighted sums (``L`` layers, sequence ``T``, width ``h``; causal masking not discounted). Activation
recomputation is not model FLOPs: checkpointing lowers MFU, as it should.

MFU = achieved model FLOP/s ÷ peak FLOP/s of the devices. The peak is the data sheet's dense tensor-core
figure for a known GPU at the run's precision (``DATASHEET_TFLOPS``), else the device's measured matmul
throughput (``p2ptrain.agent.profile``: float32 matmuls, the calibration every agent publishes). The report
says which (``peak_source``).
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.planning.model_shapes import ModelShape
from p2ptrain.planning.workload import embedding_parameters, parameter_count

# dense (no sparsity) peak TFLOP/s by (name fragment, precision); fp32 is the plain (non-TF32) rate
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0},
    "H100": {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0},
    "A100": {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0},
    "L40S": {"fp32": 91.6, "bf16": 362.0, "fp16": 362.0},
    "A10": {"fp32": 31.2, "bf16": 125.0, "fp16": 125.0},
    "V100": {"fp32": 15.7, "bf16": 15.7, "fp16": 125.0},
    "T4": {"fp32": 8.1, "bf16": 8.1, "fp16": 65.0},
}


def flops_per_token(shape: ModelShape) -> float:
    """Model FLOPs of training on one token (forward and backward): 6·N + 12·L·T·h."""
    matmul_parameters = parameter_count(shape) - embedding_parameters(shape)
    return 6.0 * matmul_parameters + 12.0 * shape.num_layers * shape.seq_len * shape.hidden_size


def peak_tflops(device_name: str, precision: str, measured_tflops: float | None) -> tuple[float | None, str]:
    """The peak to compare with and where it comes from: ``("datasheet"|"measured"|"unknown")``."""
    for fragment, peaks in DATASHEET_TFLOPS.items():
        if fragment in device_name.upper():
            return peaks[precision], "datasheet"
    if measured_tflops:
        return measured_tflops, "measured"
    return None, "unknown"


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    model_tflops: float  # achieved model TFLOP/s over all devices
    mfu: float | None  # model_tflops / (peak × devices); None without a peak
    peak_tflops: float | None  # per device
    peak_source: str

    def to_json(self) -> dict:
        return {"tokens_per_s": round(self.tokens_per_s, 1), "model_tflops": round(self.model_tflops, 4),
                "mfu": None if self.mfu is None else round(self.mfu, 5), "peak_tflops": self.peak_tflops,
                "peak_source": self.peak_source}

    def line(self) -> str:
        mfu = "n/a" if self.mfu is None else f"{100 * self.mfu:.2f} % of {self.peak_tflops:.3g} TFLOP/s ({self.peak_source})"
        return f"{self.tokens_per_s:,.0f} tokens/s, {self.model_tflops:.3f} model TFLOP/s, MFU {mfu}"


def throughput(shape: ModelShape, tokens: int, seconds: float, peak: tuple[float | None, str],
               num_devices: int = 1) -> Throughput:
    """``tokens`` trained in ``seconds`` on ``num_devices`` devices of ``peak`` (``peak_tflops``) each."""
    per_s = tokens / seconds if seconds > 0 else 0.0
    achieved = per_s * flops_per_token(shape) / 1e12
    tflops, source = peak
    mfu = achieved / (tflops * num_devices) if tflops else None
    return Throughput(per_s, achieved, mfu, tflops, source)
