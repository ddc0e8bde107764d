"""Cluster bring-up: local jobs, local services for notebooks, BytePS-style roles.

``python -m bpstrain.launch --workers N --servers K [--local-size L] -- CMD ...``
starts a scheduler, K servers and N copies of CMD on this host, prefixes their
output with ``[scheduler]`` / ``[server k]`` / ``[worker i]``, and stops every
process (and its process group) as soon as one fails or the launcher is
interrupted. With ``DMLC_ROLE`` set it runs one role of a job started by hand.

The same machinery as a Python API:

* :class:`LocalServices` -- scheduler + servers as child processes for a
  Trainer or a benchmark that starts its own workers.
* :class:`LocalJob` / :func:`launch_local` -- a whole one-host job.
"""

from bpstrain.launch.local import LocalJob, LocalServices, free_port, launch_local

__all__ = ["LocalJob", "LocalServices", "free_port", "launch_local"]
