"""Measurements that benchmarks/ scripts print; importable so that one benchmark can call another's."""
