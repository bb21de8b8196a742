"""Which kernel runs: the target platform of the computation being traced, the automatic
choice and its logged reason, explicit choices checked against the capability table
(:mod:`goat_jax.kernels.capabilities`), and the record of every choice for compile reports.

Automatic choice (``implementation=None``) for the devices the computation runs on
(:func:`target_platform`): each platform's preferred kernels (the rows that name the platform
in ``preferred_on``, :func:`goat_jax.kernels.capabilities.preferred`) when their row can serve the call
(cuDNN on GPU for bf16/fp16 when the packed head dim fits; splash on TPU for lengths of at least
128, padded to whole 128-blocks exactly, or multiples of every chunk's blocks under context
parallelism); otherwise (CPU, or what the preferred kernel cannot take) the fallback rows (those
with a ``fallback`` tier, lower tiers first: 'flash' and 'xla', then 'dense'): within a tier the
rows that hold no T x S logits ('flash') first when XLA would materialize more than
``FLASH_THRESHOLD_BYTES`` (16 MiB) of float32 logits, ``B * N * T * S * 4`` bytes, and those that
do ('xla') first below it (whichever the call's features allow). Why 16 MiB: XLA keeps the
logits and the probabilities (and their gradients while training), so its memory grows as L^2
(2.1 GiB for one B=1, 8-head layer at L=4096), and on CPU the flash kernel is already faster
from L = 1024 at 8 heads (32 MiB of logits; benchmarks/attention.md); below the threshold
(short sequences, decoding one token against a cache) XLA's single fused matmul has less loop
overhead and its memory is small anyway.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator, NamedTuple, Optional, Tuple

import jax

from goat_jax.kernels import capabilities as caps
from goat_jax.kernels import mesh as mesh_lib
from goat_jax.kernels import strategies
from goat_jax.kernels.plan import DEFAULT, AttentionPlan
from goat_jax.targets import chips

FLASH_THRESHOLD_BYTES = 16 * 2**20  # automatic choice: 'flash' above this many float32 logits bytes

_logger = logging.getLogger("goat_jax")
_logged: set = set()
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


class Recorders:
    """The lists of the ``with`` blocks open on one kind of event: :meth:`record` opens one
    (nested blocks each receive every event), :meth:`add` appends an event to each open list
    (``unique``: once per list). The compile tool reads what one compile did through them."""

    def __init__(self, unique: bool = False):
        self._open: list = []
        self._unique = unique

    @contextlib.contextmanager
    def record(self) -> Iterator[list]:
        """A list that receives every event added until the ``with`` ends."""
        found: list = []
        self._open.append(found)
        try:
            yield found
        finally:
            self._open.remove(found)

    def add(self, event: Any) -> None:
        """Appends ``event`` to every open list (once per list when ``unique``)."""
        for found in self._open:
            if not (self._unique and event in found):
                found.append(event)


_choices = Recorders()  # the open record_choices() lists


def record_choices():
    """Collects every kernel choice made while tracing inside the ``with`` (one dict per
    :func:`resolve_implementation` call: implementation, packed q/k dim ``qk_dim``, dtype,
    platform and where it was read); :mod:`goat_jax.aot` reports what a compiled step uses."""
    return _choices.record()


def context_plan(implementation: str, mesh: Any, plan: AttentionPlan, causal: bool = False) -> dict:
    """How attention with ``implementation`` on ``mesh`` under ``plan`` crosses the context axis,
    for the log line and the compile report: ``{}`` when the sequence is not split; else
    ``context_strategy``, ``context_shards``, ``load_balanced``, what the strategy's row reports
    of the kernel (its ``report``: for a ring, ``ring_blocks``, the kernel whose block math
    computes its blocks: a ring under 'xla' runs flash's); and ``detour``: how the kernel takes a
    ``causal`` mask in the strategy's situation (the strategy's ``detour``) when not natively (its
    capability row's ``detours``, e.g. cuDNN's explicit mask under 'all_gather'), where it says so."""
    shards = mesh_lib.context_shards(mesh, plan.context_axis)
    if shards <= 1:
        return {}
    found = {"context_strategy": plan.context_strategy, "context_shards": shards,
             "load_balanced": plan.load_balanced}
    strategy = strategies.get(plan.context_strategy)
    row = caps.CAPABILITIES.get(implementation)
    if row is not None and strategy.report is not None:
        found.update(strategy.report(row))
    if causal and row is not None and strategy.detour in row.detours:
        found["detour"] = row.detours[strategy.detour]
    return found


def describe_context(plan: dict) -> str:
    """One phrase naming the strategy of :func:`context_plan` (``''`` without one)."""
    if not plan:
        return ""
    text = (f"context strategy '{plan['context_strategy']}' over {plan['context_shards']} devices, "
            f"{'load-balanced' if plan['load_balanced'] else 'not load-balanced'}")
    if "ring_blocks" in plan:
        text += f", each block computed by {plan['ring_blocks']}'s block math"
    if "whole_sequence" in plan:  # Ulysses: the heads are exchanged, the kernel sees every position
        text += (f", heads exchanged all-to-all: each device runs {plan['whole_sequence']} on the whole sequence "
                 f"for 1/{plan['context_shards']} of the heads"
                 + (" (load balancing not needed: it only adds two reorders)" if plan["load_balanced"] else
                    " (no load balancing needed)"))
    if "detour" in plan:
        text += f" ({plan['detour']})"
    return text


def _record(choice: str, req: caps.Request, plan: dict) -> str:
    _choices.add({"implementation": choice, "qk_dim": req.qk_dim, "dtype": req.dtype,
                  "platform": req.platform, "devices_from": req.where, **plan})
    return choice


def log_once(message: str) -> None:
    """Logs ``message`` at INFO level the first time it is seen in this process."""
    if message not in _logged:
        _logged.add(message)
        _logger.info(message)


def _normal(platform: str) -> str:
    return "gpu" if platform in _GPU_PLATFORMS else platform


def compute_capability(device: Any) -> Optional[Tuple[int, int]]:
    """A GPU device's compute capability (major, minor): its own report, else its chip's row
    (:func:`goat_jax.targets.chips.chip_for`, e.g. the abstract devices of a compile-only GPU
    target, goat_jax/aot/); None when unknown."""
    own = getattr(device, "compute_capability", None)
    if isinstance(own, str) and "." in own:
        return tuple(int(x) for x in own.split(".")[:2])  # type: ignore[return-value]
    chip = chips.chip_for(str(getattr(device, "device_kind", "")))
    return None if chip is None else chip.compute_capability


def _array_target(x: Any) -> Optional[Tuple[str, str, Any]]:
    """``(platform, where, device)`` of ``x`` from its own placement, or None when that is
    unknown (a tracer without a mesh in its type, a NumPy array)."""
    if x is None or not hasattr(x, "shape"):
        return None
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        try:
            device = next(iter(x.sharding.device_set))
        except Exception:  # pylint: disable=broad-except  # deleted or unusual arrays
            return None
        return _normal(device.platform), f"the inputs' devices ({device.device_kind})", device
    try:
        mesh = jax.typeof(x).sharding.mesh
    except Exception:  # pylint: disable=broad-except  # no sharding in the type
        return None
    device = getattr(mesh, "abstract_device", None)
    if getattr(mesh, "empty", True) or device is None:
        return None
    return _normal(device.platform), f"the inputs' mesh ({device.device_kind})", device


def target(*like: Any, mesh: Any = None) -> Tuple[str, str, Any]:
    """``(platform, where that was read, a device of that kind)`` of the computation being
    traced (:func:`target_platform`); the device tells a GPU's compute capability."""
    for x in like:
        found = _array_target(x)
        if found is not None:
            return found
    abstract = mesh_lib.ambient_mesh() if mesh is None else mesh
    device = getattr(abstract, "abstract_device", None)
    if not abstract.empty and device is not None:
        return _normal(device.platform), f"the mesh in context ({device.device_kind})", device
    try:  # `with mesh:` (deprecated) sets only the physical mesh
        from jax._src import mesh as jax_mesh  # pylint: disable=g-import-not-at-top
        physical = jax_mesh.thread_resources.env.physical_mesh
        if not physical.empty:
            device = physical.devices.flat[0]
            return _normal(device.platform), f"the mesh in context ({device.device_kind})", device
    except (ImportError, AttributeError):
        pass
    return (_normal(jax.default_backend()),
            "JAX's default backend, as no mesh was set where this attention call was traced", jax.devices()[0])


def target_platform(*like: Any, mesh: Any = None) -> Tuple[str, str]:
    """``(platform, where that was read)`` of the devices the computation being traced runs on:
    'cpu', 'gpu' or 'tpu'. The one place the kernels ask which hardware they are for.

    In order: the placement of the arrays ``like`` (concrete arrays' devices; a tracer whose type
    carries a mesh, under explicit sharding); ``mesh``, else the abstract mesh in context
    (``jax.set_mesh(mesh)``, ``jax.sharding.use_abstract_mesh``, the trainer's
    :func:`goat_jax.train.sharding.with_mesh_and_rules`), whose devices may be another machine's
    (a TPU topology compiled ahead of time on a CPU host, :mod:`goat_jax.aot`); a legacy
    ``with mesh:``; and only then JAX's default backend (the host's).
    """
    return target(*like, mesh=mesh)[:2]


def split_by(mesh: Any, plan: AttentionPlan) -> Optional[strategies.Strategy]:
    """The context strategy of a call on ``mesh`` under ``plan``, which a kernel must suit
    (:attr:`goat_jax.kernels.strategies.Strategy.kernel_gap`): the plan's, when its context
    axis splits the sequence; else None."""
    if mesh_lib.context_shards(mesh, plan.context_axis) <= 1:
        return None
    return strategies.get(plan.context_strategy)


def request(implementation_dtype: Any, qk_dim: int, *, like: Tuple[Any, ...] = (), mesh: Any = None,
            strategy: Optional[strategies.Strategy] = None, key_masks: bool = False, **uses: bool) -> caps.Request:
    """The :class:`goat_jax.kernels.capabilities.Request` of a call in ``implementation_dtype``
    with a ``qk_dim``-wide q/k on the target of ``like`` / ``mesh`` (:func:`target`), split by
    ``strategy`` (None: not split) with masks travelling with the keys when ``key_masks``."""
    platform, where, device = target(*like, mesh=mesh)
    cc = compute_capability(device) if platform == "gpu" else None
    return caps.Request.of((platform, where), implementation_dtype, qk_dim, cc, strategy=strategy,
                           key_masks=key_masks, **uses)


def _length_skip(row: caps.Capability, logits_shape, mesh: Any, plan: AttentionPlan) -> Optional[str]:
    """Why the automatic choice passes over ``row`` for these lengths, or None. A kernel with
    a length multiple (splash's 128-blocks) takes any length >= its ``auto_min_length`` (padded
    to whole blocks, exactly: < 2x the tiles); under context parallelism every chunk a device
    attends must be whole blocks, so the lengths must be multiples of the chunks' blocks."""
    if row.auto_min_length <= 1 or logits_shape is None:
        return None
    t, s = logits_shape[2], logits_shape[3]
    shards = mesh_lib.context_shards(mesh, plan.context_axis)
    chunks = shards * (2 if plan.load_balanced else 1) if shards > 1 else 1
    multiple = row.length_multiple * chunks
    if not (t % multiple or s % multiple):
        return None
    if chunks == 1 and min(t, s) >= row.auto_min_length:
        return None
    return (f"{row.name} needs lengths of at least {row.auto_min_length} (padded to whole blocks) or, "
            f"under context parallelism, multiples of {multiple} (T={t}, S={s})")


def _automatic(req: caps.Request, logits_shape, mesh: Any, plan: AttentionPlan) -> Tuple[str, str]:
    reasons = []
    for name in caps.preferred(req.platform):
        row = caps.CAPABILITIES[name]
        skip = caps.reason_skipped(name, req) or _length_skip(row, logits_shape, mesh, plan)
        if skip is None:
            segments = ", with segment ids" if "segment_ids" in req.features else ""
            report = req.strategy.report(row) if req.strategy is not None and req.strategy.report else {}
            split = f", ring blocks on {report['ring_blocks']}" if report.get("ring_blocks") else ""
            return name, (f"{req.platform.upper()}, {req.dtype}, packed head dim "
                          f"{caps.padded_head_dim(row, req.qk_dim)}{segments}{split}")
        reasons.append(f"{req.platform.upper()}, but {skip}")
    logits_bytes = 4 * math.prod(logits_shape) if logits_shape is not None else 0
    big = logits_bytes > FLASH_THRESHOLD_BYTES
    fallbacks = [row for row in caps.CAPABILITIES.values() if row.fallback is not None]
    tiers = sorted({row.fallback for row in fallbacks})
    last = None
    for tier in tiers:
        # Above the threshold the rows that hold no T x S logits first, below it those that do.
        ordered = sorted((row for row in fallbacks if row.fallback == tier),
                         key=lambda row: (row.materializes_logits == big, row.name))
        for row in ordered:
            last = row
            if caps.refusal(row.name, req) is not None:
                continue
            if tier != tiers[0]:
                return row.name, ", ".join(reasons + [f"only {row.name!r} takes this call"])
            if big and not row.materializes_logits:
                reasons.append(f"{logits_bytes / 2**20:.0f} MiB of T x S logits > "
                               f"{FLASH_THRESHOLD_BYTES / 2**20:.0f} MiB")
            elif big:
                lean = next((r for r in ordered if not r.materializes_logits), None)
                if lean is not None:
                    reasons.append(f"{lean.name} cannot run it: {caps.reason_skipped(lean.name, req)}")
            return row.name, ", ".join(reasons) or f"platform {req.platform}"
    # No row serves the call: the last fallback, whose own checks say why where it runs.
    return last.name, ", ".join(reasons + [f"no kernel takes this call; {last.name!r} will say why"])


class Choice(NamedTuple):
    """The kernel of one attention call, chosen once (:func:`choose`): its name, the request it
    was checked against and the mesh read for it, handed to :func:`goat_jax.kernels.attend` so
    the call neither chooses nor reads the mesh again."""

    implementation: str
    request: caps.Request
    mesh: Any


def choose(implementation: Optional[str], dtype: Any, qk_dim: int,
           logits_shape: Optional[Tuple[int, int, int, int]] = None, *, like: Tuple[Any, ...] = (),
           mesh: Any = None, plan: Optional[AttentionPlan] = None, **uses: bool) -> Choice:
    """:func:`resolve_implementation` with the call's features as ``uses`` (feature name -> bool,
    e.g. ``**mask.features()``), returning the :class:`Choice` (name, request, mesh)."""
    mesh = mesh_lib.ambient_mesh() if mesh is None else mesh
    plan = DEFAULT if plan is None else plan
    # Masks that travel with the keys (segment ids, key padding, kv lengths): read only by the
    # strategy splitting the sequence (cuDNN's ring blocks take none of them).
    key_masks = uses.pop("key_masks", False) or uses.get("segment_ids") or uses.get("ragged_segments")
    causal = uses.pop("gathered_causal", False)  # read only for a kernel's detour under its strategy
    strategy = split_by(mesh, plan)
    if strategy is not None and strategy.ragged_segments and uses.get("segment_ids"):
        # The call's mask is the global one, but the strategy runs the kernel on each device's
        # queries (at their offset, with their ids) against other keys: ragged, which a kernel that
        # takes segment ids only as packed self-attention (cuDNN's packed layout) cannot express.
        uses["ragged_segments"] = True
    req = request(dtype, qk_dim, like=like, mesh=mesh, strategy=strategy, key_masks=bool(key_masks), **uses)
    if implementation is None or implementation == "auto":
        name, why = _automatic(req, logits_shape, mesh, plan)
        context = context_plan(name, mesh, plan, causal)
        # A ring leads the line: its blocks, not the named kernel, are what runs.
        lead = f"{describe_context(context)}; implementation" if "ring_blocks" in context else "implementation"
        tail = f"; {describe_context(context)}" if context and "ring_blocks" not in context else ""
        log_once(f"goat_jax: attention {lead} '{name}' ({why}; devices from {req.where}){tail}.")
        return Choice(_record(name, req, context), req, mesh)
    caps.check_name(implementation, automatic=True)
    why = caps.refusal(implementation, req)
    if why is not None:
        raise ValueError(why)
    context = context_plan(implementation, mesh, plan, causal)
    if context:  # an explicit kernel needs no reason, but how it crosses the shards is news
        log_once(f"goat_jax: attention implementation '{implementation}' (explicit); {describe_context(context)}.")
    return Choice(_record(implementation, req, context), req, mesh)


def resolve_implementation(implementation: Optional[str], dtype: Any, qk_dim: int,
                           logits_shape: Optional[Tuple[int, int, int, int]] = None,
                           *, like: Tuple[Any, ...] = (), segments: bool = False, ragged_segments: bool = False,
                           bias: bool = False, decoding: bool = False, mesh: Any = None,
                           plan: Optional[AttentionPlan] = None) -> str:
    """Validates ``implementation`` or picks one automatically (logged once), for the devices
    the computation runs on (:func:`target_platform` of ``like`` and ``mesh``, else the mesh in
    context, else the default backend): a TPU program traced on a CPU host gets TPU kernels.

    Args:
      implementation: a name of :data:`goat_jax.kernels.IMPLEMENTATIONS`, or None / 'auto'.
      dtype, qk_dim: the kernel's input dtype and packed q/k width.
      logits_shape: (B, N, T, S) when known: the automatic choice's size rule (module doc).
      segments, ragged_segments, bias, decoding: the call has segment ids / segment ids with a
        key padding mask or keys other than the queries / an additive bias / a traced causal
        offset (a KV cache); kernels that cannot take them are passed over (automatic) or
        refused (explicit), from the capability table.
      plan: the call's :class:`goat_jax.kernels.plan.AttentionPlan` (its context strategy and balancing);
        default: the default plan.
    Raises:
      ValueError naming the reason when an explicit choice cannot run.
    """
    return choose(implementation, dtype, qk_dim, logits_shape, like=like, mesh=mesh, plan=plan,
                  segment_ids=segments, ragged_segments=ragged_segments, bias=bias,
                  traced_offset=decoding).implementation
