"""hivemind's unary calls survive calls given up on (``p2p_fixes``): a reply to a call its caller cancelled is
dropped, not the end of every unary call of the process."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest
from hivemind.p2p.p2p_daemon_bindings import control
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import p2pd_pb2

from p2ptrain.net import p2p_fixes
from p2ptrain.net.transport.endpoint import Transport, TransportConfig
from p2ptrain.net.transport.status import PeerStatus

RUN = "fixes"


def _framed(message) -> bytes:
    body = message.SerializeToString()
    size, prefix = len(body), bytearray()
    while True:  # unsigned varint
        byte, size = size & 0x7F, size >> 7
        prefix.append(byte | (0x80 if size else 0))
        if not size:
            return bytes(prefix) + body


def _reply(call_id: uuid.UUID, payload: bytes):
    answer = p2pd_pb2.CallUnaryResponse(response=payload)
    return p2pd_pb2.PersistentConnectionResponse(callId=call_id.bytes, callUnaryResponse=answer)


def test_a_reply_to_a_cancelled_call_is_dropped_and_the_next_reply_still_arrives():
    p2p_fixes.apply()

    async def scenario():
        client = object.__new__(control.ControlClient)  # only the state the reading loop touches
        client._pending_calls, client._handler_tasks = {}, {}
        loop = asyncio.get_running_loop()
        given_up, waiting, after_close = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        client._pending_calls[given_up] = loop.create_future()
        client._pending_calls[given_up].cancel()  # its caller's timeout fired; the reply is already on its way
        client._pending_calls[waiting] = loop.create_future()
        reader = asyncio.StreamReader()
        reading = asyncio.create_task(client._read_from_persistent_conn(reader))
        reader.feed_data(_framed(_reply(given_up, b"late")) + _framed(_reply(waiting, b"on time")))
        assert await asyncio.wait_for(client._pending_calls[waiting], 5.0) == b"on time"
        assert not reading.done()  # the loop that reads every unary reply of the process still runs
        client._pending_calls[after_close] = loop.create_future()
        reader.feed_eof()  # the daemon closed the connection: a call still waiting fails now, not at its deadline
        await asyncio.wait_for(reading, 5.0)
        with pytest.raises(P2PDaemonError, match="closed"):
            client._pending_calls[after_close].result()

    asyncio.run(scenario())


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_heartbeats_go_on_after_many_rounds_were_given_up_on_from_another_thread():
    # what an agent frozen mid-round does when it wakes (``liveness``: the round's deadline passes, the caller
    # gives up on it while its answers arrive): before the fix the reading task died within ~100 such rounds and
    # the process could ping nobody and answer nobody until it exited
    config = TransportConfig(call_timeout_s=30.0)
    with Transport(RUN, config) as a, Transport(RUN, config, initial_peers=a.visible_maddrs) as b:
        peer, back = str(a.peer_id), str(b.peer_id)
        assert isinstance(b.ping_all([peer], 10.0)[peer], PeerStatus)
        rng = random.Random(0)
        for _ in range(400):
            try:
                b.run_coroutine(b._ping_all([peer] * 3, 2.0), rng.uniform(0.0005, 0.005))  # noqa: SLF001
            except TimeoutError:
                pass  # given up on, as the liveness thread does after its deadline
        # b still calls, and still answers: once the daemon has worked through the 1,200 streams given up on (on
        # a loaded 2-core machine that took CI more than one 10 s ping); with the reading task dead, never
        assert isinstance(_answer(b, peer, 60.0), PeerStatus)
        assert isinstance(_answer(a, back, 60.0), PeerStatus)


def _answer(transport: Transport, peer: str, within_s: float):
    """A ping's answer from ``peer``, pinging again (10 s each) until one comes or ``within_s`` passed."""
    deadline = time.monotonic() + within_s
    while not isinstance(answer := transport.ping_all([peer], 10.0)[peer], PeerStatus) and time.monotonic() < deadline:
        time.sleep(0.5)
    return answer


_FUTURE_CHILDREN = """
import json, os, sys
import psutil
from p2ptrain.net import p2p_fixes
p2p_fixes.apply()
import hivemind, torch
from hivemind.utils.mpfuture import MPFuture
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
dht.store("k", b"v", hivemind.utils.get_dht_time() + 30)  # futures made here, fulfilled in the forked DHT process
value = dht.get("k", latest=True).value
future = MPFuture()
names = sorted(c.name() for c in psutil.Process().children(recursive=True))
dht.shutdown()
print(json.dumps({"strategy": torch.multiprocessing.get_sharing_strategy(), "children": names, "value": value.decode()}))
"""


@pytest.mark.integration
@pytest.mark.parametrize("variable, strategy, manager", [(None, "file_descriptor", False),
                                                          ("file_system", "file_system", True)])
def test_futures_share_memory_without_a_manager_process_unless_the_user_says_otherwise(variable, strategy, manager):
    """hivemind's own default starts a ``torch_shm_manager`` per process on its first future; after ``apply()`` a
    process's DHT works with none, and a strategy the user set through hivemind's variable stands."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}
    if variable:
        env["HIVEMIND_MEMORY_SHARING_STRATEGY"] = variable
    out = subprocess.run([sys.executable, "-c", _FUTURE_CHILDREN], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["strategy"] == strategy and result["value"] == "v", result
    assert ("torch_shm_manager" in result["children"]) == manager, result
    assert "p2pd" in result["children"]  # the DHT was up when its children were listed
