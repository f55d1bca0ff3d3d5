"""p2ptrain.agent.leadership: who leads, how a plan is made from the run's records, how a follower checks it.

- ``election``: the lowest live peer in standing leads; which plan an agent follows (pure).
- ``standing``: who may lead once the run has a history (pure).
- ``membership``: the live peers, from the verified peer records, and when to plan.
- ``plan_maker``: records to cluster to plan record, and the warm-copy keepers (pure; followers rerun it).
- ``probe_set``: whom each peer measures (the probe graph; the links the first plan waits for).
- ``leader``: ``Leader``, the leader's side: when a plan is due, the planner off the loop, the plan published.
- ``judgement``: ``Judge``, the leader's judgement of a failure: evidence re-checked, blames counted, who is
  quarantined, the compute each trainer showed.
- ``watching``: ``Watching``, a follower's watch of the leader: when a plan is due, how long it may take,
  passing it over.
- ``pricing``: ``PlanPricing``, the workload a plan is priced with, the leader's and the followers' alike.
- ``disputes``: the leader's judgement of disputes with bulk evidence, beside its loop.
- ``searches``: a plan's searches, remembered by their inputs; a follower's in one thread of lower priority.
- ``plan_check``: a follower's checks of a plan, and passing over a leader that publishes none it accepts.
- ``checkers``: the members that check each plan by a search of their own; when the others follow on their word.
- ``following``: ``Following``, an agent's plan tracking: the plan to follow next, the records read last, when
  to pass its leader over or step aside, whether the run finished without it.
- ``plan_wait``: ``PlanWait``, how long an agent has waited for the first plan since the run last moved toward
  one (what ``membership.plan_timeout_s`` bounds).
- ``claims``: a device's compute claims, bounded by its calibration and replaced by what it shows.
- ``settings``: the run settings every agent pins and every plan carries.
- ``run_stages``: the run's stage count, fixed by the config or chosen by the leader (``stages = "auto"``).
"""
