"""``python -m p2ptrain`` runs the command line."""

from p2ptrain.cli import main

main()
