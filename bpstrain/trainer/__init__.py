"""The Trainer: ``Trainer(config).fit(model, data)`` in a notebook, a script or a job.

    from bpstrain.trainer import Trainer
    from bpstrain.models import get_model, digits_dataset

    trainer = Trainer({"trainer.epochs": 5, "cluster.workers": 2})
    history = trainer.fit(get_model("digits_mlp"), digits_dataset("train"),
                          val_data=digits_dataset("test"))
    history.plot()

From a notebook or a plain script, ``cluster.workers > 1`` brings up a local cluster
in child processes; under ``python -m bpstrain.launch`` the same call is one rank
of the job; with one worker it trains in this process. Callbacks:
:mod:`bpstrain.trainer.callbacks`. Recipes: :func:`run_recipe`.
"""

from bpstrain.trainer._local_cluster import RemoteTraceback, WorkerError
from bpstrain.trainer._preempt import Preempted
from bpstrain.trainer.callbacks import (CSVLogger, Callback, CommTimeline, EarlyStopping,
                                        LearningRateSchedule, MetricAveraging, ModelCheckpoint,
                                        ProgressBar, TensorBoardLogger, Throughput,
                                        find_last_checkpoint)
from bpstrain.trainer.history import History
from bpstrain.trainer.recipe import run_recipe
from bpstrain.trainer.trainer import Trainer, launch_mode

__all__ = [
    "CSVLogger", "Callback", "CommTimeline", "EarlyStopping", "History", "LearningRateSchedule",
    "MetricAveraging", "ModelCheckpoint", "Preempted", "ProgressBar", "RemoteTraceback", "TensorBoardLogger", "Throughput",
    "Trainer", "WorkerError", "find_last_checkpoint", "launch_mode", "run_recipe",
]
