"""Write one CSV row of metrics per epoch (rank 0)."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from bpstrain.trainer.callbacks.base import Callback


class CSVLogger(Callback):
    """Appends every epoch's logs to a CSV file; rank 0 writes.

    The file is rewritten each epoch from the rows kept in memory, so a metric that
    appears late (e.g. validation every other epoch) still gets a column. Rows are
    part of the checkpointed state, so a resumed run continues the same file.

    Args:
        path: The CSV file; default ``<run folder>/metrics.csv`` (a new file per run).
    """

    def __init__(self, path: Optional[Union[str, os.PathLike]] = None):
        self.given_path = Path(path) if path is not None else None
        self.path = self.given_path
        self.rows: List[Dict[str, Any]] = []

    def on_fit_start(self, trainer, module) -> None:
        self.path = self.given_path or Path(trainer.run_dir) / "metrics.csv"
        # Rows from epochs a resumed run will redo are dropped.
        self.rows = [r for r in self.rows if int(r.get("epoch", -1)) < trainer.current_epoch]

    def on_train_epoch_end(self, trainer, module) -> None:
        if not trainer.is_global_zero:
            return
        self.rows.append({"epoch": trainer.current_epoch, **{
            k: v for k, v in trainer.logs.items() if k != "epoch"}})
        self._write()

    def _write(self) -> None:
        columns: List[str] = []
        for row in self.rows:
            columns += [k for k in row if k not in columns]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)

    def state_dict(self) -> Dict[str, Any]:
        return {"rows": [dict(r) for r in self.rows]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rows = [dict(r) for r in state.get("rows", [])]
