"""What each attention kernel can do: one row per kernel (:data:`CAPABILITIES`), read by the
automatic choice (:func:`goat_jax.kernels.resolve_implementation`), by every refusal
(:func:`refusal`), by the front door (:func:`goat_jax.kernels.attend` runs ``row.attention``),
by the context strategies (a row's ``ring_blocks``, ``static_masks``, ``detours``), by the packed
width rule (a row's ``fast_widths``) and by docs/layer.md's table (:func:`markdown_table`).

A kernel declares its own row where it is defined: its module ends with ``ROW = Capability(...)``
(platforms, dtypes, the features it takes and why it lacks the others, the platforms where the
automatic choice tries it first, and the function that runs it), built with keywords only. The
built-in rows are one literal table, :data:`goat_jax.kernels.registry.KERNELS` (name -> row),
which the package imports explicitly and which fills :data:`CAPABILITIES`; a plugin adds its row
with one call, :func:`register`. Every reader asks a row for what it needs to know (a field, or a
function of this module such as :func:`returns_probs`), never compares kernel names: a new kernel
is one new module, and one line of the literal table for a built-in one.

A call's needs are a :class:`Request` (the platform the computation runs on, the dtype, the
packed q/k width, which masking features it uses, and the context strategy splitting its
sequence); :func:`refusal` returns the first reason a kernel cannot serve it (the decisive one
first: the platform, then the dtype, the head dim, the features, then what the strategy needs of
the kernel), or None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax.numpy as jnp

ANY = ("cpu", "gpu", "tpu")
HALF = ("bfloat16", "float16")

# Why cuDNN takes segment ids only on Hopper or newer (said by the automatic choice's log line and
# by the refusal of an explicit choice), and only as packed self-attention.
CUDNN_SEGMENTS_WHY = ("segment ids run on cuDNN's packed layout (goat_jax/kernels/cudnn_packed.py), which "
                      "needs a Hopper or newer GPU (compute capability 9.0: H100, H200)")
CUDNN_RAGGED_WHY = ("cuDNN's packed layout aligns each query document with the key document of the same index, "
                    "top-left: it expresses packed self-attention only (with context parallelism, each shard's "
                    "queries would start inside a document); use 'flash'")
FEATURES = ("segment_ids", "ragged_segments", "bias", "traced_offset", "window", "return_probs")
FEATURE_NAMES = {"segment_ids": "segment ids",
                 "ragged_segments": "segment ids with key padding, kv lengths, a causal offset or cross-attention",
                 "bias": "an additive bias", "traced_offset": "a traced causal offset",
                 "window": "a sliding window", "return_probs": "return_probs"}  # as the messages say them
HOPPER = (9, 0)  # GPU compute capability of H100 / H200


class RingBlocks(NamedTuple):
    """How ``context_strategy='ring'`` computes a kernel's blocks (:mod:`goat_jax.kernels.ring`):
    a row without it cannot run in a ring."""

    math: str  # the kernel whose block math computes them: what the choice's log and compile.json name
    make: Callable[[int, Any], Any]  # fn(block, precision) -> the block kernels (goat_jax/kernels/ring_blocks.py)
    no_key_masks: Optional[str] = None  # why its blocks take no segment ids or key padding; None: they take them


class FastWidths(NamedTuple):
    """A fused kernel's fast path by q/k width (:mod:`goat_jax.kernels.widths`)."""

    width: Callable[[Optional[Tuple[int, int]], int], Optional[int]]  # (GPU compute capability or None,
    # width) -> the width the kernel runs a q/k that wide at; None where no rule is known
    where: str  # who runs it, as the layout warning says it ("a Hopper GPU's cuDNN")
    cost: str  # what running wider was measured to cost, and where


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capability:
    """One kernel's row, built with keywords only. ``why_not`` says, per feature of
    :data:`FEATURES` it lacks, why. A row that takes ``return_probs`` has an ``attention`` that
    takes ``return_probs=True`` and then returns ``(out, probs)``."""

    name: str
    platforms: Tuple[str, ...]  # where it runs
    features: Tuple[str, ...]  # the FEATURES it takes
    summary: str  # one line: what it is (docs/layer.md's kernel table)
    # fn(q, k, v, *, scale, mask, bias, mesh) -> [B, T, N, Hv]: the kernel itself
    attention: Callable[..., Any] = dataclasses.field(compare=False, repr=False)
    why_not: Dict[str, str] = dataclasses.field(default_factory=dict)
    dtypes: Optional[Tuple[str, ...]] = None  # None: any float dtype
    max_head_dim: Optional[int] = None  # packed q/k width after padding; None: no limit
    head_dim_multiple: int = 1  # q/k (and v) widths are zero-padded to a multiple of this
    length_multiple: int = 1  # query/key lengths are padded to multiples of this, exactly
    auto_min_length: int = 0  # the automatic choice takes it only for lengths >= this
    # feature -> the least GPU compute capability on which the kernel takes it (else why_not)
    needs_capability: Dict[str, Tuple[int, int]] = dataclasses.field(default_factory=dict)
    preferred_on: Tuple[str, ...] = ()  # platforms whose automatic choice tries it first (in name order)
    # Where no preferred kernel serves a call, the automatic choice falls back to the rows with a
    # tier, lower tiers first; None: never a fallback (module doc of goat_jax/kernels/choice.py).
    fallback: Optional[int] = None
    materializes_logits: bool = False  # holds the T x S logits in memory (the fallback's size rule)
    static_masks: bool = False  # builds its masks statically: each context shard's offset is a branch of its own
    # situation (a key of DETOURS) -> how the kernel runs it other than natively, and why; the
    # automatic choice's log line says it when the call is in that situation
    detours: Dict[str, str] = dataclasses.field(default_factory=dict)
    # The fix its platform refusal gives (a call on other hardware), and what it adds when the
    # platform was only JAX's default backend (how to compile for the kernel's hardware from here).
    platform_hint: str = "Use implementation='xla' (or None for automatic choice)."
    host_hint: str = ""
    ring_blocks: Optional[RingBlocks] = dataclasses.field(default=None, compare=False)
    fast_widths: Optional[FastWidths] = dataclasses.field(default=None, compare=False)
    # packs segment ids into a layout of at most max_documents_per_row documents per row, which
    # the data packers honour (goat_jax.kernels.plan.AttentionPlan.document_bound)
    bounds_documents: bool = False

    def takes(self, feature: str) -> bool:
        """Whether the kernel takes ``feature`` (one of :data:`FEATURES`)."""
        return feature in self.features


# Reasons several rows share (each kernel module says the rest of its own).
NO_BIAS = "flash kernels take packed q/k instead of an additive bias"
NO_PROBS = "only 'dense' materializes the attention probabilities"
# Why cuDNN ring blocks take no segment ids or key padding (said by the automatic choice's log line).
CUDNN_RING_MASKS_WHY = ("cuDNN ring blocks run the plain causal / unmasked calls per block pair; the packed layout "
                        "would be exact only on the diagonal pair (a document's query and key ranges coincide there) "
                        "and key padding has no per-pair form here, so packed documents and padding run the ring on "
                        "'flash' blocks")
# Why cuDNN under context_strategy='all_gather' takes a causal mask as an explicit mask (said by
# the automatic choice's log line, from the cuDNN row's detours).
CUDNN_GATHERED_CAUSAL_WHY = (
    "jax 0.10.2's cuDNN call has no causal offset (fused_attention_stablehlo.MaskType CAUSAL is top-left, "
    "key j <= query i, as jax.nn's _get_causal_mask; there is no bottom-right alignment or query offset, "
    "q_offsets / kv_offsets are the packed layout's document starts and sliding_window_length only narrows "
    "the window below the diagonal), so each shard's causal mask at its offset goes to cuDNN as an explicit "
    "[T / c, T] mask, materialized as a bias; context_strategy='ring' runs cuDNN blocks in its own causal mode")
# Situations in which a kernel may take a call other than natively (Capability.detours).
DETOURS = {"gathered_causal": "a causal mask under context_strategy='all_gather' (each shard's queries at their offset)"}
NO_WINDOW = "a sliding window (AttentionPlan.window) is for the materializing kernels 'xla' and 'dense'"

# name -> row, in name order (the order of docs/layer.md's table, of the choices and of
# preference): the built-in rows of goat_jax/kernels/registry.py's literal table, filled when the
# package is imported, and the plugins' rows (register).
CAPABILITIES: Dict[str, Capability] = {}


def register(row: Capability) -> Capability:
    """Adds ``row`` to :data:`CAPABILITIES` (the registry's built-in rows, or a plugin's: one
    call) and returns it, keeping the table in name order. ValueError for a name registered
    already, a row without its ``attention`` function, or a feature or platform the table does
    not know."""
    if row.name in CAPABILITIES:
        raise ValueError(f"implementation={row.name!r} is registered already.")
    if not callable(row.attention):
        raise ValueError(f"Capability {row.name!r} needs its attention function (attention=...).")
    unknown = (set(row.features) | set(row.why_not)) - set(FEATURES) | set(row.detours) - set(DETOURS)
    if unknown or not set(row.platforms) | set(row.preferred_on) <= set(ANY):
        raise ValueError(f"Capability {row.name!r}: unknown features {sorted(unknown)} or platforms "
                         f"{sorted(set(row.platforms) | set(row.preferred_on))}; known: {FEATURES}, {tuple(DETOURS)}, {ANY}.")
    rows = sorted([*CAPABILITIES.values(), row], key=lambda r: r.name)  # by name: not by import order
    CAPABILITIES.clear()
    CAPABILITIES.update((r.name, r) for r in rows)
    return row


def implementations() -> Tuple[str, ...]:
    """The kernel names of :data:`CAPABILITIES`, in name order (read when called: a plugin's too)."""
    return tuple(CAPABILITIES)


def __getattr__(name: str) -> Any:
    """``IMPLEMENTATIONS``: :func:`implementations`, read when asked, so a plugin registered after
    this module was imported is in it."""
    if name == "IMPLEMENTATIONS":
        return implementations()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def preferred(platform: str) -> Tuple[str, ...]:
    """The kernels the automatic choice tries first on ``platform``, in name order."""
    return tuple(name for name, row in CAPABILITIES.items() if platform in row.preferred_on)


def returns_probs(implementation: Optional[str]) -> bool:
    """Whether kernel ``implementation`` returns the attention probabilities (its row takes
    ``return_probs``: what layers sow for evaluations); False for None (automatic) or an unknown
    name."""
    row = CAPABILITIES.get(implementation) if implementation is not None else None
    return row is not None and row.takes("return_probs")


def bounds_documents(implementation: Optional[str]) -> bool:
    """Whether calls with kernel ``implementation`` may run a kernel whose layout bounds the
    documents of a packed row (its row's ``bounds_documents``); for None (automatic), whether
    any row does."""
    if implementation is None:
        return any(row.bounds_documents for row in CAPABILITIES.values())
    row = CAPABILITIES.get(implementation)
    return row is not None and row.bounds_documents


@dataclasses.dataclass(frozen=True)
class Request:
    """What one attention call asks of a kernel: the platform it runs on (``where``: how that
    was read, :func:`goat_jax.kernels.target_platform`), the dtype, the packed q/k width, the
    masking features it uses (:data:`FEATURES`), and, when the sequence is split over devices,
    the context strategy (a :class:`goat_jax.kernels.strategies.Strategy`) with whether masks
    travel with the keys (segment ids, key padding, kv lengths)."""

    platform: str
    where: str
    dtype: str
    qk_dim: int
    features: Tuple[str, ...] = ()
    compute_capability: Optional[Tuple[int, int]] = None  # GPUs, when known
    strategy: Any = None  # the strategy splitting the sequence, or None
    key_masks: bool = False

    @classmethod
    def of(cls, target: Tuple[str, str], dtype, qk_dim: int, compute_capability: Optional[Tuple[int, int]] = None,
           *, strategy: Any = None, key_masks: bool = False, **uses: bool) -> "Request":
        """A request on ``target`` = (platform, where); ``uses``: feature name -> bool."""
        unknown = set(uses) - set(FEATURES)
        if unknown:
            raise TypeError(f"Request.of: unknown features {sorted(unknown)}; known: {FEATURES}.")
        return cls(target[0], target[1], jnp.dtype(dtype).name, int(qk_dim),
                   tuple(f for f in FEATURES if uses.get(f)), compute_capability, strategy, bool(key_masks))


def takes(row: Capability, feature: str, req: Request) -> bool:
    """Whether ``row`` takes ``feature`` for ``req``: in its features, and on a GPU of at least
    the compute capability the row needs for it (an unknown GPU counts as too old)."""
    if not row.takes(feature):
        return False
    need = row.needs_capability.get(feature)
    return need is None or (req.compute_capability is not None and tuple(req.compute_capability) >= need)


def _seen(req: Request) -> str:
    if req.platform != "gpu":
        return ""
    cc = "unknown" if req.compute_capability is None else ".".join(map(str, req.compute_capability))
    return f"; this GPU's compute capability: {cc}"


def padded_head_dim(row: Capability, qk_dim: int) -> int:
    """``qk_dim`` rounded up to the kernel's head-dim multiple."""
    return -(-qk_dim // row.head_dim_multiple) * row.head_dim_multiple


def check_name(name: str, automatic: bool = False) -> None:
    """Raises ValueError for a kernel name that is not a row of :data:`CAPABILITIES`
    (``automatic``: None is also a valid choice where this is checked)."""
    if name not in CAPABILITIES:
        also = " or None (automatic)" if automatic else ""
        raise ValueError(f"Unknown implementation={name!r}; choose one of {implementations()}{also}.")


def platform_refusal(row: Capability, req: Request) -> str:
    """The refusal of ``row`` for a call on another platform than its own, with the fix its row
    gives (``platform_hint``, and ``host_hint`` when the platform was JAX's default backend)."""
    msg = (f"implementation={row.name!r} needs a {' or '.join(p.upper() for p in row.platforms)}, but the "
           f"computation runs on '{req.platform}' ({req.where}). {row.platform_hint}")
    if row.host_hint and req.where.startswith("JAX's default"):
        msg += f" {row.host_hint}"
    return msg


def _gap(row: Capability, req: Request) -> Optional[Tuple[str, str]]:
    """What ``row`` lacks for ``req``, the decisive first, as ``(gap, why)``: 'platform',
    'dtype', 'head_dim' (why: ''), a feature of :data:`FEATURES` (why: the row's), or what the
    request's context strategy cannot take of the kernel (said as the strategy says it, with
    why); None when it can serve it."""
    if req.platform not in row.platforms:
        return "platform", ""
    if row.dtypes is not None and req.dtype not in row.dtypes:
        return "dtype", ""
    if row.max_head_dim is not None and padded_head_dim(row, req.qk_dim) > row.max_head_dim:
        return "head_dim", ""
    feature = next((f for f in req.features if not takes(row, f, req)), None)
    if feature is not None:
        return FEATURE_NAMES[feature], row.why_not[feature]
    kernel_gap = getattr(req.strategy, "kernel_gap", None)
    return None if kernel_gap is None else kernel_gap(row, req.key_masks)


def refusal(name: str, req: Request) -> Optional[str]:
    """Why kernel ``name`` cannot serve ``req``, or None: the platform first (the decisive
    reason), then the dtype, the head dim, the masking features, and what the context strategy
    needs of a kernel, from :data:`CAPABILITIES` (and the strategy's row)."""
    row = CAPABILITIES[name]
    gap = _gap(row, req)
    if gap is None:
        return None
    what, why = gap
    if what == "platform":
        return platform_refusal(row, req)
    if what == "dtype":
        return (f"implementation={name!r} needs {' or '.join(row.dtypes)} inputs, got {req.dtype}. Set the "
                "module's dtype=jnp.bfloat16, or use implementation='xla'.")
    if what == "head_dim":
        return (f"implementation={name!r} supports head dims <= {row.max_head_dim}; the packed q/k dim is "
                f"{req.qk_dim}. Use fewer heads' dims or implementation='xla'.")
    return f"implementation={name!r} cannot take {what}: {why}{_seen(req)}."


def reason_skipped(name: str, req: Request) -> Optional[str]:
    """The short form of :func:`refusal` for the automatic choice's log line (why a preferred
    kernel was passed over), or None when it can serve ``req`` or is no candidate on its platform."""
    row = CAPABILITIES[name]
    gap = _gap(row, req)
    if gap is None or gap[0] == "platform":
        return None
    what, why = gap
    if what == "dtype":
        return f"{req.dtype} ({name} needs {'/'.join(row.dtypes)})"
    if what == "head_dim":
        return f"packed head dim {padded_head_dim(row, req.qk_dim)} > {row.max_head_dim}"
    return f"{what} ({why}{_seen(req)})"


def markdown_table() -> str:
    """The capability table as Markdown, one line per registered row (docs/layer.md holds it; a
    test keeps the two equal). "tried first on": the platforms whose automatic choice prefers it.
    "segment ids + padding / offset / cross": segment ids together with key padding, kv
    lengths, a causal offset or keys other than the queries (what cuDNN's packed layout lacks).
    The ring columns: whether the row has ring blocks (``ring_blocks``), and whether they take
    segment ids and key padding. "causal under all-gather": whether each shard's offset causal
    mask runs in the kernel's own causal mode or as an explicit mask (its row's ``detours``; the
    reason is in the choice's log)."""
    head = ["kernel", "platforms", "tried first on", "dtypes", "max q/k dim", "head dim padded to", "lengths padded to"]
    short = {"segment_ids": "segment ids", "ragged_segments": "segment ids + padding / offset / cross",
             "bias": "additive bias", "traced_offset": "traced causal offset", "window": "sliding window",
             "return_probs": "probabilities"}
    head += [short[f] for f in FEATURES] + ["ring context parallelism", "ring with segment ids / padding",
                                            "causal under all-gather"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    yes = lambda b: "yes" if b else "no"
    for row in CAPABILITIES.values():
        cells = [f"`{row.name}`", ", ".join(row.platforms), ", ".join(row.preferred_on) or "-",
                 "any float" if row.dtypes is None else ", ".join(row.dtypes),
                 str(row.max_head_dim or "-"), str(row.head_dim_multiple), str(row.length_multiple)]
        cells += [("from compute capability " + ".".join(map(str, row.needs_capability[f]))
                   if f in row.needs_capability else "yes") if row.takes(f) else "no" for f in FEATURES]
        ring = row.ring_blocks
        cells += [yes(ring is not None), yes(ring is not None and ring.no_key_masks is None)]
        cells.append("as an explicit mask" if "gathered_causal" in row.detours else "native")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
