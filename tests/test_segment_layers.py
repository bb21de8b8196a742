"""Segment ids on the attention layers (document-aware packing): a packed row of documents gives
each document the outputs and gradients it gets alone, for GOAT and every registered 1D
encoding on every CPU kernel, against float64 references (each document alone through the
layer in float64, and GOAT's numpy reference); cross-attention; and bad input."""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from goat_jax import positional
from goat_jax.prior import segments
from goat_jax.data.packing import PAD_SEGMENT_ID
from goat_jax.layers.positional import PositionalAttention
from tests import goat_reference as ref
from tests import jitted
from tests.marks import SLOW_CASE

E, N, K, H = 16, 4, 2, 8  # model dim, query heads, kv heads (GQA), head dim
TRAIN_LEN = 8  # training_seq_len: shorter than some documents, so 'rope_pi' scales per document
GOAT_PRIOR = dict(pos_rank=2, abs_rank=2, training_seq_len=TRAIN_LEN)
ENCODINGS_1D = tuple(e.name for e in positional.ENCODINGS if e.positions in ("1d", "any"))
LAYERS = ("goat",) + ENCODINGS_1D
BIAS_ENCODINGS = {e.name for e in positional.ENCODINGS if e.materialized_bias}
CPU_KERNELS = ("xla", "flash", "dense", "splash_interpret")
# Document lengths of one packed row, then padding; 'splash' fills one whole 128-token block.
# "equal" lets the float64 reference run the documents alone as one batch (one compilation).
DOCS = {"equal": ((9, 9, 9), 3), "short": ((7, 11, 5), 3), "splash": ((40, 50, 30), 8)}


def _layer(name, implementation, dtype=jnp.float32, **extra):
    """The layer ``name`` ('goat' or a position encoding) on one kernel, in ``dtype``."""
    common = dict(num_heads=N, kv_num_heads=K, head_dim=H, implementation=implementation,
                  dtype=dtype, param_dtype=dtype, **extra)
    if name == "goat":
        return ref.goat_module(**GOAT_PRIOR, **common)
    if name in ("ntk", "yarn"):  # a fixed factor: the dynamic one refuses packed windows > TRAIN_LEN
        extra.setdefault("rope_scaling_factor", 2.0)
        common.update(extra)
    return PositionalAttention(position_encoding=name, training_seq_len=TRAIN_LEN, max_len=64, **common)


def _kernels_for(name):
    return ("xla", "dense") if name in BIAS_ENCODINGS else CPU_KERNELS


def _packed_ids(lengths, pad):
    """[1, T] ids 1, 2, ... per document, then PAD_SEGMENT_ID (the data packer's layout)."""
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.full(pad, PAD_SEGMENT_ID)])
    return ids.astype(np.int32)[None]


def _random_params(module, rng, t, **call):
    """Params with every leaf drawn N(0, 0.5) (the inits leave the priors near zero, where a
    wrong position would not move the output)."""
    call.setdefault("is_causal", True)  # 'alibi_packed' is causal only
    params = flax.core.meta.unbox(jitted.init(module, jax.random.key(0), jnp.zeros((1, t, E)), **call))
    return jax.tree.map(lambda a: np.asarray(rng.normal(0, 0.5, a.shape), np.float32), params)


def _value_and_grads(module, params, x, ct, is_causal=True, segment_ids=None):
    """(out, d/dx, d/dparams) of sum(out * ct), jitted as one function (eager tracing compiles
    hundreds of small primitives, far slower on these sizes)."""
    return _jitted(module, is_causal)(params, x, ct, segment_ids)


@functools.lru_cache(maxsize=None)
def _jitted(module, is_causal):
    def value_and_grads(params, x, ct, segment_ids):
        def loss(p, x_):
            out = module.apply(p, x_, is_causal=is_causal, segment_ids=segment_ids)
            return jnp.sum(out * ct), out
        (_, out), (g_p, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return out, g_x, g_p
    return jax.jit(value_and_grads)


def _close(got, want, what, tol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol}"


def _alone_float64(name, params, x, ct, lengths, is_causal=True, **fields):
    """Each document run alone through the layer in float64 ('xla' kernel): outputs [1, L, E],
    input gradients and the summed parameter gradients."""
    outs, gxs, gps = [], [], None
    with jax.enable_x64(True):
        module = _layer(name, "xla", jnp.float64, **fields)
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        if len(set(lengths)) == 1:  # equal documents: alone = one row each of a batch
            n, d = lengths[0], len(lengths)
            rows = lambda a: jnp.asarray(a[0, :n * d].reshape(d, n, -1), jnp.float64)
            out, g_x, g_p = _value_and_grads(module, p64, rows(x), rows(ct), is_causal=is_causal)
            return list(np.asarray(out)[:, None]), list(np.asarray(g_x)[:, None]), jax.tree.map(np.asarray, g_p)
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            out, g_x, g_p = _value_and_grads(module, p64, jnp.asarray(x[:, sl], jnp.float64),
                                             jnp.asarray(ct[:, sl], jnp.float64), is_causal=is_causal)
            outs.append(np.asarray(out))
            gxs.append(np.asarray(g_x))
            g_p = jax.tree.map(np.asarray, g_p)
            gps = g_p if gps is None else jax.tree.map(np.add, gps, g_p)
            start += n
    return outs, gxs, gps


def _check_packed_equals_alone(name, implementation, rng, docs="equal", is_causal=True, **fields):
    lengths, pad = DOCS[docs]
    t = sum(lengths) + pad
    ids = _packed_ids(lengths, pad)
    module = _layer(name, implementation, **fields)
    params = _random_params(module, rng, t)
    x = rng.normal(size=(1, t, E)).astype(np.float32)
    ct = rng.normal(size=(1, t, E)).astype(np.float32)
    ct[:, sum(lengths):] = 0  # padding carries no loss, as weight 0 in the LM loss
    out, g_x, g_p = _value_and_grads(module, params, jnp.asarray(x), jnp.asarray(ct), is_causal=is_causal,
                                     segment_ids=jnp.asarray(ids))
    want_out, want_gx, want_gp = _alone_float64(name, params, x, ct, lengths, is_causal, **fields)
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        _close(out[:, sl], want_out[i], f"{name}/{implementation} document {i} output")
        _close(g_x[:, sl], want_gx[i], f"{name}/{implementation} document {i} input gradient")
        start += n
    # Parameter gradients relative to the largest one: some are analytically zero (a k_proj
    # bias is a row constant of the logits), where float32 leaves ~1e-7.
    largest = max(np.abs(w).max() for w in jax.tree.leaves(want_gp))
    for path, got in jax.tree_util.tree_leaves_with_path(g_p):
        want = functools.reduce(lambda d, k: d[k.key], path, want_gp)
        _close(np.asarray(got) / largest, want / largest, f"{name}/{implementation} gradient {jax.tree_util.keystr(path)}")
    if name == "goat":  # GOAT also against its independent numpy reference, document by document
        cfg = dict(num_heads=N, kv_num_heads=K, head_dim=H, **GOAT_PRIOR)
        start = 0
        for i, n in enumerate(lengths):
            sl = slice(start, start + n)
            want = ref.goat_attention(params["params"], cfg, x[:, sl], x[:, sl], x[:, sl], is_causal=is_causal)
            _close(out[:, sl], want, f"goat/{implementation} document {i} vs numpy reference")
            start += n
    return out


# Each case compiles a packed and a float64 forward+backward (~5-20 s on a loaded 2-core CI box),
# so the default suite runs a few that between them cover GOAT, a rotary, a packed and a bias
# encoding on the xla/flash/dense kernels; every layer on every CPU kernel (splash in interpret
# mode included) runs in the slow suite.
_FAST = {("goat", "flash"), ("alibi_packed", "xla"), ("naive_prior", "dense")}
_slow = lambda *args: pytest.param(*args, marks=SLOW_CASE)


@pytest.mark.parametrize("name,implementation", [
    (n, k) if (n, k) in _FAST else _slow(n, k) for n in LAYERS for k in _kernels_for(n)])
def test_packed_documents_equal_documents_alone(name, implementation, rng):
    _check_packed_equals_alone(name, implementation, rng,
                               docs="splash" if implementation == "splash_interpret" else "equal")


@pytest.mark.parametrize("name", [_slow("goat"), _slow("rope"), _slow("alibi"), _slow("naive_prior")])
def test_bidirectional_packed_documents_equal_documents_alone(name, rng):
    _check_packed_equals_alone(name, "xla", rng, is_causal=False)


@pytest.mark.slow(reason="compiles every kernel for packed documents with log-n scaling")
@pytest.mark.parametrize("is_causal", [True, False])
def test_logn_scaling_follows_each_document(is_causal, rng):
    """log-n factors per document: a causal query's n is its document position + 1, a
    bidirectional one's the length of its own document, not the window's."""
    _check_packed_equals_alone("rope", "xla", rng, docs="short", is_causal=is_causal, logn_scaling="content")


@pytest.mark.parametrize("name", ["rope_pi", _slow("goat")])
def test_packed_documents_of_unequal_lengths(name, rng):
    """Documents of 7, 11 and 5 tokens (each alone its own compilation): per-document lengths
    ('rope_pi' scales each by its own length past training_seq_len) follow each document."""
    _check_packed_equals_alone(name, "flash", rng, docs="short")


@pytest.mark.parametrize("name", [_slow("goat"), _slow("rope")])
def test_cross_attention_with_kv_segment_ids(name, rng):
    """Queries of documents (3, 4) against keys of the same documents (5, 6): each query document
    sees only its own keys, positions restart on both sides; equals each pair alone."""
    q_len, k_len = (3, 4), (5, 6)
    q_ids, k_ids = _packed_ids(q_len, 0), _packed_ids(k_len, 0)
    module = _layer(name, "xla")
    xq = rng.normal(size=(1, sum(q_len), E)).astype(np.float32)
    xk = rng.normal(size=(1, sum(k_len), E)).astype(np.float32)
    params = _random_params(module, rng, sum(q_len))
    out = module.apply(params, jnp.asarray(xq), jnp.asarray(xk), segment_ids=jnp.asarray(q_ids),
                       kv_segment_ids=jnp.asarray(k_ids))
    with jax.enable_x64(True):
        m64 = _layer(name, "xla", jnp.float64)
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        qs, ks = np.cumsum((0,) + q_len), np.cumsum((0,) + k_len)
        for i in range(2):
            want = m64.apply(p64, jnp.asarray(xq[:, qs[i]:qs[i + 1]], jnp.float64),
                             jnp.asarray(xk[:, ks[i]:ks[i + 1]], jnp.float64))
            _close(out[:, qs[i]:qs[i + 1]], want, f"{name} cross-attention document {i}")


def test_segment_positions_and_lengths():
    ids = np.asarray([[4, 4, 4, 9, 9, PAD_SEGMENT_ID], [1, 2, 2, 2, 2, 3]], np.int32)
    np.testing.assert_array_equal(segments.segment_positions(ids), [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 0]])
    np.testing.assert_array_equal(segments.segment_lengths(ids), [[3, 3, 3, 2, 2, 1], [1, 4, 4, 4, 4, 1]])


@pytest.mark.slow(reason="compiles every layer with traced ids; the eager checks stay in the default suite")
def test_traced_ids_and_explicit_positions_under_jit(rng):
    """Under jit the contiguity and agreement checks cannot run (documented): the layer masks by
    id equality and restarts positions at every run, so traced ids give the eager result, and
    explicit positions equal to the derived ones change nothing."""
    lengths, pad = DOCS["equal"]
    t = sum(lengths) + pad
    ids = jnp.asarray(_packed_ids(lengths, pad))
    module = _layer("goat", "xla")
    params = _random_params(module, rng, t)
    x = jnp.asarray(rng.normal(size=(1, t, E)), jnp.float32)
    eager = module.apply(params, x, is_causal=True, segment_ids=ids)
    pos = segments.segment_positions(ids)
    jitted = jax.jit(lambda p, x_, s, q: module.apply(p, x_, is_causal=True, segment_ids=s, q_positions=q,
                                                       k_positions=q))(params, x, ids, pos)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-5, rtol=1e-5)


def _bad(module, x, match, **call):
    with pytest.raises(ValueError, match=match):
        module.init(jax.random.key(0), x, **call)


def test_bad_segment_input_raises_naming_the_argument():
    t = 6
    x = jnp.zeros((1, t, E))
    ok = jnp.asarray([[1, 1, 2, 2, 2, 3]], jnp.int32)
    for name in ("goat", "rope"):
        m = _layer(name, "xla")
        _bad(m, x, "segment_ids must be integer", is_causal=True, segment_ids=ok.astype(jnp.float32))
        _bad(m, x, r"segment_ids must have shape \(1, 6\)", is_causal=True, segment_ids=ok[0])
        _bad(m, x, "not contiguous", is_causal=True, segment_ids=jnp.asarray([[1, 1, 2, 2, 1, 1]], jnp.int32))
        _bad(m, x, "q_positions contradicts segment_ids", is_causal=True, segment_ids=ok,
             q_positions=jnp.arange(t, dtype=jnp.int32))
        _bad(m, x, "position_offset_q cannot be combined", is_causal=True, segment_ids=ok, position_offset_q=2)
        _bad(m, x, "kv_segment_ids needs segment_ids", is_causal=True, kv_segment_ids=ok)
        with pytest.raises(ValueError, match="needs kv_segment_ids"):
            m.init(jax.random.key(0), x, jnp.zeros((1, 4, E)), segment_ids=ok)
        with pytest.raises(ValueError, match="not supported with decode=True"):
            m.clone(decode=True).init(jax.random.key(0), x, is_causal=True, segment_ids=ok)
    # 2D patch grids have no documents.
    _bad(_layer("rope2d", "xla"), jnp.zeros((1, 4, E)), "1D sequences", spatial_shape=(2, 2),
         segment_ids=jnp.ones((1, 4), jnp.int32))
    _bad(ref.goat_module(num_heads=N, head_dim=H, pos_rank=2, abs_rank=2, training_seq_len=8, pos_encoding="auto"),
         jnp.zeros((1, 4, E)), "1D sequences", segment_ids=jnp.ones((1, 4), jnp.int32))
    # ntk/yarn's dynamic factor follows the window's length, not each document's.
    for name in ("ntk", "yarn"):
        _bad(_layer(name, "xla", rope_scaling_factor=None), jnp.zeros((1, 12, E)), "the dynamic factor follows",
             is_causal=True, segment_ids=jnp.asarray([[1] * 6 + [2] * 6], jnp.int32))
    # The sink without training_seq_len would normalize by the window, not the document.
    _bad(ref.goat_module(num_heads=N, head_dim=H, pos_rank=2, abs_rank=2), x, "need training_seq_len",
         is_causal=True, segment_ids=ok)


@pytest.mark.parametrize("name", ["goat", _slow("rope")])
def test_automatic_kernel_never_picks_cudnn_for_segment_ids_before_hopper(monkeypatch, name):
    """On a GPU in bf16 the automatic choice is cuDNN, but on an A100 not for a call with segment
    ids (cuDNN's packed layout needs Hopper: tests/test_cudnn_packed.py); the choice recorded for
    the compile report (``kernels.record_choices``) is the kernel the layer then runs, in both
    cases."""
    from goat_jax import kernels

    class A100:
        device_kind = "NVIDIA A100-SXM4-80GB"
    used = []
    real_attend = kernels.attend
    monkeypatch.setattr(kernels.choice, "target", lambda *a, **kw: ("gpu", "this test", A100()))
    # cuDNN needs a GPU to run: the spy notes the kernel the layer chose (its one choice, handed
    # to attend) and runs XLA in its place.
    def spy(*a, **k):
        chosen = k["choice"]
        used.append(chosen.implementation)
        if chosen.implementation == "cudnn":
            k = {**k, "choice": chosen._replace(implementation="xla")}
        return real_attend(*a, **k)
    monkeypatch.setattr(kernels, "attend", spy)
    ids = jnp.asarray([[1, 1, 2, 2, 2, PAD_SEGMENT_ID]], jnp.int32)
    x = jnp.zeros((1, 6, E), jnp.bfloat16)
    layer = _layer(name, None, dtype=jnp.bfloat16)
    with kernels.record_choices() as choices:
        jitted.init(layer, jax.random.key(0), x, is_causal=True, segment_ids=ids)
        jitted.init(layer, jax.random.key(0), x, is_causal=True)
    assert used[0] != "cudnn" and used[-1] == "cudnn", used
    assert [c["implementation"] for c in choices] == used, (choices, used)


@pytest.mark.parametrize("value", [0, -3, 2.5, "4", True])
def test_max_documents_per_row_is_checked_when_the_layer_is_built(value):
    """Issue #53, item 15: Linen and NNX layers refuse a bad ``max_documents_per_row`` when
    built, in one line naming the field (0 was cuDNN's default of 64 silently, the others failed
    later); the attention plan, which holds the bound, refuses it too."""
    from flax import nnx
    from goat_jax import nnx as gnnx
    from goat_jax.kernels.plan import AttentionPlan

    builders = (lambda: ref.goat_module(num_heads=2, pos_rank=2, abs_rank=2, max_documents_per_row=value),
                lambda: PositionalAttention(num_heads=2, max_documents_per_row=value),
                lambda: gnnx.PositionalAttention(2, in_features=16, rngs=nnx.Rngs(0), max_documents_per_row=value))
    for build in builders:
        with pytest.raises(ValueError, match=rf"^(Goat|Positional)Attention\.max_documents_per_row={value!r} "
                                             r"(is out of range|has the wrong type): allowed is an integer >= 1 or None"):
            build()
    with pytest.raises(ValueError, match=r"^max_documents_per_row must be a positive integer"):
        AttentionPlan(max_documents_per_row=value)  # the bound is the plan's, not the mask's
    assert PositionalAttention(num_heads=2, max_documents_per_row=4).max_documents_per_row == 4
