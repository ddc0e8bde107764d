"""One folder per run inside ``trainer.out_dir``: ``<out_dir>/version_N/``.

A run folder holds the resolved ``config.yaml``, ``metrics.csv``, ``checkpoints/``,
the TensorBoard event files and the communication timeline, so a second run never
overwrites the first one's files. ``trainer.run_name`` names the folder; by default
the next free ``version_N`` is claimed (created atomically, so two jobs sharing an
``out_dir`` get different folders), except that ``trainer.resume=auto`` continues in
the folder of the checkpoint it resumes from.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Union

from bpstrain.trainer.callbacks.checkpoint import find_last_checkpoint

_VERSION = re.compile(r"version_(\d+)")


def _versions(out_dir: Path) -> list:
    if not out_dir.is_dir():
        return []
    return [int(m.group(1)) for m in (_VERSION.fullmatch(p.name) for p in out_dir.iterdir())
            if m is not None]


def claim_version(out_dir: Union[str, os.PathLike]) -> str:
    """Creates ``<out_dir>/version_N`` for the smallest N above every existing one."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    number = max(_versions(out_dir), default=-1) + 1
    while True:
        try:
            (out_dir / f"version_{number}").mkdir()
            return f"version_{number}"
        except FileExistsError:  # another process claimed it a moment ago
            number += 1


def run_of_checkpoint(out_dir: Union[str, os.PathLike], path: Union[str, os.PathLike]
                      ) -> Optional[str]:
    """The run folder name of ``<out_dir>/<run>/checkpoints/<file>``, else None."""
    path, out_dir = Path(path).resolve(), Path(out_dir).resolve()
    if path.parent.name == "checkpoints" and path.parent.parent.parent == out_dir:
        return path.parent.parent.name
    return None


def resolve_run_name(trainer_cfg) -> str:
    """The run folder for a new fit: ``run_name``, the resumed run's, or a new version.

    Creates the folder; call on one process only (rank 0 or the notebook) and share it.
    """
    out_dir = Path(trainer_cfg.out_dir)
    if trainer_cfg.run_name:
        (out_dir / trainer_cfg.run_name).mkdir(parents=True, exist_ok=True)
        return str(trainer_cfg.run_name)
    if trainer_cfg.resume == "auto":
        last = find_last_checkpoint(out_dir)
        name = run_of_checkpoint(out_dir, last) if last is not None else None
        if name is not None:
            return name
    return claim_version(out_dir)
