"""When a follower reads the plan records (``Following._plans_due``): a plan its heartbeats tell of is read, even
where another signer's plan of that epoch was read first (a passed-over leader's, read as the view changed)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.leadership.following import HEARD_READS, Following
from p2ptrain.net.transport.status import PeerStatus

ROGUE, LEADER, OTHER, ME = "QmA", "QmB", "QmC", "QmD"  # the rogue sorts lowest and was passed over


class Heartbeats:
    def __init__(self):
        self.said: dict[str, PeerStatus] = {}

    def statuses(self):
        return dict(self.said)

    def answered(self):
        return dict.fromkeys(self.said, time.monotonic())


def following(heartbeats: Heartbeats) -> Following:
    agent = SimpleNamespace(
        config=AgentConfig(run="reads", initial_peers=("/ip4/127.0.0.1/tcp/31337/p2p/QmQLXKi8EaWC47QUQar3TXhcUneccQXX4tdwXUxi87LUke",)), peer_id=ME, dht=SimpleNamespace(plan_listeners=[]), transport=None,
        events=None, liveness=heartbeats, _membership=SimpleNamespace(leader=LEADER), _following=None,
        _reader=SimpleNamespace(spacing=lambda following: 1.0))
    return Following(agent)


def test_a_plan_the_heartbeats_tell_of_is_read_though_another_signers_plan_of_its_epoch_was_read_first():
    heartbeats = Heartbeats()
    f = following(heartbeats)
    now = time.monotonic()
    assert f._plans_due(now)  # the leader changed (to LEADER): read at once
    # that read found the passed-over rogue's plan of epoch 1, not yet the new leader's
    f._plans_read_at, f._plans_leader, f._plans = now, LEADER, {ROGUE: SimpleNamespace(epoch=1)}
    f.max_epoch_seen = 1
    heartbeats.said = {LEADER: PeerStatus(plan=-1), OTHER: PeerStatus(plan=1)}
    # OTHER knows of epoch 1 (it may be the rogue's): read, for as many reads as HEARD_READS allows
    assert [f._plans_due(now + 0.1 * k) for k in range(HEARD_READS + 1)] == [True] * HEARD_READS + [False]
    heartbeats.said[LEADER] = PeerStatus(plan=1)  # the new leader stored its plan of epoch 1
    f._heard = (-1, 0)
    assert f._plans_due(now + 1.0)  # before: no read until PLANS_READ_S, and the new leader's epoch-1 trainers
    # found us not taking it up
    f._plans[LEADER] = SimpleNamespace(epoch=1)  # read: nothing newer is told of, nothing more is read
    assert not f._plans_due(now + 1.5)
    heartbeats.said[OTHER] = PeerStatus(plan=2)  # a newer plan: read again
    assert f._plans_due(now + 2.0)
    f.close()
