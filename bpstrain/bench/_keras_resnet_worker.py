"""One worker of the Keras ResNet-50 benchmark (see ``bpstrain.bench.keras_resnet``).

The cluster comes from BytePS's environment variables, as for ``_bps_worker``. The
worker trains ``bpstrain.keras.examples.resnet50_synthetic`` and prints one
``BENCH_RESULT`` line whose single result is ``{"samples_per_s", "step_s", ...}``.
"""

from __future__ import annotations

import argparse
import sys

from bpstrain.bench import _report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; flags mirror the example's."""
    parser = argparse.ArgumentParser(prog="python -m bpstrain.bench._keras_resnet_worker")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from bpstrain.keras.examples.resnet50_synthetic import train

    result = train(batch_size=args.batch_size, image_size=args.image_size, steps=args.steps,
                   warmup_steps=args.warmup_steps, threads=args.threads, verbose=False)
    _report.emit("keras_resnet", result["rank"], result["size"], [result])
    return 0


if __name__ == "__main__":
    sys.exit(main())
