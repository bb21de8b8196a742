"""tests/jitted.py, the compiled init/apply many layer tests use: arrays (and pytrees of them)
are traced, every other value stays the Python value an eager call sees, and the result is the
eager call's."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tests import jitted


SEEN = []  # (type of x, flag, offset, note) of every call


class _Branchy(nn.Module):
    """Branches in Python on its flag and offset (a tracer would raise), and records what its
    arguments were."""

    @nn.compact
    def __call__(self, x, *, flag: bool, offset: int, note=None):
        SEEN.append((type(x), flag, offset, note))
        y = nn.Dense(3)(x)
        if flag:  # Python control flow: needs a Python bool
            y = y + offset
        return y


def test_arrays_are_traced_and_other_values_stay_python_values():
    SEEN.clear()
    seen, module = SEEN, _Branchy()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)), jnp.float32)
    variables = jitted.init(module, jax.random.key(0), x, flag=True, offset=3, note=None)
    got = jitted.apply(module, variables, x, flag=True, offset=3)
    want = module.apply(variables, x, flag=True, offset=3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    traced = [s for s in seen if issubclass(s[0], jax.core.Tracer)]
    assert len(traced) == 2 and all(s[1:] == (True, 3, None) for s in traced), seen
    # A NumPy array is traced like a JAX one; mutable= stays a Python list.
    out, state = jitted.apply(module, variables, np.asarray(x), flag=False, offset=0, mutable=["intermediates"])
    assert isinstance(state, dict) and out.shape == (2, 3)
    assert issubclass(seen[-1][0], jax.core.Tracer)
