"""p2ptrain.model: the GPT, its pipeline stages, the data and the loss convention (plain torch).

- ``gpt``: ``GPT(shape, layers=None, *, seed, device)``, the full model or one contiguous range of blocks.
- ``init``: each parameter drawn from ``(seed, its name)``, so stages and the full model agree.
- ``stage``: ``stage_layer_range``, ``build_stage``, ``stage_state_dict``.
- ``loss``: ``micro_batch_loss``, the one loss every trainer uses.
- ``optim``: ``OptimizerConfig``, ``build_optimizer`` (AdamW).
- ``lr_schedule``: ``lr_at``, ``set_lr`` (the learning rate of each step: constant, or a warm-up then cosine,
  linear or warm-up–stable–decay).
- ``data``: byte tokens, the built-in corpus, ``TrainData.global_batch``, ``shard_of``, ``micro_batches``.

Importing this package imports nothing heavy; the submodules import torch.
"""
