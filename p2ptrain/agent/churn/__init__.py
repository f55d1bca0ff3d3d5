"""p2ptrain.agent.churn: peers come and go, and nothing the run learned is lost.

- ``liveness``: heartbeat pings separate from data; when a peer counts as dead, stalled or a no-show.
- ``boundary``: the step-boundary check of a training agent, run off the training thread.
- ``replan``: ``ReplanWatch``: when the leader re-plans, for whom, and from which step (no I/O).
- ``restart``: where a re-planned epoch starts and from whose state (pure).
- ``quarantine``: a peer that failed an epoch stays out of the next plans for a while (pure).
- ``cover``: who explains a set of disputes: the peers in every smallest vertex cover of their graph (pure).
- ``stage_state``: the states a trainer keeps across epochs, and their transfer between agents.
- ``epoch_states``: an epoch's stage states: taken at its start, kept, copied and checkpointed at its steps, served.
- ``state_store``: every stage state an agent can serve: a distributed checkpoint without a shared disk.
- ``warm_copies``: copies of every stage on another peer: who keeps them, how often, their transfer.
"""
