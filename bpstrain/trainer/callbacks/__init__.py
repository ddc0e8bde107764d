"""Trainer callbacks: the base class and the built-ins.

=====================  ==========================================================
``Callback``           base class: Lightning-style and Keras-style hooks
``ProgressBar``        a tqdm bar per epoch and per validation pass, rank 0 only
``ModelCheckpoint``    checkpoint every N epochs and/or the best k; resume with trainer.resume
``EarlyStopping``      stop when a monitored metric stops improving
``CSVLogger``          one CSV row per epoch
``LearningRateSchedule``  linear warm-up, then constant / cosine / step
``MetricAveraging``    epoch metrics averaged over all ranks (always first)
``Throughput``         samples/s of the whole job per epoch
``CommTimeline``       push_pull of every tensor per worker, Chrome-trace JSON
``TensorBoardLogger``  TensorBoard event files of the epoch metrics (rank 0)
=====================  ==========================================================
"""

from bpstrain.trainer.callbacks.base import Callback
from bpstrain.trainer.callbacks.checkpoint import (ModelCheckpoint, find_last_checkpoint,
                                                   read_checkpoint)
from bpstrain.trainer.callbacks.csv_logger import CSVLogger
from bpstrain.trainer.callbacks.early_stopping import EarlyStopping
from bpstrain.trainer.callbacks.lr_schedule import LearningRateSchedule, lr_factor
from bpstrain.trainer.callbacks.metrics import MetricAveraging, Throughput
from bpstrain.trainer.callbacks.progress import ProgressBar
from bpstrain.trainer.callbacks.tensorboard import TensorBoardLogger
from bpstrain.trainer.callbacks.timeline import CommTimeline, merge_traces

__all__ = [
    "CSVLogger",
    "Callback",
    "CommTimeline",
    "EarlyStopping",
    "LearningRateSchedule",
    "MetricAveraging",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoardLogger",
    "Throughput",
    "find_last_checkpoint",
    "lr_factor",
    "merge_traces",
    "read_checkpoint",
]
