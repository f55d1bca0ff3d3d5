"""Fixes to hivemind that every process of ours needs before it starts a P2P client: its daemon client's reading
loop, and how its futures share memory.

hivemind 1.1's ``ControlClient`` carries every unary call (ours: heartbeats, the direct plane's hello; the
DHT's: every store and find) over one persistent connection to the daemon, read by one task. A reply that
arrives in the loop iteration in which its call was cancelled (a timeout, a call given up from another
thread) finds its future cancelled but still registered; ``set_result`` then raises ``InvalidStateError``
and ends the reading task. Nothing restarts it: from then on no unary call of the process gets an answer
and none of its unary handlers is called, for as long as the process lives. An agent frozen for seconds
(a machine that stalled, a laptop lid) wakes up with its pings timed out and their answers waiting, which is
that very iteration: it could then ping nobody and nobody could ping it, and it never rejoined its run.

``apply()`` replaces the reading loop with one that hands a reply only to a call still waiting for it,
survives any one malformed message (logged), and, when the daemon closes the connection, fails the calls
still waiting at once instead of leaving them to their deadlines. Idempotent; the DHT's process is forked
from ours (``hivemind.DHT`` is a ``ForkProcess``) and inherits it.

Importing hivemind sets torch's sharing strategy to ``file_system`` (unless ``HIVEMIND_MEMORY_SHARING_STRATEGY``
says otherwise), so each process's first future (a shared byte, ``hivemind.utils.mpfuture.SharedBytes``) starts a
``torch_shm_manager`` process that lives as long as it: 0.2 s of CPU and one more process per agent, its DHT
process and every worker. Our futures' shared bytes cross only to processes forked from their maker, and torch
tensors go by the wire, never through a queue: ``apply()`` sets ``file_descriptor``, which needs no manager
(unless that variable is set: a user's choice stands).
"""

from __future__ import annotations

import asyncio
import logging
import os
from uuid import UUID

import torch.multiprocessing
from hivemind.p2p.p2p_daemon_bindings import control
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError, read_pbmsg_safe
from hivemind.proto import p2pd_pb2

logger = logging.getLogger(__name__)


def _settle(future: asyncio.Future | None, result=None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless its caller already gave up on it (cancelled, or completed another way)."""
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _dispatch(client: control.ControlClient, message: p2pd_pb2.PersistentConnectionResponse) -> None:
    call_id = UUID(bytes=message.callId)
    waiting = client._pending_calls.get(call_id)  # noqa: SLF001 - the client's own state, patched in place
    if message.HasField("callUnaryResponse"):
        answer = message.callUnaryResponse
        if answer.HasField("response"):
            _settle(waiting, answer.response)
        elif answer.HasField("error"):
            _settle(waiting, error=P2PHandlerError(answer.error.decode(errors="ignore")))
    elif message.HasField("requestHandling"):
        handling = asyncio.create_task(client._handle_persistent_request(call_id, message.requestHandling))  # noqa: SLF001
        client._handler_tasks[call_id] = handling  # noqa: SLF001
    elif message.HasField("cancel"):
        handling = client._handler_tasks.pop(call_id, None)  # noqa: SLF001
        if handling is not None and not handling.done():
            handling.cancel()
    elif message.HasField("daemonError"):
        _settle(waiting, error=P2PDaemonError(message.daemonError.message))
    else:  # the daemon's plain acknowledgement (a handler added or removed)
        _settle(waiting)


async def _read_from_persistent_conn(self: control.ControlClient, reader: asyncio.StreamReader) -> None:
    while True:
        message = p2pd_pb2.PersistentConnectionResponse()
        try:
            await read_pbmsg_safe(reader, message)
        except (asyncio.IncompleteReadError, ConnectionError):
            break
        try:
            _dispatch(self, message)
        except Exception:  # one bad message must not end every unary call of the process
            logger.exception("a message from the libp2p daemon could not be handled; the connection stays up")
    closed = P2PDaemonError("the libp2p daemon closed its persistent connection")
    for waiting in list(self._pending_calls.values()):
        _settle(waiting, error=closed)


def apply() -> None:
    """Install the fixed reading loop on hivemind's ``ControlClient`` (every client created afterwards, and
    every one whose reading task starts afterwards, uses it), and share futures' memory by file descriptor."""
    import hivemind.utils.mpfuture  # noqa: F401  (sets the strategy we replace, once per process)

    if "HIVEMIND_MEMORY_SHARING_STRATEGY" not in os.environ:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    if getattr(control.ControlClient._read_from_persistent_conn, "_p2ptrain_fixed", False):  # noqa: SLF001
        return
    _read_from_persistent_conn._p2ptrain_fixed = True  # type: ignore[attr-defined]
    control.ControlClient._read_from_persistent_conn = _read_from_persistent_conn  # noqa: SLF001
