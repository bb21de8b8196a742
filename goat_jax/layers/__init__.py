"""The attention layer, in one package: what a call is (:mod:`~goat_jax.layers.call`: the call's
types, segment ids, log-n scaling), what a position encoding is to the layer
(:mod:`~goat_jax.layers.encoding`: a value with its parameters declared), the two functions that
run a call on values (:mod:`~goat_jax.layers.core`: ``prepare`` and ``run``), the two Flax faces
that hold an encoding (the Linen :mod:`~goat_jax.layers.linen` and NNX :mod:`~goat_jax.layers.nnx`
layers), and the encodings with the public layers built on them: GOAT
(:mod:`~goat_jax.layers.goat`) and the position-encoding baselines
(:mod:`~goat_jax.layers.positional`).

``from goat_jax import GoatAttention`` and ``goat_jax.nnx`` (the public NNX path) import from here;
this ``__init__`` imports nothing.
"""
