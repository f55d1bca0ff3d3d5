"""p2ptrain.net.transport: tensors over libp2p (and plain TCP where peers reach each other).

- ``endpoint``: ``Transport``: one event loop on a thread of its own, a synchronous facade, a deadline on
  every call; ``calls``: its sends and receives in flight by epoch, and an epoch's abort.
- ``messages``: a message's kind, tag and header, refusals; ``frames`` and ``streamio``: its bytes on a
  stream, with few copies.
- ``servicer``: the ``rpc_*`` endpoints; ``replies``: a call's reply, made, read and awaited; ``channel``: the sending streams of ``rpc_push``; ``mailbox``:
  what a receiver accepts and buffers; ``direct``: the direct data plane over sealed TCP; ``sealed``: a direct
  connection's bytes, sealed, moved by threads of its own.
- ``status``: what a ping answers (the liveness payload, pure); ``counters``: the control traffic (pings, probes)
  this peer sent, by kind.
- ``emulation`` and ``pacing``: emulated links and access lines, and keeping emulated time.
- ``probe`` and ``probe_session``: a link's latency and bandwidth, measured over the transport's own rpc;
  ``access_probe``: this peer's own line, from flows to several peers at once; ``probe_gate``: which link
  measurements run through a peer at once.
"""
