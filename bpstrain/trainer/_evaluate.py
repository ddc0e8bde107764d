"""``Trainer.validate``, ``Trainer.test`` and ``Trainer.predict`` for torch modules.

Each rank evaluates its strided shard of the data (no padding: metrics are summed
with their sample counts and averaged over ranks, so they are exact). ``predict``
returns this rank's outputs, one entry per batch, on the CPU (as Lightning does);
with one process that is every sample in order. Hooks (callbacks first, then the
module's own, as in Lightning): ``validate`` fires the validation hooks of ``fit``;
``test`` fires ``on_test_start``, ``on_test_epoch_start``, ``on_test_batch_end``,
``on_test_epoch_end`` (metrics averaged) and ``on_test_end``; ``predict`` fires
``on_predict_start`` and ``on_predict_end``.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from bpstrain.trainer import _data
from bpstrain.trainer._dispatch import fire
from bpstrain.trainer._loop import _accumulate, _Steps, _validate, setup_module
from bpstrain.trainer.callbacks.metrics import average_sums


def _evaluation_setup(trainer, module):
    device = setup_module(trainer, module)
    trainer.module = module
    trainer.comm.broadcast_state(module, None)
    return device


def validate_torch(trainer, module, data: Any) -> Dict[str, float]:
    """``val_*`` metrics of ``module`` on ``data`` (validation hooks fire as in fit)."""
    device = _evaluation_setup(trainer, module)
    loader = _data.val_loader(data, trainer.config, trainer.rank, trainer.size)
    if loader is None:
        raise ValueError("validate() needs data. Received: data=None")
    trainer.logs = {}
    _validate(trainer, module, loader, _Steps(module, trainer.config.trainer.loss), device)
    return {k: trainer.logs[k] for k in trainer.val_sums}


@torch.no_grad()
def test_torch(trainer, module, data: Any) -> Dict[str, float]:
    """``test_*`` metrics of ``module`` on ``data`` (``test_step``, else validation_step)."""
    device = _evaluation_setup(trainer, module)
    loader = _data.val_loader(data, trainer.config, trainer.rank, trainer.size)
    if loader is None:
        raise ValueError("test() needs data. Received: data=None")
    run = _Steps(module, trainer.config.trainer.loss)
    sums = {"test_" + k: [0.0, 0.0] for k in
            ("loss",) + (("accuracy",) if run.correct is not None else ())}
    module.eval()
    callbacks, trainer.logs = trainer.callbacks, {}
    fire(callbacks, "test_start", trainer, module)
    fire(callbacks, "test_epoch_start", trainer, module)
    for batch_idx, batch in enumerate(loader):
        batch = _data.to_device(batch, device)
        with trainer.precision_plugin.autocast():
            outputs = run(batch, batch_idx, validation=True, stage="test")
        logged = _accumulate(sums, outputs, _data.batch_size_of(batch), "test_")
        fire(callbacks, "test_batch_end", trainer, module, outputs=logged, batch=batch,
             batch_idx=batch_idx)
    average_sums(trainer, sums, "test")
    result = {k: trainer.logs[k] for k in sums}
    fire(callbacks, "test_epoch_end", trainer, module)
    fire(callbacks, "test_end", trainer, module)
    return result


def _predict_data(data: Any) -> Any:
    if callable(data) and not isinstance(data, (torch.utils.data.Dataset,
                                                torch.utils.data.DataLoader)):
        data = data()
    if hasattr(data, "shape") and not isinstance(data, (tuple, list)):  # one array: inputs
        data = torch.utils.data.TensorDataset(_data._to_tensor(data))
    return data


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


@torch.no_grad()
def predict_torch(trainer, module, data: Any) -> List[Any]:
    """One output per batch: ``predict_step(batch, batch_idx)`` or ``module(x)``."""
    device = _evaluation_setup(trainer, module)
    loader = _data.val_loader(_predict_data(data), trainer.config, trainer.rank, trainer.size)
    if loader is None:
        raise ValueError("predict() needs data. Received: data=None")
    step = getattr(module, "predict_step", None)
    module.eval()
    fire(trainer.callbacks, "predict_start", trainer, module)
    outputs = []
    for batch_idx, batch in enumerate(loader):
        batch = _data.to_device(batch, device)
        with trainer.precision_plugin.autocast():
            if callable(step):
                out = step(batch, batch_idx)
            else:
                out = module(batch[0] if isinstance(batch, (list, tuple)) else batch)
        outputs.append(_to_cpu(out))
    fire(trainer.callbacks, "predict_end", trainer, module)
    return outputs
