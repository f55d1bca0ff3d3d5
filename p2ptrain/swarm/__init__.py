"""p2ptrain.swarm: the local swarm: a bootstrap and N agents as processes on this machine, and what it shows.

- ``config``: ``SwarmConfig``, what a swarm is asked to run, its agent processes and its result.
- ``agent_launcher``: starts, watches and stops the processes (``p2ptrain swarm``).
- ``report``: the swarm's state from the agents' events: a live progress line and the final summary.
"""
