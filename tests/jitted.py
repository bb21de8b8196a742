"""Flax ``init`` and ``apply`` as one compiled program each, for tests whose subject is a layer's
numbers rather than eager execution.

Run op by op, a GOAT layer's ``init`` or first ``apply`` compiles a few hundred one-operation
programs (~120 for a small layer's init, 4-5 s on a busy CPU core); jitted, it is one program
(~0.5 s). Arrays (JAX or NumPy, and pytrees of them such as the variables) are traced arguments; every other value (flags, grid shapes,
Python-int offsets, None) stays a Python value in the traced call, exactly as in an eager call,
so the layer takes the same static branches. Tests of eager behaviour (an error raised from a
concrete value, a cache left unchanged by an eager call) call the module directly.
"""

import jax
import numpy as np


def _is_array(value) -> bool:
    """An array, or a pytree (variables, a tuple of arrays) whose leaves are all arrays."""
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves)


def _call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under ``jax.jit``, tracing only the array arguments."""
    flat = list(args) + list(kwargs.values())
    traced = [i for i, a in enumerate(flat) if _is_array(a)]

    def body(*arrays):
        values = list(flat)
        for i, a in zip(traced, arrays):
            values[i] = a
        return fn(*values[:len(args)], **dict(zip(kwargs, values[len(args):])))
    return jax.jit(body)(*(flat[i] for i in traced))


def init(module, key, *args, **kwargs):
    """``module.init(key, *args, **kwargs)`` compiled as one program."""
    return _call(module.init, key, *args, **kwargs)


def apply(module, variables, *args, **kwargs):
    """``module.apply(variables, *args, **kwargs)`` compiled as one program (``mutable=`` and
    other non-array keywords stay Python values); returns what ``apply`` returns."""
    return _call(lambda v, *a, **k: module.apply(v, *a, **k), variables, *args, **kwargs)
