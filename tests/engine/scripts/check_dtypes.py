"""Worker script: every dtype, sum and average, several shapes; exits non-zero on error."""
import numpy as np

import bpstrain.engine as bps

try:
    import ml_dtypes
    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = None

bps.init()
rank, size = bps.rank(), bps.size()
for name in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"):
    dt = BF16 if name == "bfloat16" else np.dtype(name)
    if dt is None:
        continue
    for shape in [(), (5,), (33, 7), (70000,)]:
        x = ((np.arange(int(np.prod(shape))) % 3).reshape(shape) + rank + 1).astype(dt)
        total = bps.push_pull(x, name=f"{name}.{shape}", average=False)
        expect = sum(((np.arange(int(np.prod(shape))) % 3).reshape(shape) + r + 1) for r in range(size))
        assert np.array_equal(total.astype(np.float64), expect), (name, shape, total)
        avg = bps.push_pull(x, name=f"{name}.{shape}", average=True)
        if np.issubdtype(np.dtype(dt), np.integer):
            assert np.array_equal(avg.astype(np.int64), np.floor_divide(expect, size)), (name, shape)
        else:
            assert np.allclose(avg.astype(np.float64), expect / size, rtol=1e-2), (name, shape)
b = bps.broadcast(np.full(3, rank, np.int32), root_rank=size - 1, name="bc")
assert np.all(b == size - 1)
bps.barrier()
print(f"DTYPES_OK rank={rank} size={size}", flush=True)
bps.shutdown()
