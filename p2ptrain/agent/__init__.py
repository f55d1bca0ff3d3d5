"""p2ptrain.agent: the agent a participant runs.

- ``config``: ``AgentConfig`` (one TOML tree: run, initial peers, ``[train]``, ``[membership]``, ``[plan]``,
  ``[links]``, ``[dht]``, ``[transport]``, ``[emulation]``, ``[profile]``, ``[churn]``, ``[liveness]``,
  ``[checkpoint]``).
- ``agent``: ``Agent(config, stop).run() -> AgentResult``: join, profile, measure, elect, plan, follow, train.
- ``profile``: ``profile_device`` (name, memory, matmul TFLOP/s; cached per device and version).
- ``links``: ``LinkProber``, the background thread that measures links and publishes this agent's row.
- ``epoch``: ``run_epoch``: train one plan epoch through ``runtime.session.StageTrainer``, heartbeats.
- ``senders``, ``tag_senders``: who may send this agent tensors, how much each may buffer, which tag from whom.
- ``events``: the agent's JSON-lines event file (what the swarm and the monitor read).
- ``leadership/``: who leads and what a plan is.
  ``election`` (the lowest live peer ID leads; which plan is followed), ``membership`` (live peers, when to
  plan), ``plan_maker`` (records → cluster → plan record, warm-copy keepers; pure, also run by followers to
  check), ``leader`` (``Leading``: the leader's state machine — when a plan is due, the planner off the
  loop, the plan published), ``plan_check`` (a follower's checks of a plan, passing over a leader),
  ``claims`` (compute claims bounded by calibration), ``settings`` (the run settings a plan carries).
- ``churn/``: peers come and go, nothing learned is lost.
  ``liveness`` (heartbeat pings, when an epoch halts), ``boundary`` (the step-boundary check off the
  training thread), ``replan`` (``ReplanWatch``: when the leader re-plans), ``restart`` (where a re-planned
  epoch starts and from whose state), ``quarantine`` (culprits kept out), ``stage_state`` (the states a
  trainer keeps and their transfer), ``warm_copies`` (copies of every stage on another peer),
  ``state_store`` (every state an agent can serve).

The local swarm of agents is ``p2ptrain.swarm``. Importing this package imports nothing heavy; the
submodules import torch and hivemind.
"""
