"""``Trainer(config).fit(model, data)``: one funnel for notebooks, scripts and launched jobs.

Where ``fit`` runs is decided once, by :func:`launch_mode`:

* ``DMLC_ROLE=worker`` in the environment (``python -m bpstrain.launch ... -- python
  train.py``): this process is one rank of the job.
* ``cluster.workers == 1``: train in this process, no cluster.
* otherwise (a notebook, a plain script): bring up a local cluster in child processes
  (:mod:`bpstrain.trainer._local_cluster`), one progress bar here, and the trained
  weights loaded back into ``model``.

Example:
    >>> from bpstrain.trainer import Trainer
    >>> from bpstrain.models import get_model, digits_dataset
    >>> trainer = Trainer({"trainer.epochs": 3, "cluster.workers": 2})
    >>> history = trainer.fit(get_model("digits_mlp"), digits_dataset("train"),
    ...                       val_data=digits_dataset("test"))  # doctest: +SKIP
    >>> history.plot()  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from omegaconf import DictConfig, OmegaConf

from bpstrain.config import ConfigError, load_config
from bpstrain.config.schema import CommConfig
from bpstrain.trainer import _compression_state
from bpstrain.trainer import callbacks as cbs
from bpstrain.trainer._dispatch import fire, ordered
from bpstrain.trainer.history import History


def launch_mode(config: DictConfig, environ=None) -> str:
    """``"rank"`` (inside a launched job), ``"in_process"``, ``"local_cluster"``, ``"ray"``
    or ``"slurm"`` (this srun task is one rank; ``auto`` in a step of several tasks)."""
    environ = os.environ if environ is None else environ
    role = environ.get("DMLC_ROLE")
    if role == "worker":
        return "rank"
    if role:
        raise ConfigError("Trainer.fit runs in worker processes; scheduler and server processes "
                          f"run `python -m bpstrain.launch`. Received: DMLC_ROLE={role}")
    launcher = config.cluster.get("launcher", "auto")
    if launcher == "ray":
        return "ray"
    if launcher == "slurm":
        return "slurm"
    if launcher == "auto":
        from bpstrain.launch.slurm import in_srun_step

        if in_srun_step(environ):
            return "slurm"
    return "in_process" if config.cluster.workers == 1 else "local_cluster"


def is_keras_model(model: Any) -> bool:
    """True for Keras models, checked without importing Keras."""
    return any(c.__module__.split(".")[0] in ("keras", "tf_keras") for c in type(model).__mro__)


def comm_options(config: DictConfig) -> Dict[str, Any]:
    """The ``comm`` keys that differ from the schema defaults (env vars fill the rest)."""
    defaults = OmegaConf.to_container(OmegaConf.structured(CommConfig))
    given = OmegaConf.to_container(config.comm, resolve=True)
    options = {k: v for k, v in given.items() if defaults.get(k) != v}
    if config.cluster.secret:
        options["secret"] = config.cluster.secret
    return options


LOGGER_TYPES = (cbs.CSVLogger, cbs.TensorBoardLogger)


def _job_run_name(config: DictConfig) -> Optional[str]:
    """A requeued Slurm job's run folder (where its SIGUSR1 checkpoint is), else None."""
    from bpstrain.trainer._preempt import job_run_name

    return job_run_name(config)


def default_callbacks(config: DictConfig, given: Iterable[cbs.Callback] = ()) -> List[cbs.Callback]:
    """The built-ins the config asks for, except types already in ``given``; then ``given``."""
    t, o = config.trainer, config.optimizer
    wanted: List[cbs.Callback] = [cbs.MetricAveraging(), cbs.Throughput(verbose=t.throughput),
                                  cbs.LearningRateSchedule.from_config(o)]
    if "csv" in t.loggers:
        wanted.append(cbs.CSVLogger())
    if "tensorboard" in t.loggers:
        wanted.append(cbs.TensorBoardLogger())
    if t.progress:
        wanted.append(cbs.ProgressBar(print_metrics=bool(t.epoch_summary)))
    if t.early_stopping_patience:
        wanted.append(cbs.EarlyStopping(t.monitor, t.early_stopping_patience, t.monitor_mode))
    if t.checkpoint_every or t.save_top_k:
        wanted.append(cbs.ModelCheckpoint(every_n_epochs=t.checkpoint_every, monitor=t.monitor,
                                          mode=t.monitor_mode, save_top_k=t.save_top_k))
    if t.timeline:
        wanted.append(cbs.CommTimeline())
    given = list(given)
    present = {type(cb) for cb in given}
    return [cb for cb in wanted if type(cb) not in present] + given


class Trainer:
    """Trains a torch ``nn.Module`` (or a Keras model) with the push_pull engine.

    Args:
        config: A :class:`bpstrain.config.Config`, a ``DictConfig``, a (dotted) dict,
            a YAML path or None; validated by :func:`bpstrain.config.load_config`.
        callbacks: Extra :class:`~bpstrain.trainer.Callback` objects. Built-ins the
            config enables are added unless one of the same type is given.

    Attributes (read by callbacks):
        config, callbacks, comm, rank, size, local_rank, is_global_zero, module,
        optimizer (the first of ``optimizers``), optimizers, lr_schedulers,
        precision_plugin, current_epoch, global_step, epochs_completed, max_epochs, num_training_batches, num_val_batches, logs,
        train_sums, val_sums, history, should_stop, resumed, out_dir, run_name, run_dir,
        loggers, last_grad_norm, progress_sink.
    """

    def __init__(self, config: Any = None, callbacks: Optional[Iterable[cbs.Callback]] = None):
        self.config = load_config(config)
        self.callbacks = ordered(default_callbacks(self.config, callbacks or ()))
        self.progress_sink = None
        self._sink = None
        self.run_name: Optional[str] = None
        self._reset()

    def _reset(self) -> None:
        self.comm = None
        self.rank, self.size, self.local_rank = 0, 1, 0
        self.module = self.optimizer = self.precision_plugin = None
        self.optimizers: list = []
        self.lr_schedulers: list = []
        self.schedulers_pending = False
        self.last_grad_norm = None  # 0-d tensor: total gradient norm before clipping
        self.current_epoch = self.global_step = self.epochs_completed = 0
        self.num_training_batches = self.num_val_batches = 0
        self.progress_step = self.last_batch_size = 0
        self.logs: Dict[str, Any] = {}
        self.train_sums = self.val_sums = None
        self.history = History()
        self.should_stop = self.resumed = False
        # A checkpoint saved mid-epoch (SIGUSR1, bpstrain.trainer._preempt): where to go on.
        self.resume_batch = 0
        self.resume_sums: Dict[str, list] = {}
        self.resume_logs: Dict[str, Any] = {}
        self.resume_rank_state: Optional[Dict[str, Any]] = None
        # comm.fault_tolerance: a worker that joined mid-epoch, the sampler state it was sent
        self.resume_sampler: Optional[Dict[str, Any]] = None

    # ------------------------------------------------------------------------- properties

    @property
    def max_epochs(self) -> int:
        """``trainer.epochs`` of the config."""
        return int(self.config.trainer.epochs)

    @property
    def out_dir(self) -> Path:
        """``trainer.out_dir``: every run gets its own folder in it (:attr:`run_dir`)."""
        return Path(self.config.trainer.out_dir)

    @property
    def run_dir(self) -> Path:
        """``<out_dir>/<run_name>``: config.yaml, metrics.csv, checkpoints/, TensorBoard
        events and the timeline of the current (or last) fit; ``out_dir`` before one."""
        return self.out_dir / self.run_name if self.run_name else self.out_dir

    @property
    def loggers(self) -> List[cbs.Callback]:
        """The logger callbacks (CSV, TensorBoard) of this Trainer (``trainer.loggers``)."""
        return [cb for cb in self.callbacks if isinstance(cb, LOGGER_TYPES)]

    @property
    def is_global_zero(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    def print(self, message: str) -> None:
        """Prints on rank 0 only (above the progress bar when there is one)."""
        if not self.is_global_zero:
            return
        if self.progress_sink is not None:
            self.progress_sink.write(message)
        else:
            print(message, flush=True)

    def callback(self, cls: type) -> Optional[cbs.Callback]:
        """The first callback of type ``cls``, or None."""
        return next((cb for cb in self.callbacks if isinstance(cb, cls)), None)

    # ---------------------------------------------------------------------------- fitting

    def fit(self, model: Any, data: Any = None, val_data: Any = None) -> History:
        """Trains ``model`` and returns the per-epoch metrics.

        Args:
            model: A ``torch.nn.Module`` (loss from ``trainer.loss`` or its
                ``training_step``) or a compiled Keras model.
            data: A torch Dataset, a DataLoader, an ``(x, y)`` pair of arrays, or a
                zero-argument callable returning one; each rank trains on its shard.
                None: built from the config's ``data`` section.
            val_data: Same forms, optional; metrics get a ``val_`` prefix.

        Returns:
            The :class:`History`; in a local cluster the trained weights are also
            loaded into ``model``.

        Raises:
            KeyboardInterrupt: Interrupted; every child process has been stopped.
            Exception: A worker's exception, re-raised with its traceback attached.
        """
        if data is None:
            from bpstrain.trainer.recipe import ConfigData

            if self.config.data.name is None:
                raise ValueError("fit(model) without data needs data.name in the config; "
                                 "otherwise pass data. Received: data=None, data.name=None")
            data = ConfigData(OmegaConf.to_container(self.config), "train")
            val_data = val_data if val_data is not None else ConfigData(
                OmegaConf.to_container(self.config), "val")
        mode = launch_mode(self.config)
        self._check_device(model)
        from bpstrain.trainer._run_dir import resolve_run_name

        # One process names the run folder: this one, or rank 0 of a launched job.
        self.run_name = (_job_run_name(self.config) or resolve_run_name(self.config.trainer)
                         if mode not in ("rank", "slurm") else None)
        if mode == "local_cluster":
            from bpstrain.trainer._local_cluster import LocalClusterLauncher

            return LocalClusterLauncher(self).launch(model, data, val_data)
        if mode == "ray":
            from bpstrain.ray._fit import fit_on_ray

            return fit_on_ray(self, model, data, val_data)
        from bpstrain.trainer.callbacks.progress import TqdmSink

        if mode == "slurm":
            from bpstrain.launch.slurm import rank_in_this_process
            from bpstrain.trainer._preempt import Preempted

            preempted = None
            with rank_in_this_process():
                try:
                    return self.fit_rank(model, data, val_data, TqdmSink(), joined=False)
                except Preempted as exc:  # a clean end of this run: the roles end too
                    preempted = exc
            raise preempted
        return self.fit_rank(model, data, val_data, TqdmSink(), joined=mode == "rank",
                             run_name=self.run_name)

    def _check_device(self, model: Any) -> None:
        if not is_keras_model(model) and self.config.trainer.device == "cuda":
            from bpstrain.trainer._loop import check_device

            check_device("cuda")

    def _open(self, sink: Any = None) -> None:
        """Joins (or starts) the engine; sets rank, size and the progress sink."""
        from bpstrain.trainer._comm import Comm

        self.comm = Comm(comm_options(self.config))
        self.rank, self.size, self.local_rank = self.comm.rank, self.comm.size, self.comm.local_rank
        self._sink = sink  # fault tolerance: kept by every rank, for the one that becomes rank 0
        self.progress_sink = sink if self.is_global_zero else None
        self.comm.on_membership_change(self._follow_membership)

    def _follow_membership(self, membership: dict) -> None:
        """comm.fault_tolerance: workers left; ranks are renumbered over those that remain
        (the new rank 0 writes the checkpoints, the logs and the progress bar)."""
        self.rank, self.size = membership["rank"], membership["size"]
        self.progress_sink = self._sink if self.is_global_zero else None

    def _start_run(self, run_name: Optional[str]) -> None:
        """Names the run folder on every rank and saves the resolved config there."""
        from bpstrain.config import save_config
        from bpstrain.trainer._run_dir import resolve_run_name

        name = run_name or self.config.trainer.run_name
        if name is None and self.comm.admitted_late:
            return  # a worker that joined the running job: the others send it (_elastic.join)
        if name is None:
            name = (_job_run_name(self.config) or resolve_run_name(self.config.trainer)
                    if self.is_global_zero else None)
            name = self.comm.broadcast_object(name, "trainer.run_name")
        self.run_name = name
        if self.is_global_zero:
            config = OmegaConf.to_container(self.config)
            config["trainer"]["run_name"] = name
            save_config(config, self.run_dir / "config.yaml")

    def fit_rank(self, model: Any, data: Any, val_data: Any, sink: Any, joined: bool,
                 run_name: Optional[str] = None) -> History:
        """Runs ``fit`` as one rank of whatever job the environment describes.

        Args:
            sink: Where rank 0's progress bar draws (other ranks keep it for when they
                become rank 0: fault tolerance).
            joined: Inside a job launched by someone else: leave the engine running.
            run_name: The run folder chosen by the caller (None: config's, or rank 0's).
        """
        self._reset()
        self._open(sink)
        try:
            self._start_run(run_name)
            if is_keras_model(model):
                from bpstrain.trainer._keras import fit_keras

                return fit_keras(self, model, data, val_data)
            from bpstrain.trainer._loop import fit_torch

            return fit_torch(self, model, data, val_data)
        except BaseException as exc:
            from bpstrain.trainer._preempt import Preempted

            if not isinstance(exc, Preempted):  # that one is a planned stop
                fire(self.callbacks, "exception", self, model, exception=exc)
            raise
        finally:
            self.comm.close(leave_engine=joined)

    # ------------------------------------------------------------------------ evaluation

    def _evaluate(self, what: str, model: Any, data: Any) -> Any:
        """The funnel of validate/test/predict: one rank of a job, or this process.

        Evaluation averages no gradients, so outside a launched job it runs here, in
        this process, on all of ``data`` (a notebook needs no cluster for it).
        """
        self._check_device(model)
        from bpstrain.trainer.callbacks.progress import TqdmSink

        joined = launch_mode(self.config) == "rank"
        sink = TqdmSink()
        self._open(sink)
        try:
            if is_keras_model(model):
                from bpstrain.trainer import _keras

                if what == "predict":
                    return _keras.predict_keras(self, model, data)
                return _keras.evaluate_keras(self, model, data, what)
            from bpstrain.trainer import _evaluate

            return getattr(_evaluate, f"{what}_torch")(self, model, data)
        except BaseException as exc:
            fire(self.callbacks, "exception", self, model, exception=exc)
            raise
        finally:
            sink.close()
            self.comm.close(leave_engine=joined)

    def validate(self, model: Any, data: Any) -> Dict[str, float]:
        """Validation metrics of ``model`` on ``data`` (Lightning's ``trainer.validate``).

        Args:
            model: A ``torch.nn.Module`` (``validation_step``, else ``trainer.loss``) or
                a Keras model (``model.evaluate``; compiled from the config if it is not).
            data: Any form ``fit`` accepts.

        Returns:
            ``{"val_loss": ..., "val_accuracy": ...}``, exact sample-weighted means over
            all ranks' shards.
        """
        return self._evaluate("validate", model, data)

    def test(self, model: Any, data: Any) -> Dict[str, float]:
        """Test metrics (``test_step``, else ``validation_step``, else ``trainer.loss``;
        Keras: ``model.evaluate``).

        Returns:
            ``{"test_loss": ..., "test_accuracy": ...}`` over all of ``data``.
        """
        return self._evaluate("test", model, data)

    def predict(self, model: Any, data: Any) -> List[Any]:
        """Outputs of ``model`` on ``data``, one CPU tensor (or structure) per batch.

        Uses ``predict_step(batch, batch_idx)`` when the module has one, else
        ``model(x)`` for the first element of each batch. ``data`` may also be one
        array of inputs. In a launched job each rank returns its strided shard's
        outputs (sample i goes to rank i % size); elsewhere the outputs are in order.
        A Keras model returns ``model.predict``'s one array instead.
        """
        return self._evaluate("predict", model, data)

    def checkpoint_state(self) -> Dict[str, Any]:
        """Everything a resume needs, as one picklable dict (torch modules and Keras
        models: weights, then the optimizer's variables as ``keras_optimizer``)."""
        import torch

        from bpstrain import __version__

        keras = is_keras_model(self.module)
        optimizers = [] if keras else list(self.optimizers or [self.optimizer])
        optimizers = [o for o in optimizers if o is not None]
        history = self.history.to_dict()
        epochs = history["epochs"]
        if self.logs and (not epochs or epochs[-1].get("epoch") != self.current_epoch):
            # Saved from on_train_epoch_end: this epoch is not in the history yet.
            history["epochs"].append({"epoch": self.current_epoch, **self.logs})
        state = {
            "epoch": self.current_epoch, "global_step": self.global_step,
            "model": (self.module.get_weights() if keras else self.module.state_dict())
            if self.module is not None else None,
            "optimizer": optimizers[0].state_dict() if optimizers else None,
            "other_optimizers": [o.state_dict() for o in optimizers[1:]],
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "history": history,
            "config": OmegaConf.to_container(self.config, resolve=True),
            "rng": torch.get_rng_state(), "bpstrain_version": __version__,
            "grad_scaler": self.precision_plugin.state_dict() if self.precision_plugin else {},
            "lr_schedulers": [s.scheduler.state_dict() for s in self.lr_schedulers],
            "lr_schedulers_pending": self.schedulers_pending,
            "run_name": self.run_name,
        }
        if keras and getattr(self.module, "optimizer", None) is not None:
            from bpstrain.trainer._keras import optimizer_state

            state["keras_optimizer"] = optimizer_state(self.module)
        compression = _compression_state.checkpoint_entry(self)
        if compression is not None:  # every rank's error feedback (see _compression_state)
            state[_compression_state.CHECKPOINT_KEY] = compression
        fire(self.callbacks, "save_checkpoint", self, self.module, checkpoint=state)
        return state
