"""Linear sketches of flat vectors, and the check of a summed shard against its contributors' sketches.

**The sketch.** ``sketch(x, seed, rows)`` is ``S·x`` for a ``rows × n`` matrix of random signs (Rademacher
±1): ``S[i, j]`` is bit ``i`` of ``H(seed, j)``, with ``H`` splitmix64's output function applied to the
counter ``j + 1`` (uint64 arithmetic in numpy, where it is defined to wrap), so one 64-bit word per element
serves up to 64 rows, any part of ``S`` can be made without the rest (``offset``), and every device, thread
count and library version makes the same matrix. ``S`` is never materialised: chunks of ``CHUNK`` elements
are grouped by each byte of their words (``numpy.bincount`` with float64 weights, summing in order) and
each byte value's 8 signs applied to its group's sum. The arithmetic is float64, so ``S·(a + b) = S·a + S·b``
to within ``sketch_rounding``: sums of ``CHUNK + 256 + chunks`` terms, each rounding at most 2^-53 of
``‖x‖₁ ≤ √n ‖x‖₂``.

**The check** (``check_sum``). The sharded all-reduce (``p2ptrain.runtime.allreduce``) sums shard ``k`` on
its owner: the owner adds the contributions ``c_r`` (the decoded messages of the others, its own shard raw)
in replica order in float32, encodes the sum plus its own error-feedback residual, and every member decodes
that message to ``D``. Each contributor knows exactly what the owner decoded from it, so after the step's
challenge seed is known it publishes ``Contribution(sketch(c_r), ‖c_r‖₂)``; a member holding ``D`` checks
``Δ = S·D − Σ_r S·c_r``. For an honest owner ``D − Σ_r c_r = v``, a vector fixed before the seed, with

* ``|v_j| ≤ slack_j``: the codec's error on the sum (``bounds.error_bound`` of the reduced message) plus, per
  step, the owner's previous residual (``error_bound`` of its previous reduced message of the same shard in
  the same epoch; 0 at an epoch's first step), which nobody else knows;
* plus float32 summation: ``n − 1`` additions in replica order, each rounding by at most 2^-24 of the
  partial sum, so ``|f_j| ≤ γ_{n−1} Σ_r |c_{r,j}|`` (Higham, (4.4)) and ``‖f‖₂ ≤ γ_{n−1} Σ_r ‖c_r‖₂``.

So ``‖v‖₂ ≤ V = ‖slack‖₂ + γ_{n−1} Σ_r ‖c_r‖₂`` (triangle inequality). Deterministic bounds on a row of
``S·v`` (Cauchy–Schwarz ``√n·‖v‖₂``, Hölder ``‖v‖₁``) grow with √n and would hide any corruption of a large
shard; what makes the check sharp is that the signs are unknown when ``v`` is fixed. A Rademacher row gives
``E exp(θ⟨s, v⟩) ≤ exp(θ²‖v‖²/2)`` (Hoeffding's lemma), hence ``E exp(λ⟨s, v⟩²) ≤ E exp(λ‖v‖² g²)`` for a
standard normal ``g`` (write ``exp(λy²) = E_g exp(√(2λ) g y)``): ``‖S·v‖²`` is dominated in its moment
generating function by ``‖v‖² χ²_k``, and the Chernoff bound that gives Laurent–Massart's tail applies:

    P( ‖S·v‖² ≥ ‖v‖² · (k + 2√(k·t) + 2t) ) ≤ e^−t.

With ``t = ln(1/false_alarm)`` the statistic ``‖Δ‖₂/√k`` exceeds ``√((k + 2√(kt) + 2t)/k) · V`` plus the
sketches' own float64 rounding with probability at most ``false_alarm`` (2^-40 by default), for every honest
owner, whatever its data: that sum is the ``tolerance``. A statistic above it blames the owner, or the
contributor whose sketch is wrong (the owner holds every message it summed and checks their sketches exactly;
a committed message, revealed, settles it: ``commit``).

A corruption ``d`` of the reduced shard adds ``S·d``; for ``d`` spread over many elements ``‖S·d‖²`` is close to
``‖d‖² χ²_k``, so it is caught with probability at least ``P(χ²_k > k (τ + τ_v)² / ‖d‖²)``, ``τ_v ≤ τ`` the honest
part's share (``detection_probability``). Corruptions inside the codec's own error are invisible by any check
of the sum: per step, an owner may move each element by up to ``slack_j`` (the previous-residual term is its
word). ``RunningSum`` removes that term: checking the sums since the epoch began (``Σ_u D_u`` against each
contributor's ``Σ_u c_{r,u}``), error feedback telescopes, ``Σ_u D_u − Σ_u s_u = −e_t``, and only the present
message's bound and the accumulated float32 roundings remain, so a bias repeated every step grows against a
fixed tolerance (the cost: a float64 running copy of the shards a member contributes to and checks).

**The seed** must be unknown to a sender when it sends (``challenge_seed``): a sender that knew ``S`` could add
any corruption in its null space.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

SKETCH_ROWS = 32  # rows k: 256 bytes per sketch; one 64-bit word per element serves up to 64
MAX_ROWS = 64
CHUNK = 1 << 16  # elements per chunk of the sign matrix
TEMP_BYTES = 1 << 28  # an accelerator's sketch: the most its signs and signed copies of one vector take at once
FALSE_ALARM = 2.0**-40  # the probability an honest check fails, at most, whatever the data
_U64 = 2.0**-53  # float64's unit roundoff
_U32 = 2.0**-24
_GAMMA, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SIGNS = np.array([[1.0 - 2.0 * ((value >> bit) & 1) for bit in range(8)] for value in range(256)])  # [256, 8]


def challenge_seed(run_id: str, step: int, digests: Iterable[bytes], salts: Iterable[bytes] = ()) -> int:
    """The step's 64-bit challenge seed: SHA-256 of the run, the step and every digest committed for the step
    (``commit.message_digest`` of every message of the step, sorted, so their order does not matter).

    It is fixed only once the last message is committed, so no sender knows it when it sends. The last sender to
    commit could try many variants of its message until the seed suits it (grinding); ``salts`` (nonces the
    verifiers committed to beforehand and reveal after the digests) take that away."""
    digests = sorted(bytes(d) for d in digests)
    if not digests or any(len(d) != 32 for d in digests):
        raise ValueError("challenge_seed needs the step's SHA-256 digests (32 bytes each), at least one")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    h = hashlib.sha256(b"p2ptrain.verify.challenge\0" + run_id.encode() + b"\0" + struct.pack("<Q", step))
    for d in digests:
        h.update(d)
    for salt in sorted(bytes(s) for s in salts):
        h.update(struct.pack("<I", len(salt)) + salt)
    return int.from_bytes(h.digest()[:8], "little")


def derive_seed(seed: int, *labels: int | str) -> int:
    """An independent 64-bit seed for one use of a challenge (e.g. ``("reduce", bucket, shard)``)."""
    _check_seed(seed)
    text = "\0".join(str(label) for label in labels).encode()
    return int.from_bytes(hashlib.sha256(struct.pack("<Q", seed) + text).digest()[:8], "little")


def sketch(x: torch.Tensor, seed: int, rows: int = SKETCH_ROWS, offset: int = 0,
           device: torch.device | str | None = None) -> torch.Tensor:
    """``S·x``, float64 ``[rows]`` on the CPU, for the sign matrix of ``seed`` (columns ``offset`` … ``offset +
    len(x) − 1``), computed where ``device`` says: an accelerator (``_sketch_on``: the same signs, float64 sums of
    at most ``CHUNK`` terms, then one per chunk, so within the same ``sketch_rounding``) or, by default, the CPU.

    ``x``: a 1-D finite float tensor on any device. ValueError (one line) otherwise."""
    return sketch_many([x], seed, rows, offset, device)[0]


def sketch_many(xs: Sequence[torch.Tensor], seed: int, rows: int = SKETCH_ROWS, offset: int = 0,
                device: torch.device | str | None = None) -> list[torch.Tensor]:
    """``[sketch(x, seed, rows, offset, device) for x in xs]`` for vectors of one length (bit for bit on the CPU;
    on an accelerator within the same ``sketch_rounding``): the sign
    matrix is made once for all of them (its words are half of a CPU sketch's time; on an accelerator, one set
    of kernels for the signs and one wait for every sketch). A check sketches several vectors of a shard with
    one seed: the reduced shard, each contribution and their running sums."""
    _check_seed(seed)
    if not isinstance(rows, int) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"a sketch has 1 to {MAX_ROWS} rows, got {rows!r}")
    for x in xs:
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.dtype.is_floating_point:
            raise ValueError(f"sketch takes a 1-D float tensor, got {_describe(x)}")
    if len({x.numel() for x in xs}) > 1:
        raise ValueError(f"sketch_many takes vectors of one length, got {sorted({x.numel() for x in xs})}")
    if offset < 0:
        raise ValueError(f"offset must be non-negative, got {offset}")
    if not xs:
        return []
    if device is not None and torch.device(device).type != "cpu":
        return _sketch_on(xs, seed, rows, offset, torch.device(device))
    # as they are, each chunk widened to float64 once (bincount sums its weights in float64 whatever their type,
    # but widens float32 weights at every call: 4 times a chunk, 2.8x the time of the whole sketch); half-precision
    # types have no numpy twin and widen to float32 first, exactly
    values = [x.detach().to("cpu", x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32).numpy()
              for x in xs]
    planes = -(-rows // 8)
    out = np.zeros((len(values), planes, 8))
    for start in range(0, values[0].size, CHUNK):
        count = min(CHUNK, values[0].size - start)
        words = _words(seed, offset + start, count).view(np.uint8).reshape(count, 8)
        columns = np.ascontiguousarray(words[:, :planes].T)  # byte p of each word: the signs of rows 8p … 8p + 7
        for i, v in enumerate(values):
            weights = np.asarray(v[start: start + count], dtype=np.float64)
            for plane in range(planes):
                out[i, plane] += np.bincount(columns[plane], weights=weights, minlength=256) @ _SIGNS
    if not np.isfinite(out).all():  # a NaN or an infinity anywhere in a vector reaches its sketch's sums
        raise ValueError("sketch of a vector with NaN or infinite values")
    return [torch.from_numpy(o.reshape(-1)[:rows].copy()) for o in out]


def _sketch_on(xs: Sequence[torch.Tensor], seed: int, rows: int, offset: int, device: torch.device) -> list[torch.Tensor]:
    """``sketch_many`` on an accelerator: the words of every chunk at once (``_words_torch``, the same bits as
    ``_words``), then, for as many rows at a time as ``TEMP_BYTES`` allows, their signs and each vector's
    float64 sums per chunk of ``CHUNK`` elements, then over the chunks (the CPU's order of sums, so within the
    same ``sketch_rounding``): a few kernels per group of rows and vector, none per chunk (a loop over the
    chunks of a `gpt2` stage's shards launched tens of thousands of kernels a step: 9.6 s of a 12.2 s step on an
    H200); one wait for them all. Each vector's sums are the same operations whatever the others: the same bits
    alone or together."""
    numel = xs[0].numel()
    chunks = -(-numel // CHUNK)
    padded = torch.zeros(len(xs), chunks, CHUNK, dtype=torch.float64, device=device)  # zeros add nothing, exactly
    for i, x in enumerate(xs):
        padded[i].view(-1)[:numel] = x.detach().to(device, torch.float64)
    words = _words_torch(seed, offset, chunks * CHUNK, device).view(1, chunks, CHUNK)
    group = max(1, min(rows, TEMP_BYTES // (9 * chunks * CHUNK)))  # a bool and a float64 per element and row
    out = torch.empty(len(xs), rows, dtype=torch.float64, device=device)
    for first in range(0, rows, group):
        shifts = torch.arange(first, min(rows, first + group), dtype=torch.int64, device=device).view(-1, 1, 1)
        negative = ((words >> shifts) & 1).bool()  # [group, chunks, CHUNK]: bit i of each word, row i's sign
        for i in range(len(xs)):
            block = padded[i]
            out[i, first: first + group] = torch.where(negative, -block, block).sum(dim=2).sum(dim=1)
    out = out.cpu()  # the one wait for the device
    if not bool(torch.isfinite(out).all()):  # float64 sums of float32 values overflow nowhere: x was not finite
        raise ValueError("sketch of a vector with NaN or infinite values")
    return [row.clone() for row in out]


def _signed(value: int) -> int:
    """A uint64 constant as the int64 of the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _words_torch(seed: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """``_words`` in int64 tensors (two's complement: products and sums wrap as uint64's do; a logical right
    shift is the arithmetic one with the sign's copies masked off): the same 64 bits per element."""

    def shifted(z: torch.Tensor, bits: int) -> torch.Tensor:
        return (z >> bits) & ((1 << (64 - bits)) - 1)

    z = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device) * _signed(int(_GAMMA))
    z = z + _signed(seed)
    z = z ^ shifted(z, 30)
    z = z * _signed(int(_MIX1))
    z = z ^ shifted(z, 27)
    z = z * _signed(int(_MIX2))
    return z ^ shifted(z, 31)


def sketch_rounding(numel: int) -> float:
    """``ρ / ‖x‖₂``: how far float64 rounding may move each entry of ``sketch(x)`` of ``numel`` elements."""
    terms = CHUNK + 256 + -(-numel // CHUNK)
    return _gamma(terms, _U64) * math.sqrt(max(numel, 1))


def _words(seed: int, start: int, count: int) -> np.ndarray:
    """splitmix64's outputs for counters ``start + 1 … start + count`` from state ``seed``."""
    z = np.arange(start + 1, start + count + 1, dtype=np.uint64) * _GAMMA + np.uint64(seed)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z.astype("<u8", copy=False)


@dataclass(frozen=True)
class Contribution:
    """What a contributor publishes for one shard once the seed is known: ``S·c`` and ``‖c‖₂`` (for a running
    sum, ``Σ_u ‖c_u‖₂``), ``c`` what the owner decoded from it."""

    sketch: torch.Tensor  # float64 [rows]
    norm: float

    def __post_init__(self) -> None:
        s = self.sketch
        if not isinstance(s, torch.Tensor) or s.dim() != 1 or s.dtype != torch.float64 or not 1 <= s.numel() <= MAX_ROWS:
            raise ValueError(f"a contribution's sketch is float64 [1…{MAX_ROWS}], got {_describe(s)}")
        if not bool(torch.isfinite(s).all()) or not (math.isfinite(self.norm) and self.norm >= 0):
            raise ValueError("a contribution's sketch and norm must be finite, the norm non-negative")


def contribution(x: torch.Tensor, seed: int, rows: int = SKETCH_ROWS) -> Contribution:
    """The ``Contribution`` of vector ``x`` (1-D float)."""
    return Contribution(sketch(x, seed, rows), norm64(x))


def norm64(x: torch.Tensor) -> float:
    """``‖x‖₂`` summed in float64 (within the rounding ``sum_check.norm_ratio`` allows two machines' norms), without
    a float64 copy of ``x`` on a CPU (a copy and its norm took 10 ns an element, numpy's float64 dot 1.5)."""
    x = x.detach().reshape(-1)
    if x.device.type != "cpu":
        return float(torch.linalg.vector_norm(x, dtype=torch.float64))
    if x.dtype not in (torch.float32, torch.float64):
        x = x.to(torch.float32)  # exactly: half-precision types have no numpy twin
    a = x.numpy()
    return math.sqrt(float(np.einsum("i,i->", a, a, dtype=np.float64)))


class RunningSum:
    """The float64 sum of one shard's vectors since the epoch began (for ``check_sum`` over a window, see the
    module), with the sum of their norms and their count, in host memory; its sketches are made on ``device``."""

    def __init__(self, numel: int, device: torch.device | str | None = None):
        self.device = device
        self.total = torch.zeros(numel, dtype=torch.float64)
        self.norm = 0.0
        self.steps = 0

    def add(self, x: torch.Tensor) -> None:
        if x.dim() != 1 or x.numel() != self.total.numel():
            raise ValueError(f"running sum of {self.total.numel()} elements given {_describe(x)}")
        self.total += x.detach().to("cpu")
        self.norm += norm64(x)
        self.steps += 1

    def contribution(self, seed: int, rows: int = SKETCH_ROWS) -> Contribution:
        return Contribution(sketch(self.total, seed, rows, device=self.device), self.norm)


@dataclass(frozen=True)
class SumCheck:
    """``statistic = ‖S·total − Σ_r sketch_r‖₂ / √k``; the check fails when it exceeds ``tolerance``."""

    statistic: float
    tolerance: float

    @property
    def ratio(self) -> float:
        return self.statistic / self.tolerance if self.tolerance > 0 else (math.inf if self.statistic > 0 else 0.0)

    @property
    def passed(self) -> bool:
        return self.statistic <= self.tolerance


def threshold_factor(rows: int, false_alarm: float = FALSE_ALARM) -> float:
    """``√((k + 2√(k t) + 2t) / k)``, ``t = ln(1/false_alarm)``: ``‖S·v‖/√k`` stays below it times ``‖v‖₂``
    with probability at least ``1 − false_alarm`` (see the module)."""
    if not 0 < false_alarm < 1:
        raise ValueError(f"false_alarm must lie in (0, 1), got {false_alarm}")
    t = math.log(1 / false_alarm)
    return math.sqrt((rows + 2 * math.sqrt(rows * t) + 2 * t) / rows)


def check_sum(
    total: torch.Tensor,
    slack: torch.Tensor,
    contributions: Sequence[Contribution],
    seed: int,
    *,
    steps: int = 1,
    total_norm: float | None = None,
    false_alarm: float = FALSE_ALARM,
) -> SumCheck:
    """Check ``total`` (the decoded reduced shard, or a ``RunningSum``'s total) against the contributions'
    sketches under ``seed``; ``slack`` (same shape, ≥ 0) bounds ``|total − Σ c_r|`` element-wise apart from
    float rounding (see the module). ``steps`` > 1 for running sums (``total_norm``: the running sum of the
    totals' norms). ValueError (one line) for garbled input."""
    if not contributions:
        raise ValueError("check_sum needs the contributions of at least one member")
    rows = contributions[0].sketch.numel()
    if any(c.sketch.numel() != rows for c in contributions):
        raise ValueError("contributions' sketches differ in rows: " + ", ".join(str(c.sketch.numel()) for c in contributions))
    if not isinstance(total, torch.Tensor) or total.dim() != 1:
        raise ValueError(f"the total is a 1-D tensor, got {_describe(total)}")
    if not isinstance(slack, torch.Tensor) or tuple(slack.shape) != tuple(total.shape):
        raise ValueError(f"slack of {_describe(slack)} for a total of {tuple(total.shape)}")
    slack64 = slack.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(slack64).all()) or bool((slack64 < 0).any()):
        raise ValueError("slack must be finite and non-negative")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    observed = sketch(total, seed, rows)  # refuses a non-finite total
    own = float(torch.linalg.vector_norm(total.detach().to(torch.float64))) if total_norm is None else total_norm
    return judge_sum(observed, own, float(torch.linalg.vector_norm(slack64)), total.numel(), contributions,
                     steps=steps, false_alarm=false_alarm)


def judge_sum(
    observed: torch.Tensor,
    total_norm: float,
    slack_norm: float,
    numel: int,
    contributions: Sequence[Contribution],
    *,
    steps: int = 1,
    false_alarm: float = FALSE_ALARM,
) -> SumCheck:
    """``check_sum`` from numbers only: the total's sketch ``observed`` (``S·total``), its norm, ``‖slack‖₂`` and
    its ``numel``; what a third party re-checks from a member's signed statement (``verify.sum_check``)."""
    if not contributions:
        raise ValueError("judge_sum needs the contributions of at least one member")
    rows = contributions[0].sketch.numel()
    if any(c.sketch.numel() != rows for c in contributions):
        raise ValueError("contributions' sketches differ in rows: " + ", ".join(str(c.sketch.numel()) for c in contributions))
    if not isinstance(observed, torch.Tensor) or observed.dtype != torch.float64 or tuple(observed.shape) != (rows,):
        raise ValueError(f"the total's sketch is float64 [{rows}], got {_describe(observed)}")
    if not bool(torch.isfinite(observed).all()):
        raise ValueError("the total's sketch holds non-finite values")
    for name, value in (("total_norm", total_norm), ("slack_norm", slack_norm)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and non-negative, got {value}")
    if numel < 1 or steps < 1:
        raise ValueError(f"numel and steps must be at least 1, got {numel}, {steps}")
    expected = torch.stack([c.sketch for c in contributions]).sum(dim=0)
    statistic = float(torch.linalg.vector_norm(observed - expected)) / math.sqrt(rows)
    norms = sum(c.norm for c in contributions)
    own = total_norm
    float32_sums = _gamma(len(contributions) - 1, _U32) * norms  # the owner's additions, every step
    float64_running = _gamma(steps - 1, _U64) * (norms + own)  # the running sums' own additions
    bound = slack_norm + float32_sums + float64_running
    rounding = sketch_rounding(numel) * (norms + own) + _gamma(len(contributions) + 1, _U64) * float(
        (observed.abs() + torch.stack([c.sketch.abs() for c in contributions]).sum(dim=0)).max())
    return SumCheck(statistic, threshold_factor(rows, false_alarm) * bound + rounding)


def detection_probability(corruption_norm: float, tolerance: float, rows: int = SKETCH_ROWS,
                          honest: float = 0.0) -> float:
    """The probability that a corruption of ℓ2 norm ``corruption_norm``, spread over many elements, pushes the
    statistic above ``tolerance`` when the honest part contributes at most ``honest`` to it:
    ``P(χ²_k > k (tolerance + honest)² / ‖d‖²)`` (``‖S·d‖² ≈ ‖d‖² χ²_k`` for signs that are ±1 at random)."""
    if corruption_norm <= 0:
        return 0.0
    from scipy.stats import chi2  # here: importing scipy.stats costs every agent process about a second

    return float(chi2.sf(rows * ((tolerance + honest) / corruption_norm) ** 2, rows))


def _gamma(n: int, unit: float) -> float:
    """Higham's γ_n = n u / (1 − n u): the relative error bound of n floating-point operations."""
    return n * unit / (1 - n * unit) if n > 0 else 0.0


def _check_seed(seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ValueError(f"a seed is an integer in [0, 2^64), got {seed!r}")


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor of {tuple(x.shape)}"
    return type(x).__name__
