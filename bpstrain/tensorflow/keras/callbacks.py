"""``bpstrain.tensorflow.keras.callbacks``: the callbacks of :mod:`bpstrain.keras.callbacks`
under the module path Horovod and BytePS scripts use (``hvd.callbacks.*``)."""

from bpstrain.keras.callbacks import (BroadcastGlobalVariablesCallback, BytePSCallback,
                                      LearningRateScheduleCallback, LearningRateWarmupCallback,
                                      MetricAverageCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "BytePSCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]
