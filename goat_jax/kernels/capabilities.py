"""What each attention kernel can do: one row per kernel (:data:`CAPABILITIES`), read by the
automatic choice (:func:`goat_jax.kernels.resolve_implementation`), by every refusal
(:func:`refusal`), by the front door (:func:`goat_jax.kernels.attend` runs ``row.attention``) and
by docs/layer.md's table (:func:`markdown_table`).

A kernel declares its own row where it is defined: its module ends with
``ROW = capabilities.register(Capability(...))`` (platforms, dtypes, the features it takes and why
it lacks the others, the platforms where the automatic choice tries it first, whether it builds
its masks statically, and the function that runs it), so the table, the dispatch registry, the
preference order and the docs table are all read off the registered rows: a new kernel is one new
module (a plugin, or a module of this package, which :mod:`goat_jax.kernels` imports whole).

A call's needs are a :class:`Request` (the platform the computation runs on, the dtype, the
packed q/k width, and which masking features it uses); :func:`refusal` returns the first reason
a kernel cannot serve it (the decisive one first: the platform, then the dtype, the head dim,
then the features), or None.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Dict, Optional, Tuple

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
FEATURES = ("segment_ids", "ragged_segments", "bias", "traced_offset", "window", "return_probs", "ring",
            "ring_masks")
FEATURE_NAMES = {"segment_ids": "segment ids",
                 "ragged_segments": "segment ids with key padding, kv lengths, a causal offset or cross-attention",
                 "bias": "an additive bias", "traced_offset": "a traced causal offset",
                 "window": "a sliding window", "return_probs": "return_probs",
                 "ring": "context_strategy='ring'",
                 "ring_masks": "segment ids or key padding under context_strategy='ring'"}  # as the messages say them
HOPPER = (9, 0)  # GPU compute capability of H100 / H200


@dataclasses.dataclass(frozen=True)
class Capability:
    """One kernel's row. ``why_not`` says, per feature of :data:`FEATURES` it lacks, why."""

    name: str
    platforms: Tuple[str, ...]  # where it runs
    dtypes: Optional[Tuple[str, ...]]  # None: any float dtype
    max_head_dim: Optional[int]  # packed q/k width after padding; None: no limit
    head_dim_multiple: int  # q/k (and v) widths are zero-padded to a multiple of this
    length_multiple: int  # query/key lengths are padded to multiples of this, exactly
    auto_min_length: int  # the automatic choice takes it only for lengths >= this
    features: Tuple[str, ...]  # the FEATURES it takes
    why_not: Dict[str, str]
    summary: str  # one line: what it is (docs/layer.md's kernel table)
    # feature -> the least GPU compute capability on which the kernel takes it (else why_not)
    needs_capability: Dict[str, Tuple[int, int]] = dataclasses.field(default_factory=dict)
    # fn(q, k, v, *, scale, mask, bias, mesh) -> [B, T, N, Hv]: the kernel itself
    attention: Optional[Callable[..., Any]] = dataclasses.field(default=None, compare=False, repr=False)
    preferred_on: Tuple[str, ...] = ()  # platforms whose automatic choice tries it first (in name order)
    static_masks: bool = False  # builds its masks statically: each context shard's offset is a branch of its own
    # situation (a key of DETOURS) -> how the kernel runs it other than natively, and why; the
    # automatic choice's log line says it when the call is in that situation
    detours: Dict[str, str] = dataclasses.field(default_factory=dict)

    def takes(self, feature: str) -> bool:
        """Whether the kernel takes ``feature`` (one of :data:`FEATURES`)."""
        return feature in self.features


# Reasons several rows share (each kernel module says the rest of its own).
NO_BIAS = "flash kernels take packed q/k instead of an additive bias"
NO_PROBS = "only 'dense' materializes the attention probabilities"
NO_RING = ("ring attention merges blocks by their log-sum-exp, which 'dense' does not return (ring blocks run on "
           "flash, splash or cuDNN: goat_jax/kernels/ring_blocks.py); use implementation='flash' or "
           "context_strategy='all_gather'")
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

# name -> row, in name order (the order of docs/layer.md's table, of the choices and of preference).
CAPABILITIES: Dict[str, Capability] = {}
IMPLEMENTATIONS: Tuple[str, ...] = ()


def register(row: Capability) -> Capability:
    """Adds ``row`` to :data:`CAPABILITIES` (a kernel module's own row, or a plugin's) and returns
    it. ValueError for a name registered already, a row without its ``attention`` function, or a
    feature or platform the table does not know."""
    global IMPLEMENTATIONS  # pylint: disable=global-statement
    if row.name in CAPABILITIES:
        raise ValueError(f"implementation={row.name!r} is registered already.")
    if row.attention is None:
        raise ValueError(f"Capability {row.name!r} needs its attention function (attention=...).")
    unknown = (set(row.features) | set(row.why_not)) - set(FEATURES) | set(row.detours) - set(DETOURS)
    if unknown or not set(row.platforms) | set(row.preferred_on) <= set(ANY):
        raise ValueError(f"Capability {row.name!r}: unknown features {sorted(unknown)} or platforms "
                         f"{sorted(set(row.platforms) | set(row.preferred_on))}; known: {FEATURES}, {tuple(DETOURS)}, {ANY}.")
    rows = sorted([*CAPABILITIES.values(), row], key=lambda r: r.name)  # by name: not by import order
    CAPABILITIES.clear()
    CAPABILITIES.update((r.name, r) for r in rows)
    IMPLEMENTATIONS = tuple(CAPABILITIES)
    package = sys.modules.get("goat_jax.kernels")
    if package is not None and hasattr(package, "IMPLEMENTATIONS"):
        package.IMPLEMENTATIONS = IMPLEMENTATIONS
    return row


def preferred(platform: str) -> Tuple[str, ...]:
    """The kernels the automatic choice tries first on ``platform``, in name order."""
    return tuple(name for name, row in CAPABILITIES.items() if platform in row.preferred_on)


@dataclasses.dataclass(frozen=True)
class Request:
    """What one attention call asks of a kernel: the platform it runs on (``where``: how that
    was read, :func:`goat_jax.kernels.target_platform`), the dtype, the packed q/k width, and
    the masking features it uses (:data:`FEATURES`)."""

    platform: str
    where: str
    dtype: str
    qk_dim: int
    features: Tuple[str, ...] = ()
    compute_capability: Optional[Tuple[int, int]] = None  # GPUs, when known

    @classmethod
    def of(cls, target: Tuple[str, str], dtype, qk_dim: int, compute_capability: Optional[Tuple[int, int]] = None,
           **uses: bool) -> "Request":
        """A request on ``target`` = (platform, where); ``uses``: feature name -> bool."""
        unknown = set(uses) - set(FEATURES)
        if unknown:
            raise TypeError(f"Request.of: unknown features {sorted(unknown)}; known: {FEATURES}.")
        return cls(target[0], target[1], jnp.dtype(dtype).name, int(qk_dim),
                   tuple(f for f in FEATURES if uses.get(f)), compute_capability)


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
        raise ValueError(f"Unknown implementation={name!r}; choose one of {IMPLEMENTATIONS}{also}.")


def platform_refusal(row: Capability, req: Request) -> str:
    """The refusal of ``row`` for a call on another platform than its own (with the fix)."""
    name = row.name
    msg = (f"implementation={name!r} needs a {' or '.join(p.upper() for p in row.platforms)}, but the "
           f"computation runs on '{req.platform}' ({req.where}).")
    if name == "splash":
        msg += " Use 'splash_interpret' to run the same Pallas kernel in interpret mode (slow; for tests)."
        if req.where.startswith("JAX's default"):
            msg += (" To compile for TPUs from this host, trace under a mesh of TPU devices "
                    "(jax.set_mesh(mesh); docs/aot.md).")
    else:
        msg += " Use implementation='xla' (or None for automatic choice)."
    return msg


def _gap(row: Capability, req: Request) -> Optional[str]:
    """What ``row`` lacks for ``req``, the decisive first: 'platform', 'dtype', 'head_dim', a
    feature of :data:`FEATURES`, or None when it can serve it."""
    if req.platform not in row.platforms:
        return "platform"
    if row.dtypes is not None and req.dtype not in row.dtypes:
        return "dtype"
    if row.max_head_dim is not None and padded_head_dim(row, req.qk_dim) > row.max_head_dim:
        return "head_dim"
    return next((f for f in req.features if not takes(row, f, req)), None)


def refusal(name: str, req: Request) -> Optional[str]:
    """Why kernel ``name`` cannot serve ``req``, or None: the platform first (the decisive
    reason), then the dtype, the head dim, and the masking features, from :data:`CAPABILITIES`."""
    row = CAPABILITIES[name]
    gap = _gap(row, req)
    if gap is None:
        return None
    if gap == "platform":
        return platform_refusal(row, req)
    if gap == "dtype":
        return (f"implementation={name!r} needs {' or '.join(row.dtypes)} inputs, got {req.dtype}. Set the "
                "module's dtype=jnp.bfloat16, or use implementation='xla'.")
    if gap == "head_dim":
        return (f"implementation={name!r} supports head dims <= {row.max_head_dim}; the packed q/k dim is "
                f"{req.qk_dim}. Use fewer heads' dims or implementation='xla'.")
    return f"implementation={name!r} cannot take {FEATURE_NAMES[gap]}: {row.why_not[gap]}{_seen(req)}."


def reason_skipped(name: str, req: Request) -> Optional[str]:
    """The short form of :func:`refusal` for the automatic choice's log line (why a preferred
    kernel was passed over), or None when it can serve ``req`` or is no candidate on its platform."""
    row = CAPABILITIES[name]
    gap = _gap(row, req)
    if gap in (None, "platform"):
        return None
    if gap == "dtype":
        return f"{req.dtype} ({name} needs {'/'.join(row.dtypes)})"
    if gap == "head_dim":
        return f"packed head dim {padded_head_dim(row, req.qk_dim)} > {row.max_head_dim}"
    return f"{FEATURE_NAMES[gap]} ({row.why_not[gap]}{_seen(req)})"


def markdown_table() -> str:
    """The capability table as Markdown, one line per registered row (docs/layer.md holds it; a
    test keeps the two equal). "tried first on": the platforms whose automatic choice prefers it.
    "segment ids + padding / offset / cross": segment ids together with key padding, kv
    lengths, a causal offset or keys other than the queries (what cuDNN's packed layout lacks).
    "causal under all-gather": whether each shard's offset causal mask runs in the kernel's own
    causal mode or as an explicit mask (its row's ``detours``; the reason is in the choice's log)."""
    head = ["kernel", "platforms", "tried first on", "dtypes", "max q/k dim", "head dim padded to", "lengths padded to"]
    short = {"segment_ids": "segment ids", "ragged_segments": "segment ids + padding / offset / cross",
             "bias": "additive bias", "traced_offset": "traced causal offset", "window": "sliding window",
             "return_probs": "probabilities", "ring": "ring context parallelism",
             "ring_masks": "ring with segment ids / padding"}
    head += [short[f] for f in FEATURES] + ["causal under all-gather"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in CAPABILITIES.values():
        cells = [f"`{row.name}`", ", ".join(row.platforms), ", ".join(row.preferred_on) or "-",
                 "any float" if row.dtypes is None else ", ".join(row.dtypes),
                 str(row.max_head_dim or "-"), str(row.head_dim_multiple), str(row.length_multiple)]
        cells += [("from compute capability " + ".".join(map(str, row.needs_capability[f]))
                   if f in row.needs_capability else "yes") if row.takes(f) else "no" for f in FEATURES]
        cells.append("as an explicit mask" if "gathered_causal" in row.detours else "native")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
