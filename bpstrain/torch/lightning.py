"""Lightning on bpstrain: Lightning's own DDP over the ``torch.distributed`` backend "bpstrain".

    import lightning as L
    from bpstrain.torch.lightning import BpstrainStrategy

    trainer = L.Trainer(strategy=BpstrainStrategy(), accelerator="cpu", max_epochs=2)
    trainer.fit(model, datamodule)

and run it with ``python -m bpstrain.launch --workers 4 --servers 2 -- python train.py``
(``pip install 'bpstrain[lightning]'``). Gradients are averaged by the parameter servers.

Why a DDP subclass and not a strategy of its own: Lightning's ``DDPStrategy`` already
wraps the model in ``torch.nn.parallel.DistributedDataParallel``, shards the data,
reduces metrics and runs barriers through ``torch.distributed``, all of which the
backend serves. What Lightning cannot know is who the workers are: bpstrain's
launcher (or torchrun) starts them and BytePS's variables name them, so
:class:`BpstrainEnvironment` reads ranks from the engine, and the strategy takes the
job's size from it instead of from ``devices`` × ``num_nodes``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy

from bpstrain import engine
from bpstrain.config.env import read_env
from bpstrain.torch import ops
from bpstrain.torch.process_group import BACKEND


class BpstrainEnvironment(ClusterEnvironment):
    """Ranks of a bpstrain job (BytePS's or torchrun's variables, through the engine).

    The processes are created by the launcher, never by Lightning.
    """

    def __init__(self) -> None:
        super().__init__()
        ops.init()

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return engine.env().root_uri

    @property
    def main_port(self) -> int:
        """The c10d store's port once the process group exists (0 before)."""
        if dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
            return int(getattr(store, "port", 0))
        return 0

    @staticmethod
    def detect() -> bool:
        return read_env().role == "worker"

    def world_size(self) -> int:
        return engine.size()

    def set_world_size(self, size: int) -> None:
        pass  # the job's size is the engine's

    def global_rank(self) -> int:
        return engine.rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # the engine assigned it

    def local_rank(self) -> int:
        return engine.local_rank()

    def node_rank(self) -> int:
        return engine.rank() // max(engine.local_size(), 1)


class BpstrainStrategy(DDPStrategy):
    """Lightning's DDP with process group backend "bpstrain" on the job's workers.

    Args: those of ``lightning.pytorch.strategies.DDPStrategy`` (e.g.
    ``find_unused_parameters``, ``bucket_cap_mb``); the backend and the cluster
    environment are bpstrain's.
    """

    strategy_name = "bpstrain"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("cluster_environment", BpstrainEnvironment())
        kwargs["process_group_backend"] = BACKEND
        super().__init__(**kwargs)

    def setup_distributed(self) -> None:
        """Joins the job through the backend's rendezvous (no MASTER_ADDR needed)."""
        if not dist.is_initialized():
            dist.init_process_group(BACKEND, timeout=self._timeout)
        super().setup_distributed()  # sees the group and keeps it

    @property
    def root_device(self) -> torch.device:
        """This worker's device: its local rank's among ``devices`` (any count given)."""
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[self.local_rank % len(devices)]

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}
