"""Worker script: compressed push_pulls build up server residuals; exporting them,
importing them into a fresh job (STATE_FILE) and going on equals not stopping."""
import os

import numpy as np

import bpstrain.engine as bps
from bpstrain import _codec, _server_state
from bpstrain._core import Op

PHASE = os.environ["PHASE"]  # "first": run, export, save; "resume": load, import, run
STATE = os.environ["STATE_FILE"]
SIZES = (3000, 3000, 700)  # three chunks: three partitions over the servers

bps.init()
rank = bps.rank()
blob_size = _codec.blob_bytes(_codec.TOPK, SIZES[0], _codec.topk_count(SIZES[0], 0.01))


def push(step):
    rng = np.random.default_rng(100 * step + rank)
    blob = b"".join(_codec.encode(_codec.TOPK, rng.standard_normal(n).astype(np.float32),
                                  k=_codec.topk_count(n, 0.01)) for n in SIZES)
    src = np.frombuffer(blob, np.uint8).copy()
    h = bps.submit("g", "compressed", src.shape, src, np.empty_like(src), Op.SUM, partition_bytes=blob_size)
    return blob, bps.synchronize(h).tobytes()


if PHASE == "first":
    for step in range(3):
        template, _ = push(step)
    residual = _server_state.export_residual("g", template, blob_size)
    assert np.count_nonzero(residual) > 0  # top-1% left most of the sum on the servers
    after = [push(step)[1] for step in (3, 4)]  # exporting changed nothing on the servers
    if rank == 0:
        np.savez(STATE, residual=residual, after=np.frombuffer(b"".join(after), np.uint8))
else:
    saved = np.load(STATE)
    template = push(0)[0]  # any push gives the layout; this one also moves the residual...
    _server_state.import_residual("g", template, blob_size, saved["residual"])  # ...which import overwrites
    after = b"".join(push(step)[1] for step in (3, 4))
    assert after == saved["after"].tobytes(), "resumed rounds differ from the uninterrupted ones"
print(f"STATE_OK rank={rank} phase={PHASE}", flush=True)
bps.shutdown()
