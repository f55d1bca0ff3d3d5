"""p2ptrain.net.nat: reaching peers behind NAT.

- ``relay``: libp2p circuit relays as p2pd runs them, and the addresses that go through them.
- ``forward``: streams forwarded by a public peer to a peer behind NAT (``p2ptrain/forward``).
"""
