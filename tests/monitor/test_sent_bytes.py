"""The transport's byte counter, where the heartbeats' ``sent_bytes`` (and so the monitor's traffic per step)
come from: two real transports on loopback; the counter holds the payload bytes of the messages the receiver
accepted, and nothing of one it refused."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.errors import MessageRejected
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.messages import MessageKind, Tag

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

RUN = "sentbytes"
CONFIG = TransportConfig(call_timeout_s=5.0)


def test_the_transport_counts_the_payload_bytes_receivers_accepted():
    with Transport(RUN, CONFIG) as a, Transport(RUN, CONFIG, initial_peers=a.visible_maddrs) as b:
        values = [torch.randn(3, 100), torch.arange(7, dtype=torch.int64), torch.ones(5, dtype=torch.bfloat16),
                  torch.empty(0)]
        tags = [Tag(RUN, 0, 0, MessageKind.ACTIVATION, micro_batch=i) for i in range(len(values))]
        assert (a.sent_bytes, b.sent_bytes) == (0, 0)
        b.send(a.peer_id, tags[0], values[0])
        assert b.sent_bytes == 1200
        for future in [b.send_async(a.peer_id, tag, value) for tag, value in zip(tags[1:], values[1:], strict=True)]:
            future.result(timeout=10)
        assert b.sent_bytes == 1200 + 56 + 10 + 0
        with pytest.raises(MessageRejected):  # a duplicate: refused on its header, not counted
            b.send(a.peer_id, tags[0], values[0])
        assert b.sent_bytes == 1266
        received = a.recv(tags[0], b.peer_id, values[0].shape, values[0].dtype)
        a.send(b.peer_id, Tag(RUN, 0, 0, MessageKind.ACTIVATION_GRAD), received)
        assert (a.sent_bytes, b.sent_bytes) == (1200, 1266)
