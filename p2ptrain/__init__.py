"""p2ptrain: decentralized training of foundation models on heterogeneous networks.

Importing the package has no side effects: no logging setup, no environment changes, no heavy imports.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
