"""Strict field checks shared by the DHT record schemas (``records.py``).

Each check takes a field name and a value of unknown type (it came from an untrusted peer), returns the
value normalised (ints accepted where floats are expected, never bools), or raises ``RecordError`` with one
line naming the field and the problem.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from typing import Any


class RecordError(ValueError):
    """A value that is not a valid record (wrong type, out of bounds, too large, not decodable)."""


class RecordTooLarge(RecordError):
    """An encoded record exceeds the size cap of DHT values."""


def number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A finite float in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise RecordError(f"{name}={value} is not a finite number")
    if value < lo or (lo_open and value == lo) or value > hi:
        raise RecordError(f"{name}={value:g} is outside {'(' if lo_open else '['}{lo:g}, {hi:g}]")
    return value


def integer(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise RecordError(f"{name}={value} is outside [{lo}, {hi}]")
    return value


def text(
    name: str, value: Any, max_len: int, *, pattern: re.Pattern[str] | None = None, min_len: int = 0
) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{name} must be a string, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise RecordError(f"{name} must have {min_len}..{max_len} characters, got {len(value)}")
    if pattern is not None and not pattern.fullmatch(value):
        raise RecordError(f"{name}={value[:40]!r} does not match {pattern.pattern}")
    if not value.isprintable():
        raise RecordError(f"{name} contains non-printable characters")
    return value


def binary(name: str, value: Any, *, item_size: int, max_items: int) -> bytes:
    """Bytes holding a whole number of ``item_size``-byte items, at most ``max_items`` of them."""
    if not isinstance(value, bytes):
        raise RecordError(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) % item_size or len(value) // item_size > max_items:
        raise RecordError(
            f"{name} must hold up to {max_items} items of {item_size} bytes, got {len(value)} bytes"
        )
    return value


def sequence(name: str, value: Any, max_len: int) -> Sequence[Any]:
    if not isinstance(value, list | tuple):
        raise RecordError(f"{name} must be a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise RecordError(f"{name} has {len(value)} items, at most {max_len} allowed")
    return value


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what a packed array stores)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def pack_float32(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def unpack_float32(data: bytes) -> tuple[float, ...]:
    return struct.unpack(f"<{len(data) // 4}f", data)


def pack_uint16(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}H", *values)


def unpack_uint16(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 2}H", data)


def pack_uint32(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def unpack_uint32(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 4}I", data)
