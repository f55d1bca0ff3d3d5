"""p2ptrain.agent: the agent a participant runs, and the local swarm of agents.

- ``config``: ``AgentConfig`` (one TOML tree: run, initial peers, ``[train]``, ``[membership]``, ``[plan]``,
  ``[links]``, ``[dht]``, ``[transport]``, ``[emulation]``, ``[profile]``, ``[churn]``, ``[liveness]``,
  ``[checkpoint]``).
- ``agent``: ``Agent(config, stop).run() -> AgentResult``: join, profile, measure, elect, plan, follow, train.
- ``profile``: ``profile_device`` (name, memory, matmul TFLOP/s; cached per device and version).
- ``membership``: live peers from verified peer records; ``plan_trigger`` (expected peers or join deadline).
- ``links``: ``LinkProber``, the background thread that measures links and publishes this agent's row.
- ``leader``: the cluster from records (``build_cluster``), the workload, ``make_plan`` by strategy, and who
  keeps each stage's warm copy and how often (``warm_copies``).
- ``epoch``: ``run_epoch``: train one plan epoch through ``runtime.session.StageTrainer``, heartbeats.
- ``churn``: where a re-planned epoch starts and from whose state (``restart_point``); ``replan``: when the
  leader re-plans (``ReplanWatch``: a halted trainer, joiners); ``stage_state``: the states a trainer keeps
  (``StateKeeper``) and their transfer (``send_state``/``recv_state``).
- ``liveness``: heartbeat pings (``LivenessMonitor``, ``PeerHealth``) and when an epoch halts
  (``epoch_failure``); ``backup``: warm copies sent and received (``BackupSender``/``BackupReceiver``);
  ``state_store``: every state an agent can serve, in memory and on its own disk (``StateStore``).
- ``events``: the agent's JSON-lines event file (what the swarm reads).
- ``swarm``: ``run_swarm(SwarmConfig, stop) -> SwarmResult``, a bootstrap and N agent processes here;
  ``swarm_report``: its live display and summary.

Importing this package imports nothing heavy; the submodules import torch and hivemind.
"""
