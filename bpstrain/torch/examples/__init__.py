"""Example scripts (BytePS example/pytorch counterparts); run them with ``python -m``."""
