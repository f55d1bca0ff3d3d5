"""p2ptrain.net.dht: the run's DHT: keys, versioned signed records, validators, admission, the node, the bootstrap.

- ``keys``: every DHT key p2ptrain uses, spelled in one place.
- ``record_base``: what every record shares: the msgpack envelope under the size cap, versions, bounds.
- ``records``: the record schemas agents publish (peers, links, progress, ...); ``plan_record``: the
  leader's plan; ``fields``: the strict field checks they share.
- ``plan_store``: a plan on the DHT as a small head and its parts, read once per reader and epoch.
- ``validators``: which entries a DHT node stores and a reader accepts (signatures, admission, schemas).
- ``admission``: open runs, and closed ones (listed peers or holders of a join token).
- ``refresh``: keeps this peer's own records alive until replaced or withdrawn.
- ``node``: ``SwarmDHT``, the synchronous facade over ``hivemind.DHT``: verified reads, deadlines, shutdown.
- ``relaying``: the DHT process with p2pd's relay flags, and dials through circuit relays inside it.
- ``pipe_fix``: the DHT process reads each call from its pipe whole (hivemind's loop could read half of one).
- ``retry``: a DHT call tried again with back-off while a crowd joins (an agent's first stores).
- ``counters``: what this peer's DHT calls cost, by record kind (``DHTCounters``, the ``dht_traffic`` event).
- ``row_history``: the links rows this peer read lately, by version: a plan is checked on its leader's.
- ``bootstrap``: the DHT-only bootstrap peer (``p2ptrain bootstrap``).
"""
