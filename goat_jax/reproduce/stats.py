"""Seeds and intervals for the report harness: every number of a multi-seed report is an
:class:`Estimate` (the mean over seeds, carrying every seed's value), and every headline check
is judged by :func:`verdict` on a paired difference.

The interval is a two-sided 95% Student t interval over seeds,
``mean ± t(0.975, n-1) * sd / sqrt(n)`` (``sd`` with ``n-1`` in the denominator): seeds are
the unit of replication (a new seed draws a new init, data order and dropout), evaluation
windows are the same for every seed, so their noise is inside each seed's value. With one seed
there is no interval, and the verdict says so instead of inventing one.

Arithmetic on estimates is per seed: ``a - b`` of two estimates is the paired difference
(seed k minus seed k) over the seeds both have (a run whose seed 1 failed or has not finished
pairs on seeds 0 and 2, never seed 2 with seed 1), ``a / b`` the per-seed ratio; a plain number
applies to every seed. So the family modules compute a check's quantity exactly as for one run and get
its paired interval for free. This is the bottom of :mod:`goat_jax.reproduce` next to
``suites`` and imports nothing from it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Union

CONFIDENCE = 0.95  # the report's interval: two-sided 95%, Student t over seeds
INTERVAL_NAME = "mean ± 95% Student t interval over seeds"
SUPPORTED, CONTRADICTED, INCONCLUSIVE = "supported", "contradicted", "inconclusive"
ONE_SEED = "inconclusive (1 seed)"


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """The two-sided Student t critical value with ``df`` degrees of freedom (scipy: a
    dependency of jax, so always installed)."""
    from scipy import stats as scipy_stats  # pylint: disable=g-import-not-at-top  # on use only

    return float(scipy_stats.t.ppf(0.5 + confidence / 2, df))


class Estimate(float):
    """A number measured once per seed: its float value is the mean, ``values`` the seeds'
    values in seed order, ``seeds`` their seed offsets (default 0, 1, ...), ``half_width`` the
    95% t half-width (None for one seed). Formats as ``'mean ± half'`` with the given spec (the
    mean alone for one seed)."""

    values: tuple[float, ...]
    seeds: tuple[int, ...]

    def __new__(cls, values: Sequence[float], seeds: Optional[Sequence[int]] = None):
        vals = tuple(float(v) for v in values)
        if not vals:
            raise ValueError("Estimate: needs at least one seed's value.")
        ids = tuple(range(len(vals))) if seeds is None else tuple(int(k) for k in seeds)
        if len(ids) != len(vals) or len(set(ids)) != len(ids) or list(ids) != sorted(ids):
            raise ValueError(f"Estimate: seeds {list(ids)} must be {len(vals)} distinct offsets in "
                             f"increasing order, one per value.")
        obj = super().__new__(cls, math.fsum(vals) / len(vals))
        obj.values = vals
        obj.seeds = ids
        return obj

    def __reduce__(self):  # pickles (and copies) with its seeds, not as a bare float
        return (Estimate, (self.values, self.seeds))

    def on(self, seeds: Sequence[int]) -> "Estimate":
        """This estimate restricted to ``seeds`` (each must be one of :attr:`seeds`)."""
        where = dict(zip(self.seeds, self.values))
        return Estimate([where[k] for k in seeds], seeds)

    @property
    def n(self) -> int:
        """How many seeds."""
        return len(self.values)

    @property
    def constant(self) -> bool:
        """True when every seed gave exactly the same value (always, for one seed): a zero
        spread that says the seeds agree, not that anything was measured precisely."""
        return len(set(self.values)) == 1

    @property
    def half_width(self) -> Optional[float]:
        """The 95% t half-width over seeds; None with one seed (no interval exists), exactly 0
        when :attr:`constant`."""
        if self.n < 2:
            return None
        if self.constant:
            return 0.0
        mean = float(self)
        sd = math.sqrt(math.fsum((v - mean) ** 2 for v in self.values) / (self.n - 1))
        return t_quantile(self.n - 1) * sd / math.sqrt(self.n)

    @property
    def interval(self) -> Optional[tuple[float, float]]:
        """(low, high) of the 95% interval, or None with one seed."""
        h = self.half_width
        return None if h is None else (float(self) - h, float(self) + h)

    def __format__(self, spec: str) -> str:
        text = format(float(self), spec)
        h = self.half_width
        return text if h is None else f"{text} ± {format(h, spec.replace('+', ''))}"

    def __str__(self) -> str:
        return format(self, "")

    def _apply(self, other: Any, op, reverse: bool = False):
        if isinstance(other, Estimate):
            common = common_seeds([self, other])
            a, b = self.on(common).values, other.on(common).values
            pairs = zip(b, a) if reverse else zip(a, b)
            return Estimate([op(x, y) for x, y in pairs], common)
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return Estimate([op(other, a) if reverse else op(a, other) for a in self.values], self.seeds)
        return NotImplemented

    def __add__(self, o): return self._apply(o, operator.add)  # noqa: E704
    def __radd__(self, o): return self._apply(o, operator.add, True)  # noqa: E704
    def __sub__(self, o): return self._apply(o, operator.sub)  # noqa: E704
    def __rsub__(self, o): return self._apply(o, operator.sub, True)  # noqa: E704
    def __mul__(self, o): return self._apply(o, operator.mul)  # noqa: E704
    def __rmul__(self, o): return self._apply(o, operator.mul, True)  # noqa: E704
    def __truediv__(self, o): return self._apply(o, operator.truediv)  # noqa: E704
    def __rtruediv__(self, o): return self._apply(o, operator.truediv, True)  # noqa: E704
    def __pow__(self, o): return self._apply(o, operator.pow)  # noqa: E704
    def __rpow__(self, o): return self._apply(o, operator.pow, True)  # noqa: E704
    def __neg__(self): return Estimate([-v for v in self.values], self.seeds)  # noqa: E704
    def __abs__(self): return Estimate([abs(v) for v in self.values], self.seeds)  # noqa: E704


def common_seeds(estimates: Sequence[Estimate]) -> tuple[int, ...]:
    """The seed offsets every one of ``estimates`` has, in order: what a paired comparison of
    them is over. ValueError when they share none (nothing can be paired)."""
    common = sorted(set.intersection(*(set(e.seeds) for e in estimates)))
    if not common:
        raise ValueError("Estimate: no seed in common to pair ("
                         + " vs ".join(str(list(e.seeds)) for e in estimates) + ").")
    return tuple(common)


Number = Union[float, Estimate]


def per_seed_max(items: Sequence[Number]) -> Number:
    """The largest of ``items`` per seed (e.g. the worst block of each seed's run); plain
    numbers apply to every seed."""
    ests = [x for x in items if isinstance(x, Estimate)]
    if not ests:
        return max(items)
    common = common_seeds(ests)
    columns = [x.on(common).values if isinstance(x, Estimate) else [float(x)] * len(common) for x in items]
    return Estimate([max(per_item) for per_item in zip(*columns)], common)


def seed_invariant(x: Any) -> Any:
    """``x`` as a plain number when it is an :class:`Estimate` with the same value in every
    seed (e.g. a no-model reference computed on the same windows for every seed): printed
    without a '± 0' that would read as a measured spread. Anything else is returned as is."""
    if isinstance(x, Estimate) and x.constant:
        return x.values[0]
    return x


def seeds_in(tree: Any) -> set[int]:
    """The seed offsets of every :class:`Estimate` in ``tree`` (nested dicts, lists and
    numbers: an aggregated row), united; empty when it holds none (plain numbers only)."""
    if isinstance(tree, Estimate):
        return set(tree.seeds)
    if isinstance(tree, dict):
        return set().union(*(seeds_in(v) for v in tree.values()))
    if isinstance(tree, (list, tuple)):
        return set().union(*(seeds_in(v) for v in tree))
    return set()


def restrict(tree: Any, seeds: Sequence[int]) -> Any:
    """``tree`` with every :class:`Estimate` restricted to ``seeds`` (:meth:`Estimate.on`);
    other values are kept as they are."""
    if isinstance(tree, Estimate):
        return tree.on(seeds)
    if isinstance(tree, dict):
        return {k: restrict(v, seeds) for k, v in tree.items()}
    if isinstance(tree, list):
        return [restrict(v, seeds) for v in tree]
    if isinstance(tree, tuple):
        return tuple(restrict(v, seeds) for v in tree)
    return tree


def on_common_seeds(rows: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """``rows`` (aggregated results by row name) restricted to the seeds every row that has
    estimates shares, and those seeds: what a family's headline checks read, so that every
    column of every check (the paired difference, the numbers, the fixed threshold's PASS/FAIL)
    is over the same seeds, never one row's mean over two seeds against another's over one.
    Rows with no seed in common are returned unchanged (with ``()``): each check then pairs what
    it can and says how many seeds."""
    seed_sets = [seeds_in(r) for r in rows.values()]
    seed_sets = [s for s in seed_sets if s]
    if not seed_sets:
        return dict(rows), ()
    common = tuple(sorted(set.intersection(*seed_sets)))
    if not common:
        return dict(rows), ()
    return {k: restrict(v, common) for k, v in rows.items()}, common


def aggregate(per_seed: Sequence[Any], seeds: Optional[Sequence[int]] = None) -> Any:
    """One result structure per seed (the same shape: dicts, lists, numbers) -> one structure
    whose numbers are :class:`Estimate` s over the seeds (``seeds``: their offsets, default
    0, 1, ...). Keys present in every seed are kept; equal ints (steps, lengths, counts) stay
    ints; strings, booleans and None keep the first seed's value. One seed gives one-seed
    estimates (no interval)."""
    first = per_seed[0]
    if isinstance(first, dict):
        keys = [k for k in first if all(isinstance(s, dict) and k in s for s in per_seed)]
        return {k: aggregate([s[k] for s in per_seed], seeds) for k in keys}
    if isinstance(first, (list, tuple)):
        if all(isinstance(s, (list, tuple)) and len(s) == len(first) for s in per_seed):
            return [aggregate([s[i] for s in per_seed], seeds) for i in range(len(first))]
        return first
    numbers = all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in per_seed)
    if numbers:
        if all(isinstance(s, int) for s in per_seed) and len(set(per_seed)) == 1:
            return first
        return Estimate(per_seed, seeds)
    return first


class Check(NamedTuple):
    """One headline check: the claim, the old fixed-threshold result (``ok``: True / False /
    None if not measured), the numbers, the verdict word on ``difference``, that difference as
    printed (e.g. ``'GOAT - RoPE = -0.020 ± 0.010 bits'``) and how many seeds it pairs (fewer
    than the report's when a row has not finished every seed)."""

    claim: str
    ok: Optional[bool]
    numbers: str
    verdict: str = ""
    difference: str = ""
    seeds: Optional[int] = None  # how many seeds the difference pairs (None: a deterministic number)


def verdict(difference: Any, claimed_sign: int) -> str:
    """The verdict on a claim that ``difference`` is > 0 (``claimed_sign`` +1) or < 0 (-1):
    'supported' when its 95% interval excludes 0 on the claimed side, 'contradicted' when it
    excludes 0 on the other, 'inconclusive' otherwise, 'inconclusive (1 seed)' with one seed.
    A plain number is a deterministic measurement (e.g. compiled memory): judged by its sign."""
    if claimed_sign not in (1, -1):
        raise ValueError(f"claimed_sign: {claimed_sign}; give +1 (claimed > 0) or -1 (claimed < 0).")
    if isinstance(difference, Estimate):
        if difference.n < 2:
            return ONE_SEED
        lo, hi = difference.interval
        lo, hi = lo * claimed_sign, hi * claimed_sign
        if lo > 0 and hi > 0:
            return SUPPORTED
        if lo < 0 and hi < 0:
            return CONTRADICTED
        return INCONCLUSIVE
    d = float(difference) * claimed_sign
    return SUPPORTED if d > 0 else (CONTRADICTED if d < 0 else INCONCLUSIVE)


def judged(claim: str, ok: Optional[bool], numbers: str, difference: Any, claimed_sign: int,
           what: str, fmt: str = ".3f") -> Check:
    """A :class:`Check` whose verdict is :func:`verdict` of ``difference`` and whose printed
    difference is ``'<what> = <difference>'`` (``what`` says what was subtracted); a difference
    equal in every seed says so, since its zero-width interval is no measure of spread."""
    text = f"{what} = {difference:{fmt}}"
    if isinstance(difference, Estimate) and difference.n > 1 and difference.constant:
        # Every seed gave the same difference (e.g. an accuracy at its floor in every seed): the t
        # interval has zero width, so the verdict rests on the seeds agreeing, not on a spread.
        text += f" (all {difference.n} seeds equal: the interval has zero width)"
    return Check(claim, ok, numbers, verdict(difference, claimed_sign), text,
                 difference.n if isinstance(difference, Estimate) else None)
