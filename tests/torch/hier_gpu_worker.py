"""Worker script for the multi-GPU hierarchical path (GpuHierarchy).

Runs on CUDA when this process has its own GPU (local_rank < device count), else on
CPU with a gloo local group: the same code path (reduce-scatter, slice push_pull across
hosts, all-gather). Prints HIER_OK on success."""
import os
import sys

import torch

import bpstrain.engine as engine
from bpstrain.torch.hierarchical import GpuHierarchy, init_local_group

engine.init()
rank, size, local_rank = engine.rank(), engine.size(), engine.local_rank()
use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= engine.local_size()
device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
if use_cuda:
    torch.cuda.set_device(device)
init_local_group("nccl" if use_cuda else "gloo")
hier = GpuHierarchy(None,
                    chunk_bytes=int(os.environ.get("CHUNK_BYTES", "64")))
dtypes = [torch.float32, torch.float64, torch.int32, torch.int64]
if use_cuda:
    dtypes += [torch.float16, torch.bfloat16, torch.int8, torch.uint8]
for dtype in dtypes:
    for numel in (1, 7, 1000):
        base = torch.arange(numel, device=device) % 5
        x = (base + rank + 1).to(dtype)
        expect = sum((base + r + 1) for r in range(size)).to(torch.float64)
        got = hier.push_pull(x.clone(), name=f"h.{dtype}.{numel}", average=False)
        assert torch.equal(got.to(torch.float64), expect), (dtype, numel, got[:5], expect[:5])
        avg = hier.push_pull(x.clone(), name=f"h.{dtype}.{numel}", average=True)
        want = expect / size if dtype.is_floating_point else torch.div(expect, size, rounding_mode="floor")
        assert torch.allclose(avg.to(torch.float64), want, rtol=1e-2), (dtype, numel)
print(f"HIER_OK rank={rank} device={device.type} hosts={hier.hosts} local={hier.local_size}", flush=True)
hier.close()  # barrier + destroy: a live gloo group can abort at interpreter exit
engine.shutdown()
sys.stdout.flush()
# torch's gloo threads occasionally abort ("terminate called without an active
# exception") during interpreter teardown after the group is destroyed (about 1 run in
# 20 here; never seen without torch.distributed): leave without that teardown.
os._exit(0)
