"""p2ptrain.agent: the agent a participant runs.

- ``config``: ``AgentConfig`` (one TOML tree: run, initial peers, ``[train]``, ``[membership]``, ``[plan]``,
  ``[links]``, ``[dht]``, ``[transport]``, ``[emulation]``, ``[profile]``, ``[churn]``, ``[liveness]``,
  ``[checkpoint]``).
- ``agent``: ``Agent(config, stop).run() -> AgentResult``: join, profile, measure, elect, plan, follow, train.
- ``profile``: ``profile_device`` (name, memory, matmul TFLOP/s; cached per device and version).
- ``links``: ``LinkProber``, the background thread that measures links and publishes this agent's row.
- ``epoch``: ``run_epoch``: train one plan epoch through ``runtime.session.StageTrainer``, heartbeats.
- ``epoch_watch``: ``EpochWatch``, what the heartbeats watch of the epoch followed: no-shows, aborts.
- ``shaping``: ``LinkShaping``, the emulated network's links and the access line a peer record says.
- ``membership_reader``: ``MembershipReader``, who is live at each poll: claims bounded, the dead left out.
- ``senders``, ``tag_senders``: who may send this agent tensors, how much each may buffer, which tag from whom.
- ``events``: the agent's JSON-lines event file (what the swarm and the monitor read).
- ``leadership/``: who leads and what a plan is (election, standing, membership, the plan maker, the
  leader, its judgement, pricing and watch, disputes, a follower's plan checks, claims, settings, the stage count); its docstring maps it.
- ``churn/``: peers come and go, nothing learned is lost (liveness, the step-boundary check, re-plans,
  restarts, quarantine, stage states, the state store, warm copies); its docstring maps it.

The local swarm of agents is ``p2ptrain.swarm``. Importing this package imports nothing heavy; the
submodules import torch and hivemind.
"""
