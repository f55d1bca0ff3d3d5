"""Verified work: checks that catch a member computing or sending wrong values (docs/verification.md).

Pure functions over tensors and messages: ``sketch`` (linear sketches, the all-reduce sum check, the challenge
seed), ``bounds`` (each codec's error bound from a message), ``reduce_check``, ``recompute`` (redoing a
micro-batch), ``commit`` (digests, challenges), ``attest`` (what an owner signs about the shards it summed),
``statement`` (signed statements a third party checks offline), ``evidence`` (a failed recompute's evidence),
``dispute`` (a third party's judgement of that evidence); ``loopback`` runs a group's all-reduce in one
process. Live, every step: ``sum_check`` (the sum check of a stage's all-reduce; ``sum_shadow`` runs it in the
next step's shadow) and ``recompute_check`` (the recompute check of a stage's members). ``config``: ``[verify]``, how a run checks its members' work.
"""
