"""The control plane's cost per peer, measured in a swarm and modelled at scale (same code as
``p2ptrain bench control_plane``).

    p2ptrain swarm --agents 8 --stages 2 --steps 30 --workdir /tmp/cp8
    python benchmarks/control_plane.py /tmp/cp8 [--check /tmp/cp16] [--sizes 64,256,1000] [--json]
"""

from p2ptrain.bench.control_plane import command

if __name__ == "__main__":
    command()
