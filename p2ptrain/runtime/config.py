"""Training configuration: one frozen dataclass tree, built from flags or a TOML file (unknown keys refused).

Example ``train.toml`` (every key optional; see the field comments for units and defaults)::

    model = "small"
    steps = 200
    global_batch_size = 32
    micro_batches = 4
    seed = 1
    data = "corpus/"          # or a prepared dataset: p2ptrain data prepare corpus/ data/corpus
    precision = "bf16"        # fp32 (exact), bf16 or fp16: autocast, fp32 master weights
    eval_every = 50           # validation loss every 50 steps (needs a prepared dataset)

    wire = "bf16"          # fp32 (exact), bf16, int8, int4: p2ptrain.runtime.wire
    schedule = "1f1b"      # gpipe or 1f1b: p2ptrain.runtime.schedule
    overlap = true         # all-reduce buckets during the last backward: p2ptrain.runtime.buckets

    [optimizer]               # every key optional: the preset's recipe (p2ptrain.model.hyperparams) fills the rest
    lr = 1e-3
    weight_decay = 0.1
    lr_schedule = "cosine"    # constant, cosine, linear or wsd: p2ptrain.model.lr_schedule
    warmup_steps = 20         # or warmup_fraction = 0.05 (a share of the run)
    min_lr = 1e-4             # or min_lr_ratio = 0.1 (a share of lr)
    clip = 1.0                # the gradients' global norm is clipped to this (0: no clipping)

The defaults train the ``tiny`` preset on the built-in corpus for a handful of steps in seconds on a CPU.

``stages`` and ``replicas`` describe the plan a distributed run uses (S × D workers), ``layers`` its layer
split when it is not the even one (a plan for mixed devices; e.g. ``layers = [[0, 5], [5, 8]]``). Single-process
training ignores ``stages`` (it holds every layer) but follows ``replicas`` and ``micro_batches`` to split
each global batch exactly as that plan would, so its float32 sums happen in the same groups. An agent's
``stages`` may be ``"auto"``: the leader of the run's first plan chooses S within ``min_stages`` ..
``max_stages`` (``agent.leadership.run_stages``); every plan after keeps it. ``p2ptrain train`` needs a number.

With a prepared dataset (``p2ptrain data prepare``) the model's vocabulary is the dataset tokenizer's
(``vocab_size`` None); an explicit ``vocab_size`` must hold every token id. ``precision`` other than fp32
runs the stages' forward and backward under autocast (``p2ptrain.model.precision``); fp32 is the exact mode.
``activation_checkpointing`` recomputes each block's activations in the backward pass (less memory, about
a third more compute). ``compile`` runs each block through ``torch.compile`` (``p2ptrain.model.compiled``):
faster steps on an accelerator after seconds of compiling; its fp32 losses agree with eager's to about 1e-7
relative, not bit for bit, so it is a run setting every agent of a run shares. Off by default (a CPU pays
seconds to compile, tens with a cold cache, for no faster steps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from p2ptrain.config import option
from p2ptrain.model.data import check_split, data_vocab_size
from p2ptrain.model.optim import OptimizerConfig
from p2ptrain.model.outer import EVERY_STEP, SYNC_MODES, DiLoCoConfig, Rounds
from p2ptrain.model.stage import stage_layer_range
from p2ptrain.planning.model_shapes import MODEL_PRESETS, ModelShape, model_shape
from p2ptrain.planning.split import check_layers
from p2ptrain.runtime.schedule import SCHEDULES, ScheduleName
from p2ptrain.runtime.wire import WIRE_FORMATS, WireName

Device = Literal["cpu", "cuda", "auto"]
Precision = Literal["fp32", "bf16", "fp16"]
SyncMode = Literal["every-step", "diloco"]
AUTO_STAGES = "auto"  # ``TrainConfig.stages``: the leader chooses S (agents only)


@dataclass(frozen=True)
class TrainConfig:
    """What to train, on what data, for how long, and how each step's global batch is split."""

    model: str = option("tiny", "Model preset.", choices=MODEL_PRESETS)  # a name of planning.model_shapes.MODEL_PRESETS
    steps: int = option(10, "Optimizer steps.", min=1)  # optimizer updates
    global_batch_size: int = option(16, "Global batch, in sequences.", min=1)  # over all replicas
    micro_batches: int = option(2, "Micro-batches per replica.", min=1)  # per replica per step (M)
    seq_len: int | None = option(None, "Tokens per sequence.", min=1, default_text="the preset's")
    # parameters are drawn from (seed, name); batches from (seed, step)
    seed: int = option(0, "Seed of parameters and batches.", min=0)
    # a UTF-8 text file, a folder of .txt, or a prepared dataset; None: the built-in corpus
    data: str | None = option(None, "A UTF-8 text file or a folder of .txt files.", default_text="built-in corpus")
    vocab_size: int | None = None  # None: a prepared dataset's tokenizer's, else the preset's
    device: Device = option("auto", "Where to train.")  # "auto": cuda if available, else cpu
    # torch intra-op CPU threads; None: torch's default
    num_threads: int | None = option(None, "CPU threads for torch.", min=1, default_text="torch's")
    deterministic: bool = True  # torch.use_deterministic_algorithms while training (warn-only)
    # pipeline stages (S); 1 with replicas 1: plain single-process training
    stages: int | Literal["auto"] = option(
        1, "Pipeline stages; auto: the leader of the run's first plan chooses (within [train] min_stages .. "
        "max_stages), every later plan keeps it.")
    min_stages: int = 1  # with stages = "auto": the fewest stages the leader may choose
    max_stages: int | None = None  # ... and the most; None: the model's blocks
    # data-parallel replicas per stage (D)
    replicas: int = option(1, "Replicas per stage (distributed runtime).", min=1)
    layers: tuple[tuple[int, int], ...] | None = None  # the plan's split: stage j holds blocks [a, b); None: even
    # fp32 (exact), bf16 or fp16 (autocast; fp16 with loss scaling)
    precision: Precision = option("fp32", "Compute precision (autocast; fp32 master weights; fp32 is exact).")
    activation_checkpointing: bool = option(False, "Recompute block activations in backward (less memory).")
    # torch.compile each block (p2ptrain.model.compiled); not bit for bit eager's
    compile: bool = option(False, "torch.compile each transformer block (not bit for bit eager; seconds to compile).")
    # validation loss every this many steps and after the last (0: never)
    eval_every: int = option(0, "Validation loss every this many steps and at the end (a prepared dataset).", min=0)
    eval_batches: int = 4  # validation batches of global_batch_size sequences each
    # how tensors travel between workers (p2ptrain.runtime.wire); fp32 is exact
    wire: WireName = option("fp32", "How tensors travel between workers (fp32 is exact).")
    schedule: ScheduleName = option("gpipe", "Pipeline schedule.")  # gpipe or 1f1b (p2ptrain.runtime.schedule)
    # start each gradient bucket's all-reduce during the last backward (exact either way)
    overlap: bool = option(True, "All-reduce gradient buckets during the last backward.")
    bucket_elements: int = 1 << 18  # gradient elements per all-reduce bucket (1 MiB of fp32)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # unsaid keys: the preset's recipe
    # data-parallel sync: every step, or DiLoCo rounds ([diloco], model.outer)
    sync: SyncMode = option("every-step", "Data-parallel synchronisation: every step, or DiLoCo rounds "
                            "(p2ptrain.model.outer).")
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)  # the outer loop, with sync = "diloco"
    init_from: str | None = option(  # start from these weights: a Hugging Face folder or a p2ptrain checkpoint
        None, "Start from these weights: a Hugging Face folder (GPT2LMHeadModel or LlamaForCausalLM safetensors and "
        "config.json) or a p2ptrain checkpoint of any shape of the preset's family (the preset gives the recipe).",
        path="dir", default_text="drawn from --seed")
    activation: str | None = None  # None: the preset's, or init_from's (gpt: gelu or gelu_new)
    # k > 0: the residual stream in a fixed k-dimensional subspace, so stage boundaries carry k values a token
    # instead of hidden_size, exactly (p2ptrain.model.subspace); 0: the unconstrained model
    subspace: int = option(0, "Residual stream in a fixed subspace of this rank: stage boundaries carry this many "
                           "values a token instead of the hidden size, exactly (0: off).", min=0)

    def __post_init__(self) -> None:
        shape = model_shape(self.model)  # ValueError naming the presets
        if self.wire not in WIRE_FORMATS:
            raise ValueError(f"unknown wire format {self.wire!r} (known: {', '.join(WIRE_FORMATS)})")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r} (known: {', '.join(SCHEDULES)})")
        if self.sync not in SYNC_MODES:
            raise ValueError(f"unknown sync mode {self.sync!r} (known: {', '.join(SYNC_MODES)})")
        if self.bucket_elements < 1:
            raise ValueError(f"bucket_elements must be at least 1, got {self.bucket_elements}")
        for name in ("steps", "global_batch_size", "micro_batches", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {self.seq_len}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        object.__setattr__(self, "optimizer", self.optimizer.for_model(self.model))  # the preset's recipe filled in
        if self.optimizer.warmup_steps is not None and self.optimizer.warmup_steps > self.steps:
            raise ValueError(f"optimizer.warmup_steps={self.optimizer.warmup_steps} exceeds the run's {self.steps} "
                             "steps (the warm-up would never end)")
        check_split(self.global_batch_size, self.replicas, self.micro_batches)
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError("eval_every must be non-negative and eval_batches at least 1")
        tokens = data_vocab_size(self.data)  # a malformed dataset manifest: a one-line ValueError
        if self.vocab_size is None and tokens != 256:
            object.__setattr__(self, "vocab_size", tokens)
        if self.vocab_size is not None and self.vocab_size < tokens:
            raise ValueError(f"vocab_size {self.vocab_size} cannot hold the {tokens} token ids of the data's tokenizer")
        if self.activation is not None:
            dataclasses.replace(shape, activation=self.activation)  # a ValueError naming the family's activations
        if self.subspace:
            dataclasses.replace(shape, subspace=self.subspace)  # a ValueError at or past the hidden size
            if self.init_from is not None:
                raise ValueError("subspace: weights to start from (init_from) are not in a subspace; train them "
                                 "without one (subspace = 0)")
        if self.init_from is not None:
            from p2ptrain.runtime.init_from import check_data, open_init_source

            check_data(open_init_source(self.init_from), self.data, tokens)
            shape = self.shape  # the checkpoint's, checked against the preset's family (one line)
        self._check_stages(shape.num_layers)
        if self.layers is not None:
            object.__setattr__(self, "layers", check_layers(self.layers, shape.num_layers, self.stages))

    def _check_stages(self, num_layers: int) -> None:
        """``stages`` a positive number of at most the model's blocks, or "auto"; the bounds within them."""
        if self.stages != AUTO_STAGES and (isinstance(self.stages, bool) or not isinstance(self.stages, int)):
            raise ValueError(f'stages must be a number of stages or "auto", got {self.stages!r}')
        if self.stages != AUTO_STAGES and self.stages < 1:
            raise ValueError(f"stages must be at least 1, got {self.stages}")
        high = num_layers if self.max_stages is None else self.max_stages
        if not 1 <= self.min_stages <= high <= num_layers:
            raise ValueError(f"min_stages={self.min_stages} and max_stages={high} must satisfy 1 <= min_stages <= "
                             f"max_stages <= the model's {num_layers} blocks")
        if self.stages == AUTO_STAGES:
            if self.layers is not None:
                raise ValueError('layers needs a number of stages, not stages = "auto" (the plan splits the model)')
            return
        stage_layer_range(num_layers, 0, self.stages)  # ValueError if S does not fit the model
        if not self.min_stages <= self.stages <= high:
            raise ValueError(f"stages={self.stages} lies outside min_stages={self.min_stages} .. max_stages={high}")

    @property
    def stages_auto(self) -> bool:
        """Whether the leader chooses the stage count (``stages = "auto"``)."""
        return self.stages == AUTO_STAGES

    @property
    def stage_bounds(self) -> tuple[int, int]:
        """The stage counts a plan of this run may have: ``stages`` itself, or ``min_stages`` .. ``max_stages``
        (the model's blocks when unset) with ``"auto"``."""
        if not self.stages_auto:
            return self.stages, self.stages
        return self.min_stages, self.shape.num_layers if self.max_stages is None else self.max_stages

    @property
    def shape(self) -> ModelShape:
        """The preset's shape with ``seq_len`` applied (with ``init_from``, the checkpoint's: ``run_shape``): what
        every stage builds and every batch holds."""
        shape = model_shape(self.model)
        if self.seq_len is not None:
            shape = dataclasses.replace(shape, seq_len=self.seq_len)
        if self.vocab_size is not None:
            shape = dataclasses.replace(shape, vocab_size=self.vocab_size)
        if self.init_from is not None:
            from p2ptrain.runtime.init_from import open_init_source, run_shape

            return run_shape(open_init_source(self.init_from), shape, self.activation, self.model)
        if self.activation is not None:
            shape = dataclasses.replace(shape, activation=self.activation)
        if self.subspace:
            shape = dataclasses.replace(shape, subspace=self.subspace)  # a ValueError past the hidden size
        return shape

    @property
    def init_digest(self) -> str:
        """The digest of the weights the run starts from ("" : drawn from the seed)."""
        if self.init_from is None:
            return ""
        from p2ptrain.runtime.init_from import open_init_source

        return open_init_source(self.init_from).digest

    @property
    def micro_batch_size(self) -> int:
        """Sequences in one micro-batch: B / (D · M)."""
        return self.global_batch_size // (self.replicas * self.micro_batches)

    @property
    def diloco_on(self) -> bool:
        return self.sync == "diloco"

    @property
    def rounds(self) -> Rounds:
        """Where the run's committed states lie: after every step with every-step sync; with DiLoCo at rounds'
        ends only, since inside a round each replica trains on its own shard."""
        return Rounds(self.diloco.inner_steps, self.steps) if self.diloco_on else EVERY_STEP

    def committed(self, done: int) -> bool:
        """Whether the state after ``done`` completed steps is a committed one (``rounds``)."""
        return self.rounds.committed(done)

    @property
    def is_distributed(self) -> bool:
        return self.stages * self.replicas > 1

    def to_dict(self) -> dict:
        """Plain data (the TOML tree): ``config_from_dict(TrainConfig, cfg.to_dict()) == cfg``."""
        return dataclasses.asdict(self)
