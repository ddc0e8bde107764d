"""Example scripts (BytePS example/mxnet counterparts); run them with ``python -m``."""
