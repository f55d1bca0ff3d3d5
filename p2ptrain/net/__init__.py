"""p2ptrain.net: the network below the agent, in three parts that meet only through ``nat``.

- ``identity``: one RSA key is the libp2p peer ID and the DHT signing key.
- ``dht/``: the run's DHT — ``keys`` (every key, spelled once), ``records`` / ``record_base`` /
  ``plan_record`` / ``fields`` (versioned, validated, signed records), ``validators`` and ``admission`` (what
  a DHT node stores, who may take part), ``refresh`` (own records kept alive), ``node`` (``SwarmDHT``, the
  synchronous facade), ``bootstrap`` (the DHT-only bootstrap peer).
- ``transport/``: tensors over libp2p — ``messages`` (message kinds, tags and headers, tensors as bytes),
  ``frames`` / ``streamio`` (bytes on a stream), ``servicer`` (the ``rpc_*`` endpoints), ``channel`` (the
  sending streams), ``mailbox`` (what a receiver accepts), ``emulation`` / ``pacing`` (emulated links),
  ``probe`` / ``probe_session`` (measuring links), ``counters`` (its control traffic), ``status`` (the heartbeat payload), ``endpoint``
  (``Transport``: one event loop, a synchronous facade, a deadline on every call).
- ``nat/``: ``relay`` (circuit relays and relayed addresses), ``forward`` (streams forwarded by a public peer).
- ``counters``: counts of an agent's calls by kind (the DHT's, the transport's control traffic).
- ``p2p_fixes``: a fix to hivemind's daemon client (a reply to a call given up on no longer ends every unary
  call of the process), applied before any client starts.

Process lifecycle (signals, ordered shutdown) is ``p2ptrain.lifecycle``; leader election is
``p2ptrain.agent.leadership.election``.
"""
