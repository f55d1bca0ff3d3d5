"""Peer identity: one RSA key is both the libp2p identity (the peer ID) and the DHT signing key.

Binding signatures to peer IDs
------------------------------
hivemind's ``RSASignatureValidator`` proves that a DHT entry was written by the holder of the RSA key whose
public half is spelled in the entry's subkey (the *owner mark*, ``[owner:ssh-rsa AAAA...]``). The libp2p
peer ID of an RSA identity is, by the libp2p spec, the sha2-256 multihash of the protobuf-encoded public
key. So when the key that signs an agent's DHT entries *is* the key in the identity file its p2pd runs
with, the peer ID follows from the owner mark by a pure computation (:func:`peer_id_of_owner_mark`):

* no record carries a claimed peer ID; a record's author is whatever its subkey's key hashes to;
* "is this plan record really from peer X?" is answered offline: the RSA validator accepted the signature
  for the key in the subkey, and that key hashes to X. A rogue can only "be" X by signing with X's private
  key, and the libp2p connection to X is authenticated with that same key.

We considered the alternative, an ``rpc_whoami`` endpoint through which X vouches for its signing key.
It costs a network round trip per peer (with timeouts, dead peers and retries to handle) and gives a weaker
answer (X vouched for K at some moment); deriving the peer ID from the signing key needs neither.

Which RSA key (hivemind 1.1.12)
-------------------------------
``RSASignatureValidator()`` without an argument signs with ``RSAPrivateKey.process_wide()``: a 2048-bit
key generated lazily, once per process (a class attribute), never persisted, and unrelated to the peer ID.
``RSAPrivateKey()`` always generates a fresh key and has no loader. So every ``SwarmDHT`` passes its own
key explicitly: loaded from the identity file (stable peer ID across restarts) or generated for this start
and handed to p2pd through a private temporary file that is deleted on shutdown. Two ``SwarmDHT`` in one
process (tests, the swarm launcher) therefore have different keys and different peer IDs.

The identity file is hivemind's/libp2p's format (``P2P.generate_identity``): a protobuf ``PrivateKey``
holding an RSA key in DER. Files holding other key types (e.g. Ed25519) are refused: their peer ID could
not be tied to an RSA owner mark.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2ptrain.errors import ConfigError

logger = logging.getLogger(__name__)

_SHA256_MULTIHASH_PREFIX = b"\x12\x20"  # multihash code sha2-256, digest length 32
PEER_ID_BYTES = 34
MIN_RSA_BITS = 2048  # go-libp2p refuses smaller RSA identities
MAX_RSA_BITS = 8192  # bounds the cost of verifying one signature
_OWNER_MARK_RE = re.compile(rb"\[owner:(ssh-rsa [A-Za-z0-9+/]+={0,2})\]")


@dataclass(frozen=True)
class Identity:
    """An RSA private key with the peer ID it gives (the same key signs DHT records and runs p2pd)."""

    private_key: RSAPrivateKey
    peer_id: str

    @property
    def owner_mark(self) -> bytes:
        """The subkey under which this peer's DHT entries are stored (and signed)."""
        return owner_mark(self.private_key.get_public_key())

    def to_protobuf(self) -> bytes:
        """The identity file content (libp2p ``PrivateKey`` protobuf), as p2pd reads it."""
        return crypto_pb2.PrivateKey(
            key_type=crypto_pb2.KeyType.RSA, data=self.private_key.to_bytes()
        ).SerializeToString()


def generate_identity() -> Identity:
    """A fresh 2048-bit RSA identity (about 50 ms)."""
    return _identity_from_key(RSAPrivateKey())


def load_identity(path: str | Path) -> Identity:
    """Load an identity file; a missing, unreadable or non-RSA file is a one-line ConfigError."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"identity file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read identity file {path}: {e.strerror}") from None
    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = serialization.load_der_private_key(proto.data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
    except Exception as e:  # protobuf and cryptography raise several unrelated types for garbage
        raise ConfigError(
            f"identity file {path} does not hold an RSA libp2p private key ({e}); "
            "delete it to have a new one generated"
        ) from None
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        logger.warning("identity file %s is readable by other users; chmod 600 it", path)
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind has no loader; its pickling path does the same
    wrapped._private_key = key
    return _identity_from_key(wrapped)


def load_or_create_identity(path: str | Path) -> Identity:
    """Load ``path``, or create it (mode 0600, atomically, never overwriting) with a fresh identity."""
    path = Path(path)
    if path.exists():
        return load_identity(path)
    if not path.parent.is_dir():
        raise ConfigError(f"cannot create identity file {path}: directory {path.parent} does not exist")
    identity = generate_identity()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.to_protobuf())
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if another process created `path` meanwhile: then we load theirs
    except FileExistsError:
        return load_identity(path)
    except OSError as e:
        raise ConfigError(f"cannot create identity file {path}: {e.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("created identity file %s (peer ID %s)", path, identity.peer_id)
    return identity


class TemporaryIdentityFile:
    """A private (0700 dir, 0600 file) copy of an identity for p2pd to read; removed by ``close()``."""

    def __init__(self, identity: Identity):
        self._dir = tempfile.mkdtemp(prefix="p2ptrain-id-")
        self.path = os.path.join(self._dir, "identity.key")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.to_protobuf())

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def owner_mark(public_key: RSAPublicKey) -> bytes:
    """``[owner:ssh-rsa ...]``: what hivemind's RSASignatureValidator looks for in a subkey."""
    return b"[owner:" + public_key.to_bytes() + b"]"


def peer_id_of_public_key(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer ID (base58) of an RSA public key: sha2-256 multihash of its protobuf encoding."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return base58.b58encode(_SHA256_MULTIHASH_PREFIX + hashlib.sha256(encoded).digest()).decode()


@functools.lru_cache(maxsize=4096)
def peer_id_of_owner_mark(subkey: object) -> str:
    """The peer ID whose key is spelled in an owner-mark subkey; ValueError if ``subkey`` is not exactly one.

    Only the exact form ``[owner:ssh-rsa <base64>]`` is accepted (hivemind accepts the mark anywhere in a
    subkey; we do not, so one peer has exactly one subkey per key).
    """
    if not isinstance(subkey, bytes):
        raise ValueError(f"subkey is {type(subkey).__name__}, not an owner mark")
    return _peer_id_of_mark(subkey)


@functools.lru_cache(maxsize=4096)
def _peer_id_of_mark(subkey: bytes) -> str:
    """``peer_id_of_owner_mark`` of bytes, remembered: every read of a run's key returns every writer's mark, and
    parsing its key took a DHT reader milliseconds each (a refused mark raises, and is not remembered)."""
    match = _OWNER_MARK_RE.fullmatch(subkey)
    if match is None:
        raise ValueError("subkey is not an owner mark [owner:ssh-rsa ...] (unsigned entry)")
    try:
        key = serialization.load_ssh_public_key(match.group(1))
    except Exception:  # cryptography raises ValueError or UnsupportedAlgorithm for garbage
        raise ValueError("owner mark does not hold a valid RSA public key") from None
    if not isinstance(key, rsa.RSAPublicKey) or not MIN_RSA_BITS <= key.key_size <= MAX_RSA_BITS:
        raise ValueError(f"owner key must be RSA with {MIN_RSA_BITS}..{MAX_RSA_BITS} bits")
    return peer_id_of_public_key(key)


def check_peer_id(peer_id: object) -> str:
    """Return ``peer_id`` if it is a well-formed RSA peer ID (base58 of a sha2-256 multihash), else ValueError."""
    if not isinstance(peer_id, str) or not 40 <= len(peer_id) <= 60:
        raise ValueError(f"malformed peer ID {peer_id!r}")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        raise ValueError(f"malformed peer ID {peer_id!r}: not base58") from None
    if len(raw) != PEER_ID_BYTES or not raw.startswith(_SHA256_MULTIHASH_PREFIX):
        raise ValueError(f"malformed peer ID {peer_id!r}: not a sha2-256 multihash")
    return peer_id


def peer_id_to_bytes(peer_id: str) -> bytes:
    return base58.b58decode(check_peer_id(peer_id))


def peer_id_from_bytes(raw: object) -> str:
    if (
        not isinstance(raw, bytes)
        or len(raw) != PEER_ID_BYTES
        or not raw.startswith(_SHA256_MULTIHASH_PREFIX)
    ):
        raise ValueError("malformed peer ID bytes")
    return base58.b58encode(raw).decode()


def _identity_from_key(key: RSAPrivateKey) -> Identity:
    return Identity(private_key=key, peer_id=peer_id_of_owner_mark(owner_mark(key.get_public_key())))
