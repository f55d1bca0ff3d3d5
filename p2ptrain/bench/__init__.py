"""p2ptrain.bench: the measurements ``p2ptrain bench`` and ``benchmarks/`` print; importable so that one
benchmark can call another's.

- ``planner``: our scheduler on the paper's five networks and at 1024 devices, against the paper's figures.
- ``links``: the planner on links estimated from the probe graph's measurements against the full matrix.
- ``control_plane``: each agent's DHT and control traffic a minute, measured in a swarm, modelled at scale.
- ``decentralisation``: the cost of decentralisation at the paper's scale.
- ``e2e``: the local swarm on an emulated network, measured against the plan's prediction; ``e2e_report``:
  its tables and files; ``e2e_chart``: its chart.
- ``runtime``: transport throughput, and S × D workers' step time against one process; ``transport``:
  the transport beside a raw libp2p stream.
"""
