"""Runnable Keras examples (``python -m bpstrain.keras.examples.<name>``)."""
