"""p2ptrain: decentralized training of foundation models on heterogeneous networks.

Importing the package has no side effects: no logging setup, no environment changes, no heavy imports.
Its parts, low to high (docs/design.md, "Layers"):

- ``config``, ``errors``, ``futures``, ``lifecycle``: the config loader, the exceptions, waiting on many
  futures, signals and ordered shutdown.
- ``planning/``: pure planning (cluster, cost model, scheduler); ``model/``: the GPT, its stages, data;
  ``net/``: identity, the run's DHT, the tensor transport, NAT traversal; ``runtime/``: training a stage
  in a plan; ``verify/``: checks of members' work.
- ``agent/``: the agent a participant runs; ``export``: a checkpoint as a Hugging Face model.
- ``swarm/``: the local swarm; ``monitor/``: the run monitor; ``bench/``: the benchmarks; ``cli/``: the
  ``p2ptrain`` command (``__main__``: ``python -m p2ptrain``).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
