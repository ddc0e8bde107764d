"""The typed configuration schema of bpstrain (OmegaConf structured config).

Every knob of a run lives in one tree of dataclasses, :class:`Config`, with six
sections: ``trainer``, ``data``, ``model``, ``optimizer``, ``cluster`` and ``comm``.
Recipes (YAML) and command-line overrides are merged over these defaults by
:func:`bpstrain.config.load_config`, which also rejects unknown or mistyped keys.

Example:
    >>> from bpstrain.config import load_config
    >>> cfg = load_config({"trainer": {"epochs": 2}}, ["cluster.workers=2"])
    >>> cfg.trainer.epochs, cfg.cluster.workers
    (2, 2)

The field comments below are the reference documentation of each key; a ``comm`` key
is documented by its :class:`Knob` (doc, bounds, environment variables), the one
definition the environment reader, the loader and ``bpstrain.engine.init`` all check.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

# Names the Trainer understands; the loader validates against these so that a typo
# fails when the config is loaded, not minutes later in a child process.
LOSSES = ("cross_entropy", "nll", "mse", "l1", "smooth_l1", "bce_with_logits")
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad")
LR_SCHEDULES = ("constant", "cosine", "step")
DATASETS = ("synthetic", "digits", "image_folder")
START_METHODS = ("auto", "spawn", "forkserver", "fork")
# cluster.launcher; auto = slurm in a task of an srun step of several tasks, else local
LAUNCHERS = ("auto", "local", "ray", "slurm")
DEVICES = ("auto", "cpu", "cuda")
HIERARCHICAL = ("auto", "true", "false")
PRECISIONS = ("32", "bf16", "16")
CLIP_ALGORITHMS = ("norm", "value")
MONITOR_MODES = ("auto", "min", "max")
LOGGERS = ("csv", "tensorboard")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")

# Keys that were announced but do nothing yet: setting one is an error that says so,
# rather than a silently ignored value.
NOT_AVAILABLE: Dict[str, str] = {}
COMPRESSION_SPECS = ("none|fp16|bf16|onebit|topk:<ratio>|randomk:<ratio>|dithering:<levels>|"
                     "powersgd:<rank>|auto")


def check_compression_spec(value: Any) -> Any:
    """Raises ValueError (saying why) unless ``value`` is a compression spec string."""
    from bpstrain._compression import parse_compression  # numpy: only when set

    if not isinstance(value, str):
        raise ValueError(f"a string, not {type(value).__name__}")
    parse_compression(value)
    return value


def check_compression_rules(value: Any) -> Any:
    """Raises ValueError (saying why) unless ``value`` is a list of compression rules."""
    from bpstrain._compression import CompressionPolicy

    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"a list, not {type(value).__name__}")
    # Plain lists and dicts (an OmegaConf ListConfig of DictConfigs reaches here too).
    value = [dict(item) if isinstance(item, Mapping) else item for item in value]
    for item in value:
        if isinstance(item, dict) and not isinstance(item.get("compression", "none"), str):
            raise ValueError(f"a rule's compression is a spec string. Received: {item!r}")
        if isinstance(item, dict) and isinstance(item.get("min_size", 0), bool):
            raise ValueError(f"a rule's min_size is an integer. Received: {item!r}")
    CompressionPolicy("none", value)
    return value


def aggregate_count(value: Any) -> int:
    """Reads ``comm.aggregate``: ``"all"`` (every worker, 0) or ``"k:<K>"`` (K >= 1).

    Returns:
        K, or 0 for ``all``.

    Raises:
        ValueError: any other value, saying why.
    """
    text = str(value).strip().lower()
    if text == "all":
        return 0
    match = re.fullmatch(r"k:(\d+)", text)
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"'all' or 'k:<K>' with K >= 1. Received: {value!r}")
    return int(match.group(1))


def check_aggregate(value: Any) -> str:
    """Normalizes a ``comm.aggregate`` value (see :func:`aggregate_count`)."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"a string, not {type(value).__name__}")
    k = aggregate_count(value)
    return f"k:{k}" if k else "all"


def check_consistency(value: Any) -> str:
    """Normalizes ``comm.consistency``: ``sync``, ``ssp:<s>`` (0 <= s <= 1000) or ``async``."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"a string, not {type(value).__name__}")
    text = value.strip().lower()
    match = re.fullmatch(r"ssp:(\d+)", text)
    if text in ("sync", "async") or (match and int(match.group(1)) <= 1000):
        return text
    raise ValueError(f"'sync', 'ssp:<s>' (0 <= s <= 1000) or 'async'. Received: {value!r}")


def hierarchical_mode(value: Any) -> str:
    """Reads ``comm.hierarchical`` (a bool, or a string such as "auto", "true", "0").

    Returns:
        One of :data:`HIERARCHICAL`, or ``""`` when ``value`` is none of them.
    """
    text = str(value).strip().lower()
    if text in _TRUE_WORDS:
        return "true"
    if text in _FALSE_WORDS:
        return "false"
    return text if text == "auto" else ""


@dataclass(frozen=True)
class Knob:
    """A comm option's constraint, environment variables and documentation, in one place.

    The environment reader (:mod:`bpstrain.config.env`), the config loader and
    :func:`bpstrain.engine.init` all check values with :meth:`check`; the C++ engine
    checks the same bounds again as a last line.

    Attributes:
        doc: What the option does (the reference documentation of the key).
        env: Environment variables that set it, the first one set wins.
        min, max: Inclusive bounds of a number.
        above: Exclusive lower bound of a number (timeouts).
        choices: Allowed words (``comm.hierarchical`` also reads yes/no/1/0/on/off).
        pattern: Regular expression a string must match; ``expected`` describes it.
        parse: Validates a structured value (raises ValueError saying why, which
            :meth:`check` appends to ``expected``).
    """

    doc: str
    env: Tuple[str, ...] = ()
    min: Optional[float] = None
    max: Optional[float] = None
    above: Optional[float] = None
    choices: Tuple[str, ...] = ()
    pattern: Optional[str] = None
    expected: str = ""
    parse: Optional[Callable[[Any], Any]] = None

    def describe(self) -> str:
        """What a valid value looks like, e.g. ``an integer in [1, 64]``."""
        if self.expected:
            return self.expected
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.above is not None:
            return f"a number > {self.above:g}"
        if self.min is not None and self.max is not None:
            return f"an integer in [{self.min:g}, {self.max:g}]"
        if self.min is not None:
            return f"an integer >= {self.min:g}"
        return "a value of the key's type"

    def check(self, value: Any) -> Any:
        """Returns ``value`` (choices normalized) or raises ValueError with :meth:`describe`."""
        if self.choices:
            word = hierarchical_mode(value) if self.choices == HIERARCHICAL else str(value)
            if word not in self.choices:
                raise ValueError(self.describe())
            return word
        if self.parse is not None:
            try:
                return self.parse(value)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{self.describe()} ({err})") from None
        if self.pattern is not None:
            if not isinstance(value, str) or not re.fullmatch(self.pattern, value):
                raise ValueError(self.describe())
            return value
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.min is not None or self.max is not None or self.above is not None:
            if not number or (self.min is not None and value < self.min) or (
                    self.max is not None and value > self.max) or (
                    self.above is not None and not value > self.above):
                raise ValueError(self.describe())
        return value


def knob(default: Any, doc: str, env: Any = (), **constraint: Any) -> Any:
    """A dataclass field whose metadata carries its :class:`Knob` (a list default is
    copied for each instance)."""
    names = (env,) if isinstance(env, str) else tuple(env)
    metadata = {"knob": Knob(doc, names, **constraint)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainerConfig:
    """How long and how to train (``trainer.*``)."""

    epochs: int = 1  # passes over the (per-worker shard of the) training data
    batch_size: int = 32  # per worker, as in BytePS/Horovod; global = batch_size*workers
    steps: Optional[int] = None  # cap on optimizer steps per epoch; null = whole epoch
    loss: str = "cross_entropy"  # one of LOSSES
    seed: int = 0  # base seed; each rank seeds with seed + rank for its data order
    log_every: int = 10  # log metrics every N steps (rank 0)
    out_dir: str = "runs"  # each run gets a folder here: config, metrics, checkpoints
    device: str = "auto"  # "auto" (cuda if available), "cpu" or "cuda"
    progress: bool = True  # tqdm progress bar on rank 0
    throughput: bool = False  # print samples/s (all workers together)
    val_every: int = 1  # validate every N epochs; 0 = never
    val_steps: Optional[int] = None  # cap on validation batches; null = whole split
    checkpoint_every: int = 0  # save a checkpoint every N epochs; 0 = off
    resume: Optional[str] = None  # checkpoint path, or "auto" = latest in out_dir
    early_stopping_patience: int = 0  # epochs without improvement; 0 = off
    monitor: str = "val_loss"  # metric for early stopping / best checkpoints
    monitor_mode: str = "auto"  # one of MONITOR_MODES; auto = max for accuracy-like names
    save_top_k: int = 0  # keep the k best checkpoints by `monitor`; 0 = off
    timeline: bool = False  # write a Chrome trace of communication to the run folder
    # "32" (float32), "bf16" (bfloat16 autocast) or "16" (float16 autocast + GradScaler).
    precision: str = "32"
    gradient_clip_val: Optional[float] = None  # clip averaged gradients; null = off
    gradient_clip_algorithm: str = "norm"  # one of CLIP_ALGORITHMS: total norm or value
    loggers: List[str] = field(default_factory=lambda: ["csv"])  # subset of LOGGERS
    epoch_summary: bool = True  # print one line of metrics per epoch (rank 0)
    # Folder of this run inside out_dir; null = the next free version_N (a resumed run
    # with resume=auto continues in the folder of its checkpoint).
    run_name: Optional[str] = None


@dataclass
class DataConfig:
    """Which data to train on (``data.*``); used by recipes, ignored by ``fit(model, data)``."""

    name: Optional[str] = None  # one of DATASETS; null = data is passed to fit()
    path: Optional[str] = None  # image_folder root: class-per-subdirectory layout
    # null = auto: synthetic for name=synthetic, and for image_folder without a path.
    synthetic: Optional[bool] = None
    num_classes: int = 1000  # classes of synthetic data
    image_size: int = 224  # height = width of images (synthetic and image_folder)
    channels: int = 3  # channels of synthetic images
    synthetic_samples: int = 2048  # length of the synthetic training set
    val_fraction: float = 0.2  # held-out share (digits; image_folder without val/)
    shuffle: bool = True  # shuffle the training set every epoch
    drop_last: bool = False  # drop the last incomplete batch
    loader_workers: int = 0  # DataLoader worker processes per training process


@dataclass
class ModelConfig:
    """Which reference model a recipe builds (``model.*``); see bpstrain.models."""

    name: Optional[str] = None  # registered model name; null = model passed to fit()
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the model factory


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule (``optimizer.*``)."""

    name: str = "sgd"  # one of OPTIMIZERS
    lr: float = 0.01  # base learning rate (per worker unless scale_lr)
    momentum: float = 0.9  # sgd / rmsprop
    weight_decay: float = 0.0
    nesterov: bool = False  # sgd only
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # adam / adamw
    eps: float = 1e-8  # adam / adamw / rmsprop / adagrad
    scale_lr: bool = False  # Horovod convention: lr *= number of workers
    warmup_epochs: float = 0.0  # linear LR warm-up over this many epochs; 0 = off
    schedule: str = "constant"  # one of LR_SCHEDULES, applied after warm-up
    step_epochs: List[int] = field(default_factory=list)  # "step": decay at these epochs
    gamma: float = 0.1  # "step": multiply lr by gamma at each step epoch
    backward_passes_per_step: int = 1  # gradient accumulation before one push_pull


@dataclass
class ClusterConfig:
    """The processes of a job (``cluster.*``); the Trainer brings up a local cluster."""

    workers: int = 1  # worker processes in total (DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE)
    servers: int = 1  # summation servers (DMLC_NUM_SERVER)
    local_size: Optional[int] = None  # workers per host; null = all on this host
    secret: Optional[str] = None  # shared secret checked at the handshake
    host: str = "127.0.0.1"  # scheduler address (DMLC_PS_ROOT_URI)
    port: int = 0  # scheduler port (DMLC_PS_ROOT_PORT); 0 = pick a free one
    start_method: str = "auto"  # one of START_METHODS; auto = fork only when safe
    # With comm.fault_tolerance: how many times in all a worker that died is started again
    # (it joins the running job at the others' next admission, with their state).
    max_restarts: int = 0
    # Where fit's workers run: local = child processes here; ray = actors on the Ray
    # cluster this process is attached to (bpstrain.ray.RayExecutor; pip install bpstrain[ray]).
    launcher: str = "auto"  # one of LAUNCHERS


@dataclass
class CommConfig:
    """Knobs of the push_pull engine (``comm.*``); consumed by ``bpstrain.engine.init``.

    Each field's :class:`Knob` (``dataclasses.fields(CommConfig)[i].metadata["knob"]``,
    or :func:`comm_knobs`) is its documentation, its bounds and its environment
    variables.
    """

    partition_bytes: int = knob(
        0, "Largest piece a tensor is split into; 0 = auto: the engine sizes partitions "
        "from the link it measures at rendezvous (about 4 ms of link time, 64 KiB to 4 MiB).",
        ("BPSTRAIN_PARTITION_BYTES", "BYTEPS_PARTITION_BYTES"), min=0,
        expected="an integer >= 0 (0 = the engine chooses)")
    priority: bool = knob(True, "Priority scheduling (front layers first) on/off.",
                          "BPSTRAIN_PRIORITY")
    credit_bytes: int = knob(0, "Bytes in flight per worker; 0 = auto.",
                             "BPSTRAIN_CREDIT_BYTES", min=0,
                             expected="an integer >= 0 (0 = auto)")
    numa: str = knob(
        "auto", "Where engine threads run: auto | off | node:N | cpus:0-3,8.", "BPSTRAIN_NUMA",
        pattern=r"auto|off|node:\d+|cpus:\d+(-\d+)?(,\d+(-\d+)?)*",
        expected="'auto', 'off', 'node:N' or 'cpus:LIST' (e.g. 'cpus:0-3,8')")
    connections_per_server: int = knob(
        1, "TCP connections from a worker to each server; more only when one stream cannot "
        "fill the link.", "BPSTRAIN_CONNECTIONS_PER_SERVER", min=1, max=64)
    socket_send_buffer: int = knob(
        -1, "SO_SNDBUF of worker data sockets: -1 = auto (about 2.5 ms of the measured link, "
        "16-128 KiB), 0 = kernel autotuning, > 0 = that many bytes.",
        "BPSTRAIN_SOCKET_SEND_BUFFER", min=-1, expected="an integer >= -1 (-1 auto, 0 kernel)")
    engine_threads: int = knob(2, "Summation threads of each server.",
                               ("BPSTRAIN_ENGINE_THREADS", "BYTEPS_SERVER_ENGINE_THREAD"),
                               min=1, max=256)
    timeout: float = knob(30.0, "Seconds without a heartbeat before a peer counts as dead.",
                          "BPSTRAIN_TIMEOUT", above=0, expected="a number > 0 (seconds)")
    op_timeout: float = knob(300.0, "Seconds a synchronize()/barrier waits before raising.",
                             "BPSTRAIN_OP_TIMEOUT", above=0, expected="a number > 0 (seconds)")
    rendezvous_timeout: float = knob(120.0, "Seconds for every node to join the job.",
                                     "BPSTRAIN_RENDEZVOUS_TIMEOUT", above=0,
                                     expected="a number > 0 (seconds)")
    hierarchical: str = knob(
        "auto", "Reduce inside a host (shared memory) before talking to servers: auto = "
        "when several workers share a host; true; false.", "BPSTRAIN_HIERARCHICAL",
        choices=HIERARCHICAL)
    authenticate_bodies: bool = knob(
        True, "Tag every data frame's body (Poly1305, or HMAC-SHA256 without libcrypto); "
        "false on workers and servers alike leaves bodies untagged (headers stay "
        "authenticated): only on a network trusted not to alter packets.",
        "BPSTRAIN_AUTHENTICATE_BODIES")
    transport: str = knob(
        "tcp", "How frames move between processes: tcp, or ucx (UCX: RDMA NICs, shared memory "
        "within a host, TCP; UCX_* variables apply) / ucx:<UCX_TLS list> (e.g. ucx:tcp, "
        "ucx:rc,sm,tcp). Every process of a job uses the same one.", "BPSTRAIN_TRANSPORT",
        pattern=r"tcp|ucx(:[a-z0-9_^]+(,[a-z0-9_^]+)*)?",
        expected="'tcp', 'ucx' or 'ucx:<UCX_TLS list>' (e.g. 'ucx:tcp')")
    aggregate: str = knob(
        "all", "Straggler mitigation (backup workers): all = every worker's push counts "
        "(synchronous); k:<K> = a round is answered once K of the N workers pushed it and "
        "averaged over those K; a later push gets the same answer and is dropped, so "
        "N-K slow workers never hold up a step. Sums and averages over the whole job on "
        "the flat path (turns comm.hierarchical=auto off); not with compression.",
        "BPSTRAIN_AGGREGATE", parse=check_aggregate, expected="'all' or 'k:<K>' (e.g. 'k:3')")
    consistency: str = knob(
        "sync", "sync = every worker steps its optimizer on the averaged gradients; ssp:<s> "
        "(bounded staleness) and async = the servers hold the weights (started from rank 0's "
        "model) and apply the optimizer themselves (torch SGD/Adam; Keras SGD/Adam): ssp:<s> "
        "averages each step's gradients and lets no worker run more than s steps ahead of the "
        "slowest (ssp:0 equals sync), async applies every push at once with the learning rate "
        "divided by the worker count. fp32 parameters; not with compression or comm.aggregate.",
        "BPSTRAIN_CONSISTENCY", parse=check_consistency,
        expected="'sync', 'ssp:<s>' or 'async' (e.g. 'ssp:4')")
    staleness_lr: bool = knob(
        False, "async only: divide each push's learning rate by its staleness (updates the "
        "servers applied since that worker last read the weights, at least 1) instead of by "
        "the worker count.", "BPSTRAIN_STALENESS_LR")
    fault_tolerance: bool = knob(
        False, "A worker that dies (its connections drop) or hangs (no heartbeat for "
        "comm.timeout seconds) leaves the job and the others go on: the rounds in flight "
        "complete with the workers still in it (averages divide by the pushes they sum), "
        "rank()/size() number the workers that remain, bpstrain.engine.on_membership_change "
        "callbacks run, and the launcher keeps the job going. Off: any dead worker fails the "
        "job (PeerError everywhere). The flat path only (turns comm.hierarchical=auto off); "
        "sync, dense tensors: not with comm.aggregate k:<K>, ssp/async, compression or sparse "
        "rows. With two or more servers a lost server's partitions move to the others; "
        "a dead scheduler leaves push_pull of declared tensors running. Workers started "
        "later join at the others' next admission (state.commit()/engine.admit()).",
        "BPSTRAIN_FAULT_TOLERANCE")
    max_workers: int = knob(
        0, "With comm.fault_tolerance: how many worker processes the job may grow to. A worker "
        "started after the rendezvous takes the place of one that left, or, with none free, "
        "a new rank below this (scale-up, as torchrun's --nnodes MIN:MAX or Horovod's "
        "--max-np); 0 = no more than the job started with. Read by the scheduler.",
        "BPSTRAIN_MAX_WORKERS", min=0, max=65536, expected="an integer >= 0 (0 = the job's size)")
    admit_every: int = knob(
        1, "With comm.fault_tolerance: the Trainer and bpstrain.keras.elastic's callback let "
        "waiting workers join every this many optimizer steps (a round trip to the scheduler "
        "each time, like a barrier; more = a joiner waits longer).", "BPSTRAIN_ADMIT_EVERY",
        min=1, expected="an integer >= 1 (optimizer steps)")
    compression: str = knob(
        "none", "Gradient compression of the Trainer's DistributedOptimizer (torch and "
        "Keras): none | fp16 | bf16 | onebit | topk:<ratio> | randomk:<ratio> | "
        "dithering:<levels> | powersgd:<rank> | auto[:<spec>], options after ':' "
        "(e.g. 'topk:0.01:error_feedback=false'); lossy codecs keep error feedback on "
        "workers and servers. Tensors below compression_min_size travel uncompressed.",
        "BPSTRAIN_COMPRESSION", parse=check_compression_spec,
        expected=f"a compression spec: {COMPRESSION_SPECS} (e.g. 'topk:0.01')")
    compression_rules: List[Dict[str, Any]] = knob(
        [], "Per-tensor compression, first match wins over comm.compression: a list of "
        "{pattern: '<glob on the parameter name>', compression: '<spec>', min_size: <elements>}.",
        "BPSTRAIN_COMPRESSION_RULES", parse=check_compression_rules,
        expected="a list of {pattern, compression, min_size} rules (e.g. [{pattern: "
                 "'*.weight', min_size: 65536, compression: 'topk:0.01'}])")
    compression_min_size: int = knob(
        1024, "Tensors with fewer elements are never compressed (their cost is the "
        "operation, not the bytes).", "BPSTRAIN_COMPRESSION_MIN_SIZE", min=0,
        expected="an integer >= 0 (elements)")


def comm_knobs() -> Dict[str, Tuple[type, Knob]]:
    """``{comm key: (its Python type, its Knob)}`` for every field of :class:`CommConfig`."""
    types = {"int": int, "float": float, "bool": bool, "str": str, "List[Dict[str, Any]]": list}
    return {f.name: (types[f.type] if isinstance(f.type, str) else f.type, f.metadata["knob"])
            for f in dataclasses.fields(CommConfig)}


@dataclass
class Config:
    """The whole configuration of a bpstrain run."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    comm: CommConfig = field(default_factory=CommConfig)
