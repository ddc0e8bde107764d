"""Checks of what a declaration carries and when a name is declared again (see
torch_check_worker.py): the engine's re-declare policy seen from bpstrain.torch."""

import numpy as np
import torch

import bpstrain.torch as bps
from bpstrain import engine
from bpstrain.errors import MismatchError


def check_name_may_change_shape_when_every_rank_changes_it():
    n = bps.size()
    for shape in ((3,), (2, 5), (7,), ()):
        out = bps.push_pull(torch.ones(shape), average=False, name="redeclared")
        assert out.shape == shape and torch.equal(out, torch.full(shape, float(n))), shape
    out = bps.broadcast(torch.arange(4, dtype=torch.int32), 0, name="redeclared")
    assert torch.equal(out, torch.arange(4, dtype=torch.int32))


def check_ranks_changing_a_shape_differently_raises_everywhere():
    r, n = bps.rank(), bps.size()
    bps.push_pull(torch.ones(4), name="changes")
    try:
        bps.push_pull(torch.ones(6 if r == 0 else 5), name="changes")
        raise AssertionError("rank 0's other shape went unnoticed")
    except MismatchError as exc:
        assert "changes" in str(exc), exc
    out = bps.push_pull(torch.ones(7), average=False, name="changes")  # corrected: works
    assert torch.equal(out, torch.full((7,), float(n)))


def check_device_or_layout_disagreement_raises_everywhere():
    """What the declaration carries besides dtype and shape is compared across ranks."""
    r, n = bps.rank(), bps.size()
    for what, signature in (("device", {"device": "cuda" if r == 0 else "cpu"}),
                            ("layout", {"layout": f"chunks:{1024 << r}:0/1:4"})):
        x = np.ones(4, np.float32)
        try:
            engine.synchronize(engine.enqueue(x, f"disagree.{what}", engine.Op.SUM, **signature))
            raise AssertionError(f"a {what} disagreement went unnoticed")
        except MismatchError as exc:
            assert what in str(exc), exc
    out = bps.push_pull(torch.ones(2), average=False, name="after.disagree")
    assert torch.equal(out, torch.full((2,), float(n)))
