"""Links measured in O(k) per peer against the full matrix (same code as ``p2ptrain bench links``).

    python benchmarks/links.py [--devices 64,256] [--perturbation 0.1] [--rounds 3] [--json]
"""

from p2ptrain.bench.links import command

if __name__ == "__main__":
    command()
