"""A call's reply on the tensor and probe streams (``servicer``): one ``ExpertResponse`` whose metadata is JSON,
``{"ok": true}`` or ``{"error": "...", "code": ...}`` (``messages.Refusal``), with the arrival stamps of a
message (``at``) and of a probe (``rx``) and a probe reply's payload; made by the receiver, read by the sender,
awaited under the stream's own end (a closed or broken stream is ``StreamClosed``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import runtime_pb2

from p2ptrain.errors import ProtocolError, StreamClosed
from p2ptrain.net.transport.messages import Refusal, Stamp

MAX_ERROR_CHARS = 500


def make_reply(
    error: str | None = None, payload: bytes = b"", arrival: Stamp | None = None, code: Refusal = Refusal.REFUSED,
    received: Stamp | None = None,
) -> runtime_pb2.ExpertResponse:
    metadata = {"ok": True} if error is None else {"error": error[:MAX_ERROR_CHARS], "code": code}
    if arrival is not None:
        metadata["at"] = arrival.to_json()
    if received is not None:
        metadata["rx"] = received.to_json()
    tensors = [runtime_pb2.Tensor(buffer=payload)] if payload else []
    return runtime_pb2.ExpertResponse(metadata=json.dumps(metadata).encode(), tensors=tensors)


def is_ok(response: runtime_pb2.ExpertResponse) -> bool:
    return parse_reply(response).error is None


@dataclass(frozen=True)
class Reply:
    error: str | None
    payload: bytes = b""
    arrival: Stamp | None = None
    code: Refusal = Refusal.REFUSED  # why, when refused
    received: Stamp | None = None  # a probe reply's: when the probe arrived, on the replier's clock


def parse_reply(response: runtime_pb2.ExpertResponse) -> Reply:
    """A reply's error (None when ok), payload and arrival stamp; a malformed reply reads as an error."""
    try:
        metadata = json.loads(response.metadata)
        if not isinstance(metadata, dict) or (metadata.get("ok") is not True and "error" not in metadata):
            return Reply("the reply is neither ok nor an error")
        if metadata.get("ok") is not True:
            return Reply(str(metadata["error"])[:MAX_ERROR_CHARS], code=Refusal.from_wire(metadata.get("code")))
        arrival = Stamp.from_json(metadata["at"]) if "at" in metadata else None
        received = Stamp.from_json(metadata["rx"]) if "rx" in metadata else None
    except (UnicodeDecodeError, ValueError):  # JSONDecodeError is a ValueError, as is a bad stamp
        return Reply("the reply is malformed")
    return Reply(None, response.tensors[0].buffer if response.tensors else b"", arrival, received=received)


async def first_reply(responses: AsyncIterator[runtime_pb2.ExpertResponse], peer: str) -> runtime_pb2.ExpertResponse:
    """The first response of a call's stream, then the stream closed (which also stops its writer)."""
    try:
        return await next_reply(responses, peer)
    finally:
        await responses.aclose()


async def next_reply(responses: AsyncIterator[runtime_pb2.ExpertResponse], peer: str) -> runtime_pb2.ExpertResponse:
    try:
        return await responses.__anext__()
    except StopAsyncIteration:
        raise StreamClosed("the connection closed before a reply", peer=peer) from None
    except (ConnectionError, asyncio.IncompleteReadError) as e:  # the peer's daemon went away mid-call
        raise StreamClosed(f"the connection broke before a reply: {e!r}", peer=peer) from None
    except P2PHandlerError as e:
        raise ProtocolError(f"the call failed on the receiver: {e}", peer=peer) from None
