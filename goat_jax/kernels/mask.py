"""The attention mask as one value: :class:`AttentionMask`, built once per attention call and
handed to every kernel, which converts it once to what it needs (an explicit boolean mask for
'xla' and 'dense', a block predicate for 'flash', segment ids for splash, lengths for cuDNN).

The contract every kernel honours (query ``i``, key ``j``, sequence indices from 0):

* ``causal``: ``i`` sees ``j`` iff ``j <= i + offset``; ``offset`` is the position of query 0
  minus the position of key 0 (the cache index while decoding, a shard's or block's place under
  context parallelism: :meth:`AttentionMask.shifted`). It may be a traced integer (decoding);
  a static 0 lets kernels use their native causal mode.
* ``key_padding``: [B, S] bool, **True = padding (ignored)**, the PyTorch/official convention.
* ``kv_lengths``: [B] int32, keys at index >= length are ignored (right padding; native on
  cuDNN).
* ``q_segment_ids`` [B, T] / ``kv_segment_ids`` [B, S] (document-aware packing): ``i`` sees
  ``j`` only if the ids are equal. Ids are compared for equality only: no value is reserved.
  The data packer (:mod:`goat_jax.data.packing`) gives trailing padding ``PAD_SEGMENT_ID``
  (int32 max), so padding tokens see only each other and ids stay non-decreasing.
  **A document is the set of tokens with one id, on every kernel**, also when the id's tokens
  are not adjacent (``1 1 2 2 1 1``: the two runs of 1 are one document). Equality, not runs,
  because load-balanced context parallelism (:mod:`goat_jax.kernels.balance`) hands the
  kernels each document cut into chunks that are not adjacent. cuDNN's packed layout can only
  express documents that are one run each (offsets and lengths), so a row where an id forms
  several runs (:meth:`AttentionMask.split_documents`) is refused there: eager calls raise
  naming ``segment_ids``, under ``jit`` the row's outputs are NaN, never the runs' answer.
* ``window`` (static int or None): ``i`` sees ``j`` only if ``i + offset - j < window`` (a
  sliding window of the last ``window`` keys; an evaluation's, :attr:`goat_jax.kernels.plan.AttentionPlan.window`).

A query row with no visible key outputs zeros on every kernel (:func:`goat_jax.kernels.attend`
selects them after the kernel, :meth:`AttentionMask.rows_with_keys`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

def _is_static(x: Any) -> bool:
    return isinstance(x, (int, np.integer))


def check_segment_ids(b: int, t: int, s: int, segment_ids: Optional[Array] = None,
                      q_segment_ids: Optional[Array] = None,
                      kv_segment_ids: Optional[Array] = None) -> Optional[Tuple[Array, Array]]:
    """Checks segment-id arguments and returns ``(q_ids [B, T], kv_ids [B, S])`` as int32, or
    None without segments. ``segment_ids`` [B, T] is the self-attention form (T == S).

    Raises:
      ValueError naming the argument: both forms given, only one side of the pair, a shape
      other than [B, T] / [B, S], ``segment_ids`` for T != S, or a non-integer dtype.
    """
    if segment_ids is not None:
        if q_segment_ids is not None or kv_segment_ids is not None:
            raise ValueError(
                "Pass either segment_ids (self-attention) or q_segment_ids and kv_segment_ids, "
                "not both.")
        if t != s:
            raise ValueError(
                f"segment_ids is for self-attention (T == S) but T={t}, S={s}; pass "
                "q_segment_ids [B, T] and kv_segment_ids [B, S] instead.")
        q_segment_ids = kv_segment_ids = segment_ids
    if q_segment_ids is None and kv_segment_ids is None:
        return None
    if q_segment_ids is None or kv_segment_ids is None:
        missing = "q_segment_ids" if q_segment_ids is None else "kv_segment_ids"
        raise ValueError(f"{missing} is missing: pass both q_segment_ids and kv_segment_ids "
                         "(or one segment_ids for self-attention).")
    out = []
    for name, ids, shape in (("q_segment_ids", q_segment_ids, (b, t)),
                             ("kv_segment_ids", kv_segment_ids, (b, s))):
        if name == "kv_segment_ids" and ids is q_segment_ids and t == s:  # self-attention: one array
            out.append(out[0])
            break
        ids = jnp.asarray(ids) if not isinstance(ids, jax.Array) else ids
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer ids (int32), got dtype {ids.dtype}; "
                             "cast with .astype(jnp.int32).")
        if ids.shape != shape:
            raise ValueError(f"{name} must have shape {shape} ([B, {'T' if name[0] == 'q' else 'S'}]), "
                             f"got {ids.shape}.")
        out.append(ids.astype(jnp.int32))
    return out[0], out[1]


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query sees (module doc). Build it with :meth:`build` (checks shapes) or
    directly; kernels read it through the methods below, each the one place a rule is written.

    Attributes:
      causal: causal masking, ``j <= i + offset``.
      offset: static int or traced int32 scalar (ignored unless ``causal``).
      key_padding: [B, S] bool or None, True = ignored.
      kv_lengths: [B] int32 or None.
      q_segment_ids, kv_segment_ids: [B, T] and [B, S] int32, both or neither.
      window: static int or None (sliding window, module doc).

    The mask says which keys each query sees, nothing else: how a kernel lays the rows out (the
    document bound cuDNN's packed layout is sized by) is the plan's
    (:attr:`goat_jax.kernels.plan.AttentionPlan.max_documents_per_row`).
    """

    causal: bool = False
    offset: Any = 0
    key_padding: Optional[Array] = None
    kv_lengths: Optional[Array] = None
    q_segment_ids: Optional[Array] = None
    kv_segment_ids: Optional[Array] = None
    window: Optional[int] = None

    @classmethod
    def build(cls, b: int, t: int, s: int, *, is_causal: bool = False, causal_offset: Any = 0,
              key_padding_mask: Optional[Array] = None, kv_lengths: Optional[Array] = None,
              segment_ids: Optional[Array] = None, q_segment_ids: Optional[Array] = None,
              kv_segment_ids: Optional[Array] = None, window: Optional[int] = None) -> "AttentionMask":
        """The mask of ``b`` rows of ``t`` queries and ``s`` keys from the keyword form of
        :func:`goat_jax.kernels.attend`, every argument checked (ValueError naming it)."""
        if key_padding_mask is not None and key_padding_mask.shape != (b, s):
            raise ValueError(f"key_padding_mask must have shape [B, S] = {(b, s)}, got {key_padding_mask.shape}.")
        if kv_lengths is not None and kv_lengths.shape != (b,):
            raise ValueError(f"kv_lengths must have shape [B] = {(b,)}, got {kv_lengths.shape}.")
        segments = check_segment_ids(b, t, s, segment_ids, q_segment_ids, kv_segment_ids)
        q_ids, kv_ids = segments if segments is not None else (None, None)
        return cls(bool(is_causal), causal_offset, key_padding_mask,
                   None if kv_lengths is None else kv_lengths.astype(jnp.int32), q_ids, kv_ids, window)

    def check(self, b: int, t: int, s: int) -> None:
        """Raises ValueError when an array of the mask does not fit ``b`` rows, ``t`` queries
        and ``s`` keys (a mask built for other inputs)."""
        for name, x, shape in (("key_padding", self.key_padding, (b, s)), ("kv_lengths", self.kv_lengths, (b,)),
                               ("q_segment_ids", self.q_segment_ids, (b, t)),
                               ("kv_segment_ids", self.kv_segment_ids, (b, s))):
            if x is not None and tuple(x.shape) != shape:
                raise ValueError(f"AttentionMask.{name} has shape {tuple(x.shape)}; these inputs need {shape}.")
        if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
            raise ValueError("AttentionMask needs both q_segment_ids and kv_segment_ids, or neither.")

    def replace(self, **changes) -> "AttentionMask":
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    # -- what the mask asks of a kernel (the capability table reads these) ----------------------

    @property
    def segments(self) -> Optional[Tuple[Array, Array]]:
        """``(q_segment_ids, kv_segment_ids)`` or None."""
        return None if self.q_segment_ids is None else (self.q_segment_ids, self.kv_segment_ids)

    @property
    def ragged_segments(self) -> bool:
        """Segment ids with anything beyond plain packed self-attention: a key padding mask, kv
        lengths, a causal offset other than a static 0, a window, or different query and key
        ids (what cuDNN's packed layout cannot express)."""
        if self.segments is None:
            return False
        return (self.key_padding is not None or self.kv_lengths is not None or self.window is not None
                or (self.causal and not self.native_causal) or self.q_segment_ids is not self.kv_segment_ids)

    def features(self) -> dict:
        """The capability features (goat_jax/kernels/capabilities.py, ``FEATURES``) this mask asks
        of a kernel: segment ids, ragged segments, a traced causal offset, a window; and
        ``key_masks``: masks that travel with the keys (segment ids, key padding, kv lengths),
        which the choice reads only for the context strategy splitting the sequence (cuDNN's ring
        blocks take none); ``gathered_causal``: causal, which the choice reads only for the
        strategy's detour (a kernel's ``detours``, goat_jax/kernels/choice.py)."""
        return {"segment_ids": self.segments is not None, "ragged_segments": self.ragged_segments,
                "traced_offset": not self.static_offset, "window": self.window is not None,
                "key_masks": (self.segments is not None or self.key_padding is not None
                               or self.kv_lengths is not None),
                "gathered_causal": bool(self.causal)}

    @property
    def static_offset(self) -> bool:
        """Whether the causal offset is a Python integer (splash builds its masks statically)."""
        return not self.causal or _is_static(self.offset)

    @property
    def native_causal(self) -> bool:
        """Causal with a static offset of 0: the kernels' own causal mode."""
        return self.causal and _is_static(self.offset) and int(self.offset) == 0

    def split_documents(self) -> Optional[Array]:
        """[B] bool: the rows where some query id forms more than one run of adjacent tokens (a
        document split by another, module doc), which a kernel that takes documents as runs
        (cuDNN's packed layout) cannot express; None without segment ids. A row's runs are
        counted against its distinct ids (one sort): O(T log T), no T x T mask."""
        if self.segments is None:
            return None
        ids = self.q_segment_ids
        runs = 1 + jnp.sum(ids[:, 1:] != ids[:, :-1], axis=1)
        ordered = jnp.sort(ids, axis=1)
        distinct = 1 + jnp.sum(ordered[:, 1:] != ordered[:, :-1], axis=1)
        return runs != distinct

    def shifted(self, q_start: Any, kv_start: Any) -> "AttentionMask":
        """The mask of a block whose queries start at sequence index ``q_start`` and keys at
        ``kv_start`` of the sequence this mask describes (a context shard, a ring block): the
        offset moves by ``q_start - kv_start``. Arrays are not sliced (the caller slices them)."""
        if not self.causal and self.window is None:
            return self
        return self.replace(offset=self.offset + q_start - kv_start)

    def bounded(self, t: int, s: int) -> "AttentionMask":
        """The same mask for ``t`` queries and ``s`` keys with its offset clamped to
        ``[-t, s + window]`` (window 0 without one), computed in int32 (a traced offset is first
        made int32). The mask reads the offset only through ``j - i <= offset`` and
        ``j - i > offset - window``, with ``j - i`` in ``[1 - t, s - 1]``, so both are constant
        past those ends and the clamp changes nothing visible, while ``i + offset`` can no longer
        wrap in int32 (an offset within ``t`` of 2**31 did, differently per kernel) and a Python
        int of 2**31 or more is not handed to a kernel (a raw OverflowError)."""
        if not self.causal and self.window is None:
            return self
        lo, hi = -t, s + (self.window or 0)
        if _is_static(self.offset):
            return self.replace(offset=min(max(int(self.offset), lo), hi))
        offset = jnp.asarray(self.offset)
        if not jnp.issubdtype(offset.dtype, jnp.integer) or offset.ndim:
            raise ValueError(f"causal_offset must be an integer scalar, got {offset.dtype} of shape {offset.shape}.")
        if jnp.iinfo(offset.dtype).bits > 32 or offset.dtype == jnp.uint32:
            offset = jnp.clip(offset, lo, hi)  # in its own wider type, then exact in int32
        return self.replace(offset=jnp.clip(offset.astype(jnp.int32), lo, hi))

    # -- conversions ---------------------------------------------------------------------------

    def key_keep(self, s: int) -> Optional[Array]:
        """[B, S] bool, True = a key not excluded by padding or lengths; None when none is."""
        keep = None
        if self.key_padding is not None:
            keep = ~self.key_padding.astype(bool)
        if self.kv_lengths is not None:
            within = jnp.arange(s)[None, :] < self.kv_lengths[:, None]
            keep = within if keep is None else keep & within
        return keep

    def explicit(self, t: int, s: int, lengths: bool = True, full: bool = False) -> Optional[Array]:
        """Boolean [B or 1, 1, T or 1, S] (True = attend), or None when every pair is visible.
        ``lengths=False`` leaves ``kv_lengths`` out (a kernel that takes them natively); ``full``
        broadcasts the query axis to T (cuDNN turns the mask into a bias and needs it whole: a
        key-only [B, 1, 1, S] mask fails "Bias must have same seq length as QKV", seen on an H200)."""
        mask = None
        if self.segments is not None:
            mask = (self.q_segment_ids[:, :, None] == self.kv_segment_ids[:, None, :])[:, None]
        i, j = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
        if self.causal:
            causal = (j <= i + self.offset)[None, None]
            mask = causal if mask is None else mask & causal
        if self.window is not None:
            near = (i + self.offset - j < self.window)[None, None]
            mask = near if mask is None else mask & near
        keep = self.replace(kv_lengths=None).key_keep(s) if not lengths else self.key_keep(s)
        if keep is not None:
            keep = keep[:, None, None, :]
            mask = keep if mask is None else mask & keep
        if full and mask is not None:
            mask = jnp.broadcast_to(mask, mask.shape[:2] + (t, s))
        return mask

    def rows_with_keys(self, t: int, s: int) -> Optional[Array]:
        """[B or 1, T] bool: whether query row ``i`` sees at least one key; None when every row
        certainly does (no padding, lengths, segments or window; causal offset a static int >= 0).

        Every bound on a visible key is an upper bound (``j <= i + offset``, ``j < length``)
        except "not padded" and "same segment", so a row sees some key iff it sees the first
        unpadded key of its segment, found by a stable sort of the kept keys by id and a binary
        search (any ids, no contiguity assumed): O(B (S + T) log S), no T x S mask. A window is
        a lower bound too: with one, the rows are read off :meth:`explicit` (only the
        materializing kernels take a window)."""
        static_ok = _is_static(self.offset) and int(self.offset) >= 0
        if (self.key_padding is None and self.kv_lengths is None and self.segments is None
                and self.window is None and (not self.causal or static_ok)):
            return None
        if self.window is not None:
            return self.explicit(t, s).any(axis=-1)[:, 0]
        keep = self.key_keep(s)
        if self.segments is not None:
            first = _first_key_of_segment(self.q_segment_ids, self.kv_segment_ids, keep)  # [B, T]
        elif keep is not None:
            first = jnp.where(keep.any(axis=-1), jnp.argmax(keep, axis=-1), s)[:, None]  # [B, 1]
        else:
            first = jnp.zeros((1, 1), jnp.int32)
        visible = jnp.broadcast_to(first < s, (first.shape[0], t))  # [B|1, T]
        if self.causal:
            visible = visible & (first <= jnp.arange(t)[None, :] + self.offset)
        return visible

    def padded(self, b: int, t: int, s: int, tp: int, sp: int) -> "AttentionMask":
        """The mask of inputs padded from ``t`` queries / ``s`` keys to ``tp`` / ``sp``: the
        extra keys are hidden (``key_padding`` extended with True, or ``kv_lengths`` = ``s``
        when neither was given); an extra query row copies the last real row's segment id (and
        sits below it in the causal order), so it sees a superset of that row's keys: never an
        empty row, whose gradient could be NaN. The caller drops the extra rows' outputs."""
        mask = self
        if tp != t and self.q_segment_ids is not None:
            mask = mask.replace(q_segment_ids=jnp.pad(self.q_segment_ids, [(0, 0), (0, tp - t)], mode="edge"))
        if sp != s:
            if self.kv_segment_ids is not None:  # the padding mask hides them
                mask = mask.replace(kv_segment_ids=jnp.pad(self.kv_segment_ids, [(0, 0), (0, sp - s)], mode="edge"))
            if self.key_padding is not None:
                mask = mask.replace(key_padding=jnp.pad(self.key_padding.astype(bool), [(0, 0), (0, sp - s)],
                                                        constant_values=True))
            elif self.kv_lengths is None:
                mask = mask.replace(kv_lengths=jnp.full((b,), s, jnp.int32))
        return mask


def _first_key_of_segment(q_seg: Array, kv_seg: Array, keep: Optional[Array]) -> Array:
    """[B, T] int32: index of the first kept key with query i's id, or S if there is none."""
    b, s = kv_seg.shape
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    dropped = jnp.zeros((b, s), bool) if keep is None else ~jnp.broadcast_to(keep, (b, s))
    # Kept keys first, by id, ties by index: a binary search then finds each id's first key.
    order = jnp.lexsort((index, kv_seg, dropped), axis=-1)
    ids = jnp.take_along_axis(kv_seg, order, axis=-1)
    n_kept = jnp.sum(~dropped, axis=-1, keepdims=True)
    # Dropped keys sit after the kept ones; the search must not stop inside them.
    top = jnp.iinfo(ids.dtype).max
    search = jnp.where(index < n_kept, ids, top)
    at = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left"))(search, q_seg)
    at_c = jnp.minimum(at, s - 1)
    found = (at < n_kept) & (jnp.take_along_axis(ids, at_c, axis=-1) == q_seg)
    return jnp.where(found, jnp.take_along_axis(order, at_c, axis=-1), s).astype(jnp.int32)
