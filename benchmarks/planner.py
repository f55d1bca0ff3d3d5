"""Planner benchmark (same code as ``p2ptrain bench planner``).

    python benchmarks/planner.py [--seed N] [--no-large] [--json]
"""

from p2ptrain.bench.planner import command

if __name__ == "__main__":
    command()
