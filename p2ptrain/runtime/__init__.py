"""p2ptrain.runtime: training a stage, alone or in a plan, over any link.

- ``config``: ``TrainConfig``, the training configuration (one frozen tree, from flags or TOML).
- ``session``: one stage in training: module, optimizer and data built from a ``TrainConfig``.
- ``executor``: one stage of one pipeline for one step: a pipeline ``schedule``, then the group's
  all-reduce (``allreduce``, in ``buckets`` overlapped with backward); ``link``: the executor's view of the
  transport (and of a replica group); ``outer_rounds``: DiLoCo's rounds of a stage replica (the executor's, at
  rounds' ends); ``topology``: who holds what in an epoch; ``wire``: how tensors travel (codecs);
  ``wire_quality``: what a lossy wire costs, side by side.
- ``reference``: single-process training, the reference every plan reproduces; ``stage_boundaries``: a lossy
  wire's round trips where a run's stages cut the model, inside that one process.
- ``checkpoint``: a stage's state by full-model name, on disk; ``gather``: the full model from a checkpoint's
  stages; ``init_from``: starting from existing weights.
- ``worker_launcher`` and ``worker``: ``p2ptrain train --stages S --replicas D``, S × D processes on loopback;
  ``plan_file``: a fixed plan for it; ``procgroup``: child processes that never outlive their parent;
  ``forkserver``: forking children from one process that imported torch and hivemind once; ``quick_exit``:
  how those children end (what others see of an exit, without the interpreter's teardown).
- ``calibration``, ``compute_speed``, ``memory``, ``throughput``: what a device measures of itself, emulated
  compute speed, activation memory, tokens/s and MFU.
"""
