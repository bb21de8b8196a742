"""Autoregressive sampling from a decoder LM, with or without the KV cache.

The cached path is what evaluation uses: prefill the prompt in one chunk, then one token per
step under ``jax.lax.scan``, everything inside one ``jax.jit``. The uncached path recomputes
the whole sequence every step and exists to test the cache against.

Works with any Linen module that follows :class:`goat_jax.models.lm.TransformerLM`'s contract:
``apply(variables, tokens [B, T]) -> logits [B, T, V]``, a ``decode`` field, and a 'cache'
collection sized by ``init`` on a full-length input.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from goat_jax.kernels import balance
from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels.plan import DEFAULT

Array = jax.Array


def sample_logits(logits: Array, rng: Optional[Array], temperature: Any, greedy: bool,
                  top_k: Optional[int]) -> Array:
    """Draws one token per row from ``logits`` [B, V] (float32): argmax when ``greedy``,
    else a categorical sample of ``logits / temperature`` restricted to the ``top_k`` largest.
    Returns [B] int32."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1] the k-th largest logit
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _check_args(prompt, max_new_tokens, rng, temperature, top_k):
    if not hasattr(prompt, "ndim") or prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt must be a [batch, length] integer array, got "
                         f"{getattr(prompt, 'shape', type(prompt))} {getattr(prompt, 'dtype', '')}.")
    if prompt.shape[1] < 1:
        raise ValueError("prompt must hold at least one token per row (the model needs a context).")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}.")
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}.")
    if temperature > 0 and rng is None:
        raise ValueError("Sampling with temperature > 0 needs an rng key.")


def cache_slots(model: nn.Module, length: int) -> int:
    """The KV cache's slots for ``length`` tokens: ``length``, rounded up under a mesh that splits
    sequences over ``context`` to what the model's attention plan can split (each shard holds an
    equal part of the cache; the sizing forward of ``init`` runs the plan's context strategy on
    the whole cache). The extra slots are never written, and masked as unwritten."""
    plan = getattr(model, "plan", DEFAULT)  # a model without one runs the default plan
    shards = mesh_lib.context_shards(mesh_lib.ambient_mesh(), plan.context_axis)
    if shards <= 1:
        return length
    multiple = balance.length_multiple(shards, plan.load_balanced, plan.implementation)
    return -(-length // multiple) * multiple


def generate(model: nn.Module, params: Mapping[str, Any], prompt: Array, max_new_tokens: int,
             rng: Optional[Array] = None, *, temperature: float = 0.0, top_k: Optional[int] = None,
             use_cache: bool = True, prefill_multiple: Optional[int] = None,
             cache_length: Optional[int] = None,
             on_token: Optional[Callable[[Any, Any], None]] = None) -> Array:
    """Continues ``prompt`` by ``max_new_tokens`` tokens.

    Args:
      model: the LM (with ``decode=False`` or ``True``; the cached path clones it).
      params: the 'params' collection, or a variables dict holding it under 'params'.
      prompt: [B, P] int, P >= 1 (all rows the same length; no padding).
      max_new_tokens: tokens to append (0 returns the prompt).
      rng: PRNG key; needed when ``temperature > 0``. Step ``i`` uses ``fold_in(rng, i)``, so the
        cached and uncached paths draw identical samples.
      temperature: 0 = greedy (argmax); > 0 divides the logits before sampling.
      top_k: sample among the k most likely tokens only (ignored when greedy).
      use_cache: KV-cache decoding (prefill once, then one token per step); False recomputes
        the full sequence every step (slow; a reference for tests).
      prefill_multiple: None compiles the decoder once per prompt length P. An integer m >= 1
        (cached path only) prefills the first ``m * (P // m)`` tokens in one chunk and feeds the
        rest one token at a time inside the same compiled program, in a cache of
        ``m * (P // m) + m - 1 + max_new_tokens`` slots: every P in ``[k m, (k + 1) m)`` shares
        one compile (what lm-eval's ``generate_until`` needs: its prompts have many lengths).
        The tokens are those of the exact path: the extra slots are masked until written.
      cache_length: with ``prefill_multiple``, the most cache slots to make (e.g. the model's
        window); at least ``P + max_new_tokens``.
      on_token: called on the host as each token is drawn, in order, ``on_token(step, tokens)``
        with ``step`` 0 .. max_new_tokens - 1 and ``tokens`` the [B] ids of that step (NumPy-
        convertible): what streams tokens to a terminal while the one compiled program runs
        (``jax.debug.callback``, ordered). A new function compiles a new program.
    Returns:
      [B, P + max_new_tokens] int32, the prompt followed by the generated tokens.
    """
    _check_args(prompt, max_new_tokens, rng, temperature, top_k)
    prompt = jnp.asarray(prompt, jnp.int32)
    if prefill_multiple is not None:
        if isinstance(prefill_multiple, bool) or not isinstance(prefill_multiple, int) or prefill_multiple < 1:
            raise ValueError(f"prefill_multiple must be None or an integer >= 1, got {prefill_multiple!r}.")
        if not use_cache:
            raise ValueError("prefill_multiple applies to the KV-cache path; drop it or use use_cache=True.")
    if cache_length is not None and prefill_multiple is None:
        raise ValueError("cache_length is the cap of prefill_multiple's cache; give prefill_multiple too.")
    if cache_length is not None and cache_length < prompt.shape[1] + max_new_tokens:
        raise ValueError(f"cache_length={cache_length} cannot hold the prompt ({prompt.shape[1]} tokens) and "
                         f"max_new_tokens={max_new_tokens}; give at least {prompt.shape[1] + max_new_tokens}.")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token must be None or a function (step, tokens), got {on_token!r}.")
    if max_new_tokens == 0:
        return prompt
    variables = {"params": params["params"]} if "params" in params else {"params": params}
    greedy = temperature == 0
    if greedy:
        rng, temperature = jax.random.PRNGKey(0), 1.0  # unused; keeps the jitted signature fixed
    if prefill_multiple is None:
        return _generate(model, variables, prompt, rng, jnp.float32(temperature),
                         max_new_tokens=max_new_tokens, greedy=greedy, top_k=top_k, use_cache=use_cache,
                         on_token=on_token, cache_length=cache_slots(model, prompt.shape[1] + max_new_tokens))
    m, (b, p) = prefill_multiple, prompt.shape
    head = m * (p // m)
    tail = jnp.zeros((b, max(m - 1, 1)), jnp.int32).at[:, :p - head].set(prompt[:, head:])
    slots = head + m - 1 + max_new_tokens
    slots = max(p + max_new_tokens, min(slots, cache_length)) if cache_length is not None else slots
    slots = cache_slots(model, slots)
    new = _generate_bucketed(model, variables, prompt[:, :head], tail, jnp.int32(p - head), rng,
                             jnp.float32(temperature), max_new_tokens=max_new_tokens, cache_length=slots,
                             greedy=greedy, top_k=top_k, on_token=on_token)
    return jnp.concatenate([prompt, new], axis=1)


def _step_sampler(rng, temperature, greedy, top_k, on_token=None):
    """``sample(logits [B, V], step) -> [B] int32``: step ``i`` draws with ``fold_in(rng, i)``,
    so every decoding path draws the same samples; each draw is passed to ``on_token`` (if
    any) on the host, in order."""
    def sample(logits, step):
        if top_k is not None and top_k > logits.shape[-1]:
            raise ValueError(f"top_k={top_k} exceeds the vocabulary size {logits.shape[-1]}.")
        token = sample_logits(logits, jax.random.fold_in(rng, step), temperature, greedy, top_k)
        if on_token is not None:
            jax.debug.callback(on_token, step, token, ordered=True)
        return token
    return sample


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "greedy", "top_k", "use_cache",
                                             "on_token", "cache_length"))
def _generate(model, variables, prompt, rng, temperature, *, max_new_tokens, greedy, top_k, use_cache,
              on_token=None, cache_length=None):
    b, p = prompt.shape
    total = p + max_new_tokens
    sample = _step_sampler(rng, temperature, greedy, top_k, on_token)

    if use_cache:
        decoder = model.clone(decode=True)
        # init on a full-length input sizes the cache; only the 'cache' output is kept, so XLA
        # drops the parameter initialization as dead code.
        cache = decoder.init(jax.random.PRNGKey(0), jnp.zeros((b, cache_length or total), jnp.int32))["cache"]
        logits, state = decoder.apply({**variables, "cache": cache}, prompt, mutable=["cache"])
        first = sample(logits[:, -1], 0)  # [B]

        def step(carry, i):
            cache, token = carry
            logits, state = decoder.apply({**variables, "cache": cache}, token[:, None], mutable=["cache"])
            nxt = sample(logits[:, -1], i)
            return (state["cache"], nxt), nxt

        _, rest = jax.lax.scan(step, (state["cache"], first), jnp.arange(1, max_new_tokens))  # [new-1, B]
        return jnp.concatenate([prompt, first[:, None], rest.T], axis=1)

    # Uncached: run the model on the fixed-size buffer [B, total] and read the logits at the last
    # filled position. Causality (tested separately) makes the not-yet-filled tail irrelevant,
    # so this equals running on the prefix alone, without a new compile for every length.
    model = model.clone(decode=False)
    tokens = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt)

    def body(i, tokens):
        logits = model.apply(variables, tokens)  # [B, total, V]
        last = jax.lax.dynamic_index_in_dim(logits, p + i - 1, axis=1, keepdims=False)  # [B, V]
        nxt = sample(last, i)
        return jax.lax.dynamic_update_slice(tokens, nxt[:, None], (0, p + i))

    return jax.lax.fori_loop(0, max_new_tokens, body, tokens)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "cache_length", "greedy", "top_k",
                                             "on_token"))
def _generate_bucketed(model, variables, head, tail, n_tail, rng, temperature, *, max_new_tokens,
                       cache_length, greedy, top_k, on_token=None):
    """The cached path of :func:`generate` with ``prefill_multiple``: ``head`` [B, H] (H a
    multiple of m, possibly 0) is prefilled in one chunk, the first ``n_tail`` (traced) tokens
    of ``tail`` [B, m - 1] one at a time; returns the [B, max_new_tokens] new tokens. Only H,
    m, the cache length and the sampling options are static."""
    b = tail.shape[0]
    decoder = model.clone(decode=True)
    cache = decoder.init(jax.random.PRNGKey(0), jnp.zeros((b, cache_length), jnp.int32))["cache"]
    sample = _step_sampler(rng, temperature, greedy, top_k, on_token)

    def feed(cache, tokens):  # -> (cache, logits of the last token [B, V])
        logits, state = decoder.apply({**variables, "cache": cache}, tokens, mutable=["cache"])
        return state["cache"], logits[:, -1]

    # The first call: the head chunk, or (a prompt shorter than m) the first tail token.
    cache, last = feed(cache, head if head.shape[1] else tail[:, :1])

    def tail_step(i, carry):
        return feed(carry[0], jax.lax.dynamic_slice_in_dim(tail, i, 1, axis=1))

    cache, last = jax.lax.fori_loop(0 if head.shape[1] else 1, n_tail, tail_step, (cache, last))
    first = sample(last, 0)

    def step(carry, i):
        cache, token = carry
        cache, logits = feed(cache, token[:, None])
        nxt = sample(logits, i)
        return (cache, nxt), nxt

    _, rest = jax.lax.scan(step, (cache, first), jnp.arange(1, max_new_tokens))  # [new-1, B]
    return jnp.concatenate([first[:, None], rest.T], axis=1)

