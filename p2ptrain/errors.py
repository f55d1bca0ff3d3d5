"""The exception hierarchy of p2ptrain.

Bad user input is a ``ValueError`` (or a subclass), turned into a one-line message and exit code 2 by the
CLI. Failures of other peers are ``ProtocolError`` subclasses: they name the peer and are handled, never
branched on by their text.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration file, flag or input file is invalid; the message is one line naming the problem."""


class ProtocolError(RuntimeError):
    """Another peer did something the protocol does not allow, or did not answer in time."""

    def __init__(self, message: str, peer: str | None = None):
        super().__init__(message if peer is None else f"{message} (peer {peer})")
        self.peer = peer


class PeerTimeoutError(ProtocolError):
    """A call to a peer did not complete within its configured deadline."""


class MessageRejected(ProtocolError):
    """A message did not match what the receiver expected (shape, dtype, size, step, sender) and was refused.

    ``code`` says why in a word a sender can act on: a ``p2ptrain.net.transport.messages.Refusal`` (a string,
    so that this module imports nothing), ``"refused"`` unless said.
    """

    def __init__(self, message: str, peer: str | None = None, code: str = "refused"):
        super().__init__(message, peer)
        self.code = code


class StreamClosed(ProtocolError):
    """The connection closed before the receiver's reply: the message may or may not have been taken."""


class PeerFailed(ProtocolError):
    """A peer of this epoch stopped answering heartbeats or reported a failure: the calls of the epoch were
    cut short (``Transport.abort_epoch``) instead of waiting for their data deadlines.

    ``stuck_on``: the peer a cut call had waited on for most of its deadline (``stuck_s`` seconds), if any:
    this peer was stuck behind it when the failure elsewhere was noticed, so a halt blames it
    (``agent.epoch.blamed_peer``) as it would have once that call timed out; or the trainer whose death
    aborted the epoch (``stuck_s`` 0): the failure's own culprit, where the blames of the cascade end.
    """

    def __init__(self, message: str, peer: str | None = None, stuck_on: str | None = None, stuck_s: float = 0.0):
        super().__init__(message, peer)
        self.stuck_on, self.stuck_s = stuck_on, stuck_s


class AgentError(RuntimeError):
    """An agent cannot go on (no plan in time, no feasible plan, a run of other data); the message is one line
    that says what to do."""
