"""p2ptrain.model: the GPT, its pipeline stages, the data and the loss convention (plain torch).

- ``gpt``: ``GPT(shape, layers=None, *, seed, device)``, the full model or one contiguous range of blocks.
- ``init``: each parameter drawn from ``(seed, its name)``, so stages and the full model agree.
- ``subspace``: the residual stream in a fixed k-dimensional subspace (``[train] subspace``), so a stage boundary
  carries k values a token both ways, exactly; ``absorb`` turns it into ordinary weights for the export.
- ``stage``: ``stage_layer_range``, ``build_stage``, ``stage_state_dict``.
- ``loss``: ``micro_batch_loss``, the one loss every trainer uses.
- ``optim``: ``OptimizerConfig``, ``build_optimizer`` (AdamW).
- ``lr_schedule``: ``lr_at``, ``set_lr`` (the learning rate of each step: constant, or a warm-up then cosine,
  linear or warm-up–stable–decay).
- ``data``: byte tokens, the built-in corpus, ``TrainData.global_batch``, ``shard_of``, ``micro_batches``;
  ``tokenizer``: byte-level and BPE tokenizers; ``prepare`` and ``prepared``: ``p2ptrain data prepare``'s
  memory-mapped token shards and their manifest.
- ``hyperparams``: each preset's optimizer recipe; ``clip``: gradient clipping by the global norm, alike on
  one process and a pipeline; ``precision``: mixed precision inside a stage; ``outer``: DiLoCo's outer step;
  ``compiled``: ``torch.compile`` of a stage's blocks (``[train] compile``) and ``check_compile``.
- ``hf_checkpoint``: Hugging Face checkpoint folders, their names for our parameters both ways.

Importing this package imports nothing heavy; the submodules import torch.
"""
