"""Verified work: checks that catch a member computing or sending wrong values (docs/verification.md).

Pure functions over tensors and messages: ``sketch`` (linear sketches, the all-reduce sum check, the challenge
seed), ``bounds`` (each codec's error bound from a message), ``reduce_check``, ``recompute`` (redoing a
micro-batch), ``commit`` (digests, challenges); ``loopback`` runs a group's all-reduce in one process.
"""
