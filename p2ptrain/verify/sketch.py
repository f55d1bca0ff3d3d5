"""Linear sketches of flat vectors, and the check of a summed shard against its contributors' sketches.

**The sketch.** ``sketch(x, seed, rows)`` is ``S·x`` for a ``rows × n`` matrix of signs with a product
structure: element ``j`` sits at row ``p = j // Q`` and column ``c = j % Q`` of a matrix ``X`` (``Q`` the
smallest power of two at least ``√n``, ``layout_width``: about square), and ``S[i, j] = a_i(p)·b_i(c)``, with ``b_i(c)`` bit ``i`` of ``H(seed, c + 1)`` and
``a_i(p)`` bit ``i`` of ``H(seed, Q + p + 1)`` (``H`` splitmix64's output function of the counter; uint64
arithmetic, defined to wrap), so row ``i`` of ``S`` is ``u_i ⊗ w_i`` and ``(S·x)_i = u_iᵀ X w_i``. That is one
float64 matrix product ``X·B`` (``B`` the ``Q × k`` column signs) and a signed sum over rows: a pass over ``x``
at the speed of a matrix product, where signs drawn per element (one word and four ``bincount``s an element,
until session 36) cost 8 times more on a CPU. Any part of ``S`` can be made without the rest (``offset``); every
device and library makes the same signs. The sums are float64 in whatever order the library's product takes, so
two machines' sketches of one vector agree within ``sketch_rounding`` (sums of ``Q`` terms, then of the rows,
each rounding at most 2^-53 of ``‖x‖₁ ≤ √n ‖x‖₂``), not bit for bit.

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
shard; what makes the check sharp is that the signs are unknown when ``v`` is fixed. For one row, with ``V_m``
the matrix of ``v``: given ``w``, ``⟨u, V_m w⟩`` is a Rademacher sum, so ``E_u exp(θ⟨s, v⟩) ≤ exp(θ²‖V_m w‖²/2)``
(Hoeffding's lemma); writing ``exp(λ‖y‖²) = E_g exp(√(2λ) gᵀy)`` for a standard normal vector ``g`` and applying
Hoeffding again over ``w``, ``E exp(θ²‖V_m w‖²/2) ≤ E_g exp(θ² gᵀ V_m V_mᵀ g / 2) = Π_l (1 − θ²σ_l²)^{-1/2} ≤ (1
− θ²‖v‖²)^{-1/2}`` (``σ_l`` the singular values, ``Σ σ_l² = ‖v‖²``). So ``E exp(θ|⟨s, v⟩|) ≤ 2 (1 −
θ²‖v‖²)^{-1/2}`` for ``θ‖v‖ < 1``: the tail of a product of two normals, the worst case a ``v`` of rank one. The
rows draw independent bits, so for the statistic ``Σ_i |(S·v)_i| / k`` the Chernoff bound gives

    P( Σ_i |(S·v)_i| ≥ k·f·‖v‖ ) ≤ e^−t,   f = min_θ (k ln 2 + (k/2) ln(1/(1 − θ²)) + t) / (θ k)

(``threshold_factor``; 2.58 at k = 32 and ``t = ln(1/false_alarm)``, ``false_alarm`` = 2^-40 by default). The
statistic exceeds ``f·V`` plus the sketches' own float64 rounding with probability at most ``false_alarm``, for
every honest owner, whatever its data: that sum is the ``tolerance``. A statistic above it blames the owner, or the
contributor whose sketch is wrong (the owner holds every message it summed and checks their sketches exactly;
a committed message, revealed, settles it: ``commit``).

A corruption ``d`` of the reduced shard adds ``S·d``; spread over many rows and columns of the layout (its matrix
far from rank one) each ``(S·d)_i`` is close to ``‖d‖ g_i`` for a standard normal ``g_i``, so it is caught with
probability about ``P(Σ_i |g_i| > k (τ + τ_v) / ‖d‖)``, ``τ_v ≤ τ`` the honest part's share
(``detection_probability``): half the time at ``‖d‖ ≈ 1.25 (τ + τ_v)``. A corruption of rank one (an outer
product over the layout) is caught less readily (``E|gh| = 0.64`` against ``E|g| = 0.80``); one of a single
element, of size δ, always once ``δ > τ + τ_v``. Corruptions inside the codec's own error are invisible by any
check of the sum: per step, an owner may move each element by up to ``slack_j`` (the previous-residual term is
its word). ``RunningSum`` removes that term: checking the sums since the epoch began (``Σ_u D_u`` against each
contributor's ``Σ_u c_{r,u}``), error feedback telescopes, ``Σ_u D_u − Σ_u s_u = −e_t``, and only the present
message's bound and the accumulated float32 roundings remain, so a bias repeated every step grows against a
fixed tolerance (the cost: a float64 running copy of the shards a member contributes to and checks).

**The seed** must be unknown to a sender when it sends (``challenge_seed``): a sender that knew ``S`` could add
any corruption in its null space.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

SKETCH_ROWS = 64  # rows k: 512 bytes per sketch; one 64-bit word per row or column serves up to 64
MAX_ROWS = 64
MIN_WIDTH = 16  # the narrowest layout: a vector of n elements is laid out in rows of layout_width(n) ≥ this
BLOCK_ELEMENTS = 1 << 18  # a CPU's sketch: elements per matrix product (2 MiB of float64, in cache)
TEMP_BYTES = 1 << 28  # an accelerator's sketch: the float64 copy of a vector's block, at most
FALSE_ALARM = 2.0**-40  # the probability an honest check fails, at most, whatever the data
_U64 = 2.0**-53  # float64's unit roundoff
_U32 = 2.0**-24
_GAMMA, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


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


def layout_width(numel: int) -> int:
    """``Q`` for a vector of ``numel`` elements: the smallest power of two at least ``√numel`` (and
    ``MIN_WIDTH``), so the layout is about square (its rank, which makes a spread corruption's sketch close to
    normal, as large as it can be; the rounding's ``Q + numel/Q`` terms as few)."""
    if numel < 0:
        raise ValueError(f"a vector has a non-negative number of elements, got {numel}")
    ceiling_root = math.isqrt(max(numel - 1, 0)) + 1  # ⌈√numel⌉ (1 for none)
    return max(MIN_WIDTH, 1 << (ceiling_root - 1).bit_length())


def sketch(x: torch.Tensor, seed: int, rows: int = SKETCH_ROWS, offset: int = 0,
           device: torch.device | str | None = None, *, width: int | None = None) -> torch.Tensor:
    """``S·x``, float64 ``[rows]`` on the CPU, for the sign matrix of ``seed`` (columns ``offset`` … ``offset +
    len(x) − 1``) in rows of ``width`` (by default ``layout_width(offset + len(x))``; parts of a vector sketched
    at their offsets add up to its sketch under the whole's width), computed where ``device`` says (by default the
    CPU; an accelerator makes the same signs and sums within the same ``sketch_rounding``).

    ``x``: a 1-D finite float tensor on any device. ValueError (one line) otherwise."""
    return sketch_many([x], seed, rows, offset, device, width=width)[0]


def sketch_many(xs: Sequence[torch.Tensor], seed: int, rows: int = SKETCH_ROWS, offset: int = 0,
                device: torch.device | str | None = None, *, width: int | None = None) -> list[torch.Tensor]:
    """``[sketch(x, seed, rows, offset, device, width=width) for x in xs]`` for vectors of one length, each the same
    bits alone or together: the signs are made once for all of them. A check sketches several vectors of a shard
    with one seed: the reduced shard, each contribution and their running sums."""
    return sketches_and_norms(xs, seed, rows, offset, device, width=width)[0]


def sketches_and_norms(xs: Sequence[torch.Tensor], seed: int, rows: int = SKETCH_ROWS, offset: int = 0,
                       device: torch.device | str | None = None, *,
                       width: int | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """``sketch_many``, and each vector's ℓ2 norm summed in float64 from the same float64 copy (``norm64``'s within
    ``sum_check.norm_ratio``): one pass over each vector for both.

    Element ``j`` (``offset`` counted) sits at row ``j // Q``, column ``j % Q`` of a matrix ``X``; block by
    block of ``BLOCK_ELEMENTS`` (``TEMP_BYTES`` on an accelerator), widened to float64 exactly, ``Y = X·B`` (one
    float64 matrix product: ``B[c, i]`` the column signs) and ``Σ_p A[p, i]·Y[p, i]`` (``A`` the row signs) is
    added to entry ``i``, the block's squares to the norm."""
    _check_seed(seed)
    if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"a sketch has 1 to {MAX_ROWS} rows, got {rows!r}")
    for x in xs:
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.dtype.is_floating_point:
            raise ValueError(f"sketch takes a 1-D float tensor, got {_describe(x)}")
    if len({x.numel() for x in xs}) > 1:
        raise ValueError(f"sketch_many takes vectors of one length, got {sorted({x.numel() for x in xs})}")
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
    if not xs:
        return [], []
    where = torch.device(device) if device is not None else torch.device("cpu")
    numel = xs[0].numel()
    out = torch.zeros(len(xs), rows + 1, dtype=torch.float64, device=where)  # the sketch, then the sum of squares
    layout = _Layout(numel, offset, width, seed, rows, where)
    if layout.total_rows:
        buffer = layout.buffer()
        sources = [x.detach() for x in xs]
        for top, bottom, low, high in layout.blocks():
            window = buffer[: (bottom - top) * layout.q]
            for i, x in enumerate(sources):
                layout.fill(window, x, low, high)
                out[i, :rows] += layout.sketch_rows(window, top, bottom)
                out[i, rows] += window.dot(window)
    out = out.cpu()  # on an accelerator, the one wait
    if not bool(torch.isfinite(out[:, :rows]).all()):  # a NaN or an infinity anywhere in a vector reaches its sums
        raise ValueError("sketch of a vector with NaN or infinite values")
    return [o[:rows].clone() for o in out], [math.sqrt(float(o[rows])) for o in out]


def difference_sketch(a: torch.Tensor, b: torch.Tensor, seed: int, rows: int = SKETCH_ROWS,
                      device: torch.device | str | None = None) -> tuple[torch.Tensor, float, float, float]:
    """``S·(a − b)`` (float64 ``[rows]`` on the CPU) with ``‖a‖₂``, ``‖b‖₂`` and ``‖a − b‖₂``, in one pass over the two
    vectors of one length: block by block both are widened to float64, their squares summed and their difference
    sketched, one matrix product where ``sketch(a) − sketch(b)`` takes two. What a member checks an owner's two
    claims about a shard by at once (``sum_check``: the reduced shard and its own contribution to it).

    ``S·(a − b)`` is within ``2 · sketch_rounding(n) · ‖a − b‖₂`` of the exact product: the sketch's own rounding,
    and the float64 subtraction's (at most 2^-53 of each ``|a_j − b_j|``: ``2^-53 ‖a − b‖₁``, less than the first).
    ValueError (one line) as ``sketch``."""
    for x in (a, b):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.dtype.is_floating_point:
            raise ValueError(f"sketch takes a 1-D float tensor, got {_describe(x)}")
    if a.numel() != b.numel():
        raise ValueError(f"difference_sketch takes vectors of one length, got {a.numel()} and {b.numel()}")
    _check_seed(seed)
    if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"a sketch has 1 to {MAX_ROWS} rows, got {rows!r}")
    where = torch.device(device) if device is not None else torch.device("cpu")
    out = torch.zeros(rows + 3, dtype=torch.float64, device=where)  # the sketch, then the three sums of squares
    layout = _Layout(a.numel(), 0, None, seed, rows, where)
    if layout.total_rows:
        first, second = layout.buffer(0), layout.buffer(1)
        a, b = a.detach(), b.detach()
        for top, bottom, low, high in layout.blocks():
            size = (bottom - top) * layout.q
            wa, wb = first[:size], second[:size]
            layout.fill(wa, a, low, high)
            layout.fill(wb, b, low, high)
            out[rows] += wa.dot(wa)
            out[rows + 1] += wb.dot(wb)
            wa.sub_(wb)
            out[rows + 2] += wa.dot(wa)
            out[:rows] += layout.sketch_rows(wa, top, bottom)
    out = out.cpu()
    if not bool(torch.isfinite(out).all()):
        raise ValueError("sketch of a vector with NaN or infinite values")
    norms = [math.sqrt(float(v)) for v in out[rows:]]
    return out[:rows].clone(), norms[0], norms[1], norms[2]


_buffers = threading.local()  # each thread's float64 work buffers (``work_buffer``)


def work_buffer(numel: int, which: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """This thread's float64 work buffer ``which`` on ``device``, ``numel`` elements (contents undefined), kept for
    its next use: a fresh one of a few MiB on a CPU is mapped and zeroed by the kernel page by page, which cost
    more than the sketch's matrix product it served."""
    kept = _buffers.__dict__.setdefault("kept", {})
    key = (torch.device(device), which)
    buffer = kept.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = kept[key] = torch.empty(max(numel, BLOCK_ELEMENTS), dtype=torch.float64, device=key[0])
    return buffer[:numel]


class _Layout:
    """A vector of ``numel`` elements at ``offset`` in rows of ``width`` (``layout_width`` by default), its signs
    under ``seed`` on ``where``, and the blocks a sketch takes it in (``sketches_and_norms``)."""

    def __init__(self, numel: int, offset: int, width: int | None, seed: int, rows: int, where: torch.device):
        q = layout_width(offset + numel) if width is None else width
        if not isinstance(q, int) or isinstance(q, bool) or q < 1:
            raise ValueError(f"a layout's width is a positive integer, got {q!r}")
        self.q, self.numel, self.where = q, numel, where
        first, self.lead = divmod(offset, q)  # the first row, and the columns before x's first element in it
        self.total_rows = -(-(self.lead + numel) // q)
        if self.total_rows:
            self.column_signs = _signs(seed, 0, q, rows, where)  # counters 1 … Q
            self.row_signs = _signs(seed, q + first, self.total_rows, rows, where)  # counters Q + 1 + row
        self.block = max(1, (BLOCK_ELEMENTS if where.type == "cpu" else TEMP_BYTES // 8) // q)

    def buffer(self, which: int = 0) -> torch.Tensor:
        return work_buffer(min(self.block, self.total_rows) * self.q, which, self.where)

    def blocks(self):
        """``(top, bottom, low, high)`` per block: its rows, and the positions of the vector it covers."""
        for top in range(0, self.total_rows, self.block):
            bottom = min(self.total_rows, top + self.block)
            yield top, bottom, top * self.q - self.lead, bottom * self.q - self.lead

    def fill(self, window: torch.Tensor, x: torch.Tensor, low: int, high: int) -> None:
        """``window`` (float64) := the block of ``x`` between positions ``low`` and ``high``, zeros outside ``x``."""
        inside_low, inside_high = max(low, 0), min(high, self.numel)
        if low < 0 or high > self.numel:
            window.zero_()  # zeros add nothing, exactly
        window[inside_low - low: inside_high - low].copy_(x[inside_low:inside_high])  # float64: exact

    def sketch_rows(self, window: torch.Tensor, top: int, bottom: int) -> torch.Tensor:
        """The block's part of the sketch: ``Σ_p A[p, i]·(X·B)[p, i]`` over its rows ``top`` … ``bottom − 1``."""
        products = window.view(bottom - top, self.q) @ self.column_signs  # [block rows, rows]
        return (products * self.row_signs[top:bottom]).sum(dim=0)


def _signs(seed: int, start: int, count: int, rows: int, device: torch.device) -> torch.Tensor:
    """``[count, rows]`` float64 on ``device``: ``1 − 2·(bit i of H(seed, start + 1 + m))`` at ``[m, i]``."""
    words = _words(seed, start, count).view(np.uint8).reshape(count, 8)  # little-endian: byte b holds bits 8b …
    bits = np.unpackbits(words, axis=1, count=rows, bitorder="little")  # [count, rows]: column i is bit i
    return torch.from_numpy(1.0 - 2.0 * bits.astype(np.float64)).to(device)


def sketch_rounding(numel: int, width: int | None = None) -> float:
    """``ρ / ‖x‖₂``: how far float64 rounding may move each entry of ``sketch(x)`` of ``numel`` elements in rows
    of ``width`` (by default ``layout_width(numel)``), at any offset: each product's sums of ``Q`` terms, then the
    sum over at most ``numel / Q + 2`` rows, in whatever order the library sums them (Higham's bound holds for
    every order), of ``‖x‖₁ ≤ √n‖x‖₂``."""
    q = layout_width(numel) if width is None else width
    terms = q + -(-numel // q) + 2
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
        wide = work_buffer(x.numel(), 2)
        wide.copy_(x.detach())  # float64, exactly; a float32 added to float64 in place took twice as long
        self.total += wide
        self.norm += math.sqrt(float(wide.dot(wide)))
        self.steps += 1

    def contribution(self, seed: int, rows: int = SKETCH_ROWS) -> Contribution:
        return Contribution(sketch(self.total, seed, rows, device=self.device), self.norm)


@dataclass(frozen=True)
class SumCheck:
    """``statistic = Σ_i |(S·total − Σ_r sketch_r)_i| / k``; the check fails when it exceeds ``tolerance``."""

    statistic: float
    tolerance: float

    @property
    def ratio(self) -> float:
        return self.statistic / self.tolerance if self.tolerance > 0 else (math.inf if self.statistic > 0 else 0.0)

    @property
    def passed(self) -> bool:
        return self.statistic <= self.tolerance


@functools.lru_cache(maxsize=64)
def threshold_factor(rows: int, false_alarm: float = FALSE_ALARM) -> float:
    """``min over θ in (0, 1) of (k ln 2 + (k/2) ln(1/(1 − θ²)) + t) / (θ k)``, ``t = ln(1/false_alarm)``: the mean
    of ``|(S·v)_i|`` over the k rows stays below it times ``‖v‖₂`` with probability at least ``1 − false_alarm``
    (the Chernoff bound of the module, at the best θ of a fixed grid: the same number on every machine)."""
    if not 0 < false_alarm < 1:
        raise ValueError(f"false_alarm must lie in (0, 1), got {false_alarm}")
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive integer, got {rows!r}")
    t = math.log(1 / false_alarm)
    return min((rows * math.log(2) - rows / 2 * math.log1p(-theta * theta) + t) / (theta * rows)
               for theta in (i / 4096 for i in range(1, 4096)))


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
    statistic = float((observed - expected).abs().sum()) / rows
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
    """The probability that a corruption of ℓ2 norm ``corruption_norm``, spread over many rows and columns of the
    sketch's layout, pushes the statistic above ``tolerance`` when the honest part contributes at most ``honest``
    to it: ``P(Σ_i |g_i| > k (tolerance + honest) / ‖d‖)`` for k independent standard normals (each ``(S·d)_i``
    is then close to ``‖d‖ g_i``), from the distribution of their sum made on a fine grid."""
    if corruption_norm <= 0:
        return 0.0
    positions, survival = _half_normal_sum_survival(rows)
    return float(np.interp(rows * (tolerance + honest) / corruption_norm, positions, survival, left=1.0, right=0.0))


@functools.lru_cache(maxsize=8)
def _half_normal_sum_survival(k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(s, P(|g_1| + … + |g_k| > s))`` on a grid of 1/256, for independent standard normals: the k-fold
    convolution of the half-normal's masses on cells of 1/256, by FFT, each cell's mass at its middle."""
    from scipy.special import ndtr  # the normal's CDF (scipy.special imports in milliseconds)

    step = 1 / 256
    cells = int(9 / step)  # |g| beyond 9: 2e-19
    masses = 2 * np.diff(ndtr(np.arange(cells + 1) * step))
    size = 1 << (k * cells).bit_length()
    total = np.clip(np.fft.irfft(np.fft.rfft(masses, size) ** k, size)[: k * cells], 0.0, None)
    # the sum of the k cells' indices i: the variables' sum lies within k steps above i·step, k/2 on average
    positions = np.arange(total.size) * step + k * step / 2
    survival = np.clip(1.0 - np.cumsum(total), 0.0, 1.0)
    return positions, survival


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
