"""p2ptrain.agent.churn.restart: Churn and state keeping: liveness, halting, re-planning, quarantine, warm copies and stage states."""
