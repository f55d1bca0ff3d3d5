"""Signed statements: what a member says about a step, in a form any third party can check offline.

A statement is a body (bytes the caller lays out) signed with the member's own RSA identity key, the key its
peer ID is the hash of (``net.identity``): ``[len body][len key][len signature] body key signature``, the key
spelled as a DHT owner mark (``ssh-rsa ...``). Whoever holds the bytes checks that the key hashes to the
member's peer ID and that the signature covers the body, so a statement forwarded to the leader proves what
its signer said as well as it did to the peer that received it on an authenticated stream.

On the wire a statement travels as a uint8 tensor of a size both ends know in advance (the transport refuses
a message of another size): the body's size plus ``ENVELOPE_BYTES`` (a 8192-bit key and its signature fit),
zero-padded.
"""

from __future__ import annotations

import struct

import torch
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2ptrain.net.identity import owner_mark, peer_id_of_owner_mark

ENVELOPE_BYTES = 4096  # lengths, the key (≤ 1.1 kB for 8192 bits) and the signature (base64, ≤ 1.4 kB)
_DOMAIN = b"p2ptrain.verify.statement\0"
_LENGTHS = struct.Struct("<III")


def sign(key: RSAPrivateKey, body: bytes) -> bytes:
    """``body`` signed with ``key``: the statement's bytes."""
    mark = owner_mark(key.get_public_key())
    signature = key.sign(_DOMAIN + body)
    return _LENGTHS.pack(len(body), len(mark), len(signature)) + body + mark + signature


def open_signed(blob: bytes, signer: str) -> bytes:
    """The body of statement ``blob`` if ``signer`` signed it; ValueError (one line) otherwise."""
    if len(blob) < _LENGTHS.size:
        raise ValueError(f"a statement of {len(blob)} bytes is too short")
    body_n, mark_n, sig_n = _LENGTHS.unpack_from(blob)
    end = _LENGTHS.size + body_n + mark_n + sig_n
    if end > len(blob) or mark_n > ENVELOPE_BYTES or sig_n > ENVELOPE_BYTES:
        raise ValueError(f"a statement's lengths ({body_n}, {mark_n}, {sig_n}) exceed its {len(blob)} bytes")
    if any(blob[end:]):
        raise ValueError("a statement with bytes after its signature")
    body = bytes(blob[_LENGTHS.size: _LENGTHS.size + body_n])
    mark = bytes(blob[_LENGTHS.size + body_n: _LENGTHS.size + body_n + mark_n])
    signature = bytes(blob[_LENGTHS.size + body_n + mark_n: end])
    try:
        owner = peer_id_of_owner_mark(mark)  # an RSA key of an allowed size, exactly one mark
    except ValueError as e:
        raise ValueError(f"a statement's key: {e}") from None
    if owner != signer:
        raise ValueError(f"a statement signed by {owner}, not by {signer}")
    public = RSAPublicKey.from_bytes(mark[len(b"[owner:"): -1])
    if not public.verify(_DOMAIN + body, signature):
        raise ValueError(f"a statement whose signature is not {signer}'s")
    return body


def trimmed(blob: bytes) -> bytes:
    """A statement without the padding it travelled with (what is forwarded as evidence)."""
    if len(blob) < _LENGTHS.size:
        return blob
    return blob[: _LENGTHS.size + sum(_LENGTHS.unpack_from(blob))]


def split(blob: bytes) -> list[bytes]:
    """Trimmed statements laid end to end, apart (each is opened with ``open_signed``); ValueError (one line) for
    bytes that are not such a sequence."""
    out, offset = [], 0
    while offset < len(blob):
        if len(blob) - offset < _LENGTHS.size:
            raise ValueError(f"{len(blob) - offset} bytes after the last statement")
        end = offset + _LENGTHS.size + sum(_LENGTHS.unpack_from(blob, offset))
        if end > len(blob):
            raise ValueError(f"a statement of {end - offset} bytes in the {len(blob) - offset} left")
        out.append(bytes(blob[offset:end]))
        offset = end
    return out


def wire_size(body_bytes: int) -> int:
    """The size of the uint8 message carrying a statement whose body has ``body_bytes``."""
    return _LENGTHS.size + body_bytes + ENVELOPE_BYTES


def to_message(blob: bytes, body_bytes: int) -> torch.Tensor:
    """The statement as a uint8 tensor of ``wire_size(body_bytes)``, zero-padded."""
    size = wire_size(body_bytes)
    if len(blob) > size:
        raise ValueError(f"a statement of {len(blob)} bytes does not fit a message of {size}")
    out = torch.zeros(size, dtype=torch.uint8)
    out[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return out


def from_message(message: torch.Tensor) -> bytes:
    """A received message's bytes (padding included: ``open_signed`` checks it is zeros)."""
    if not isinstance(message, torch.Tensor) or message.dtype != torch.uint8 or message.dim() != 1:
        raise ValueError("a statement travels as a 1-D uint8 tensor")
    return message.numpy().tobytes()
