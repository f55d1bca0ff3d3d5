"""Who may take part in a run: open runs (anyone, the default) or closed runs (listed peers, or holders of a
join token the organiser signed).

    p2ptrain token --key organiser.id --show-id                 # the organiser's ID, for everyone's config
    p2ptrain token --key organiser.id --run demo --peer QmVolunteer... --valid-days 30   # one volunteer's token

Every agent and the bootstrap of a closed run are configured with the same ``[dht.admission]``
(``organiser`` and/or ``peers``); an agent admitted by token also sets its own ``token``.

Where it is enforced (a peer that is not admitted can still join the DHT; nothing it writes is used):

* **Its records travel with its token.** The token is added to every record an agent stores, as one
  more field (``join_token``) of the record's msgpack map, so it is covered by the entry's RSA signature
  and every reader and DHT node can check it without asking anyone. Older decoders ignore unknown fields.
* **DHT nodes refuse** entries under a closed run's keys from a writer that is neither listed nor holds a
  valid token for it (``validators.SwarmRecordValidator``), so honest nodes never store them. A node
  that does (a rogue's own) has its whole answer for that key dropped by readers (hivemind's rule), so
  every honest node of a closed run, the bootstrap included, must know the policy.
* **Readers skip** such entries (``validators.verify_entries``): a peer that is not admitted never
  becomes a member, never leads (however low its peer ID), and its plans, links and progress are ignored.
* **The transport refuses its tensors at the header** once told who is admitted
  (``Mailbox.admit_sender``; ``SwarmDHT.is_admitted`` answers it).

Refusals are logged, rate-limited (``RateLimitedLog``).

A token binds (run, peer ID, expiry) under the organiser's RSA key; the organiser's peer ID is the hash
of that key (``identity.py``), so configs carry a short ID and the token carries the key. A stolen token
is useless to anyone else: records are signed by their writer's own key, whose peer ID must match.
"""

from __future__ import annotations

import base64
import functools
import time
from dataclasses import dataclass

import msgpack
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2ptrain.errors import ConfigError
from p2ptrain.net.dht.keys import check_run_id
from p2ptrain.net.identity import (
    check_peer_id,
    owner_mark,
    peer_id_from_bytes,
    peer_id_of_owner_mark,
    peer_id_to_bytes,
)

TOKEN_PREFIX = "p2ptrain-join-1."
TOKEN_FIELD = "join_token"  # the extra field of a record's msgpack map that carries its writer's token
MAX_TOKEN_BYTES = 2048
_SIGNED_DOMAIN = b"p2ptrain join token v1\0"
_CLOCK_SLACK_S = 300.0


class TokenError(ValueError):
    """A join token that cannot be read, is not signed by the organiser, or admits someone else."""


@dataclass(frozen=True)
class JoinToken:
    run: str
    peer_id: str
    expires_at: float  # unix time; 0: never
    organiser_key: bytes  # the organiser's RSA public key (ssh form), whose hash is the organiser's peer ID
    signature: bytes

    @property
    def organiser(self) -> str:
        return peer_id_of_owner_mark(owner_mark(RSAPublicKey.from_bytes(self.organiser_key)))

    def encode(self) -> bytes:
        return msgpack.packb([self.run, peer_id_to_bytes(self.peer_id), self.expires_at, self.organiser_key,
                              self.signature], use_bin_type=True)

    def to_text(self) -> str:
        return TOKEN_PREFIX + base64.urlsafe_b64encode(self.encode()).decode().rstrip("=")


def make_token(organiser: RSAPrivateKey, run: str, peer_id: str, valid_s: float | None = None,
               now: float | None = None) -> JoinToken:
    """A token admitting ``peer_id`` to ``run``, signed with the organiser's key (for ``valid_s``, or forever)."""
    check_run_id(run)
    check_peer_id(peer_id)
    expires_at = 0.0 if valid_s is None else float((time.time() if now is None else now) + valid_s)
    key = organiser.get_public_key().to_bytes()
    return JoinToken(run, peer_id, expires_at, key, organiser.sign(_signed(run, peer_id, expires_at)))


def _signed(run: str, peer_id: str, expires_at: float) -> bytes:
    return _SIGNED_DOMAIN + msgpack.packb([run, peer_id_to_bytes(peer_id), expires_at], use_bin_type=True)


@functools.lru_cache(maxsize=1024)
def decode_token(raw: bytes) -> JoinToken:
    """Parse and check a token's signature (not who it admits); TokenError if it is not one."""
    if not isinstance(raw, bytes) or len(raw) > MAX_TOKEN_BYTES:
        raise TokenError("a join token is bytes of at most 2 KiB")
    try:
        run, peer, expires_at, key, signature = msgpack.unpackb(raw, raw=False)
        token = JoinToken(check_run_id(run), peer_id_from_bytes(peer), float(expires_at), bytes(key), bytes(signature))
        public_key = RSAPublicKey.from_bytes(token.organiser_key)
    except Exception as e:  # msgpack, peer ID and key parsing raise various types for garbage
        raise TokenError(f"not a join token ({type(e).__name__})") from None
    if not public_key.verify(_signed(token.run, token.peer_id, token.expires_at), token.signature):
        raise TokenError("the join token's signature does not match its key")
    return token


def parse_token_text(text: str) -> bytes:
    text = text.strip()
    if not text.startswith(TOKEN_PREFIX):
        raise TokenError(f"a join token starts with {TOKEN_PREFIX!r}")
    body = text[len(TOKEN_PREFIX):]
    try:
        return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except ValueError:
        raise TokenError("the join token is not valid base64") from None


@dataclass(frozen=True)
class AdmissionConfig:
    """``[dht.admission]``: empty (the default) is an open run. ``peers``: peer IDs admitted by name;
    ``organiser``: the peer ID of the organiser's key, whose tokens admit their holders. ``token`` (or
    ``token_file``): this peer's own token, presented with every record it publishes."""

    peers: tuple[str, ...] = ()
    organiser: str | None = None
    token: str | None = None
    token_file: str | None = None

    def __post_init__(self) -> None:
        try:
            for peer in self.peers:
                check_peer_id(peer)
            if self.organiser is not None:
                check_peer_id(self.organiser)
        except ValueError as e:
            raise ConfigError(f"admission: {e}") from None
        if self.token and self.token_file:
            raise ConfigError("admission: set token or token_file, not both")
        try:
            self.token_bytes()
        except TokenError as e:
            raise ConfigError(f"admission.token: {e}") from None

    @property
    def closed(self) -> bool:
        return bool(self.peers) or self.organiser is not None

    def token_bytes(self) -> bytes | None:
        """This peer's token, decoded (and its signature checked), or None."""
        text = self.token
        if self.token_file:
            try:
                with open(self.token_file) as f:
                    text = f.read()
            except OSError as e:
                raise ConfigError(f"admission.token_file: cannot read {self.token_file}: {e.strerror}") from None
        if not text:
            return None
        raw = parse_token_text(text)
        decode_token(raw)
        return raw


class AdmissionPolicy:
    """Decides whether a writer may take part in ``run`` (pure: no I/O, the clock passed in or read)."""

    def __init__(self, run: str, config: AdmissionConfig):
        self.run = run
        self.config = config
        self._peers = frozenset(config.peers) | ({config.organiser} if config.organiser else set())

    @property
    def closed(self) -> bool:
        return self.config.closed

    def refusal(self, peer_id: str, token: bytes | None, now: float | None = None) -> str | None:
        """Why ``peer_id`` presenting ``token`` is not admitted, or None when it is."""
        if not self.closed or peer_id in self._peers:
            return None
        if token is None:
            return "not admitted to this closed run (not listed, and no join token)"
        if self.config.organiser is None:
            return "not admitted to this closed run (not listed; the run takes no join tokens)"
        try:
            decoded = decode_token(token)
        except TokenError as e:
            return f"its join token is invalid: {e}"
        if decoded.organiser != self.config.organiser:
            return f"its join token is signed by {decoded.organiser}, not the organiser {self.config.organiser}"
        if decoded.run != self.run:
            return f"its join token is for run {decoded.run!r}"
        if decoded.peer_id != peer_id:
            return f"its join token admits {decoded.peer_id}, not the peer that wrote the record"
        now = time.time() if now is None else now
        if decoded.expires_at and decoded.expires_at + _CLOCK_SLACK_S < now:
            return "its join token expired"
        return None


def attach_token(value: bytes, token: bytes) -> bytes:
    """A record's encoded map with ``token`` added as the ``join_token`` field."""
    m = msgpack.unpackb(value, raw=False)
    m[TOKEN_FIELD] = token
    return msgpack.packb(m, use_bin_type=True)


def token_of(value: object) -> bytes | None:
    """The ``join_token`` field of a record's encoded map, or None (also for anything that is not a map)."""
    if not isinstance(value, bytes):
        return None
    try:
        m = msgpack.unpackb(value, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises many unrelated types for garbage; the record check reports it
        return None
    token = m.get(TOKEN_FIELD) if isinstance(m, dict) else None
    return token if isinstance(token, bytes) else None
