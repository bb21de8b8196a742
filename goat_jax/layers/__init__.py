"""The attention layer, in one package: what a call is (:mod:`~goat_jax.layers.call`: the call's
types, segment ids, log-n scaling), the one function that runs it (:mod:`~goat_jax.layers.core`),
its two Flax faces (the Linen shell :mod:`~goat_jax.layers.linen`, the NNX shell
:mod:`~goat_jax.layers.nnx`), and the variants both faces inherit: GOAT
(:mod:`~goat_jax.layers.goat`) and the position-encoding baselines
(:mod:`~goat_jax.layers.positional`).

``from goat_jax import GoatAttention`` and ``goat_jax.nnx`` (the public NNX path) import from here;
this ``__init__`` imports nothing, so the encodings in :mod:`goat_jax.positional` can import the
Linen shell's helpers without running the layers that import the encodings.
"""
