"""p2ptrain.swarm: The local swarm: a bootstrap and N agents as processes on this machine, and what it shows."""
