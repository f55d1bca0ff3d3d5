"""The DHT process reads each call from its pipe whole: a fix to hivemind 1.1's ``DHT.run``.

Every call into a ``hivemind.DHT`` (a store, a get) is pickled onto a pipe that the DHT's process reads in its
event loop, which put the pipe's file descriptor in non-blocking mode (``loop.add_reader``). Python's
``Connection.send_bytes`` writes a message over 16 KiB in two writes (its length, then its bytes), so the
loop can wake on the length alone, and ``recv`` then fails with ``BlockingIOError`` with the message half
read; hivemind logs it and reads on, out of step with the stream, and the next ``recv`` ends the process
(``EOFError``). Every store whose value is near 16 KiB (a plan's part, a full links row) risked the DHT
process. ``install`` wraps the pipe so that ``recv`` waits for the rest of a message once its first byte is
there (microseconds: the sender is writing it).
"""

from __future__ import annotations

import os
from typing import Any


class WholeMessages:
    """A read end of a ``multiprocessing`` pipe whose ``recv`` blocks until the message it started is whole."""

    def __init__(self, connection: Any):
        self._connection = connection

    def recv(self) -> Any:
        fd = self._connection.fileno()
        was_blocking = os.get_blocking(fd)
        os.set_blocking(fd, True)
        try:
            return self._connection.recv()
        finally:
            os.set_blocking(fd, was_blocking)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


def install(dht: Any) -> None:
    """In the DHT's own process, before its loop starts: its pipe's reads take whole messages."""
    if not isinstance(dht._inner_pipe, WholeMessages):  # noqa: SLF001 - hivemind's pipe, read in its ``run``
        dht._inner_pipe = WholeMessages(dht._inner_pipe)  # noqa: SLF001
