"""p2ptrain.agent.leadership: Leadership: who leads, how a plan is made from the run's records, and how a follower checks it."""
