"""The numpy reference of DGC's momentum correction (Lin et al., 2018) on one worker,
shared by the torch and TensorFlow compressor tests."""

import numpy as np


def dgc_steps(grads, momentum, pick):
    """What a momentum-corrected compressor hands an SGD of that momentum at each step.

    The velocity u = m*u + g accumulates into v (error feedback), ``pick(v, step)`` gives
    the indices sent, u and v are cleared there; the answer is the sent S_t minus
    m*S_(t-1), so that SGD's buffer m*buf + answer is S_t. Returns (answers, u, v)."""
    n = grads[0].size
    u, v, before, answers = np.zeros(n, np.float32), np.zeros(n, np.float32), None, []
    for step, g in enumerate(grads):
        u = np.float32(momentum) * u + g
        v = v + u
        idx = pick(v, step)
        sent = np.zeros(n, np.float32)
        sent[idx] = v[idx]
        v[idx], u[idx] = 0, 0
        answers.append(sent if before is None else sent - np.float32(momentum) * before)
        before = sent
    return answers, u, v


def top(k):
    """``pick`` for top-k: the k largest magnitudes (ties to the lower index)."""
    return lambda v, step: np.argsort(-np.abs(v), kind="stable")[:k]
