"""Non-inferiority checks between two rows of one family trained the same way but for one
setting (:class:`~goat_jax.reproduce.suites.LayoutCheck`; docs/protocols.md, "Extrapolation to
1024x and the 64-wide layout"): the language, DNA and vision families read their rows' values by
length and hand them to :func:`judge`, one code path for the three.

A check's verdict is that of every headline check (paired over seeds, 95% t interval;
:func:`goat_jax.reproduce.stats.judged`) on ``worse - margin``, where ``worse`` is how much worse
the candidate is than the reference: ``c / r - 1`` (relative margin, lower is better), ``1 - c / r``
(relative, higher is better), ``c - r`` or ``r - c`` (a margin in points of a fraction).
Supported when its interval lies below 0, contradicted when above, inconclusive otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from goat_jax.reproduce import stats
from goat_jax.reproduce.suites import LAYOUT_METRICS, Job, LayoutCheck, Suite


def of_family(checks: Sequence[LayoutCheck], family: str) -> list[LayoutCheck]:
    """The checks of ``checks`` that judge rows of ``family`` ('lm', 'vit' or 'dna')."""
    return [lc for lc in checks if lc.family == family]


def feeds(job: Job, suite: Suite) -> bool:
    """Whether a layout check of ``suite`` reads ``job``'s result: a row of the check's family
    named as its candidate or reference (the family's ``feeds_checks`` adds which dataset)."""
    return any(job.label in (lc.candidate, lc.reference) for lc in of_family(suite.layout_checks, job.family))


def claim(lc: LayoutCheck) -> str:
    """The check's claim, e.g. "lane_aligned (head dim 32, bf16): perplexity at 1x no worse than
    goat+bf16's by more than 1%"."""
    name = LAYOUT_METRICS[lc.metric][0]
    bound = (f"{100 * lc.margin:g}%" if lc.margin_in == "relative"
             else f"{100 * lc.margin:g} point{'' if 100 * lc.margin == 1 else 's'}")
    return f"{lc.title}: {name} at {lc.multiplier}x no worse than {lc.reference}'s by more than {bound}"


def _value(lc: LayoutCheck, v: Any) -> str:
    fmt = LAYOUT_METRICS[lc.metric][2]
    return f"{100 * v:.2f}%" if fmt == "%" else f"{v:{fmt}}"


def _change(lc: LayoutCheck, c: Any, r: Any) -> str:
    """The candidate's signed change against the reference, as the margin reads it."""
    return f"{100 * (c / r - 1):+.2f}%" if lc.margin_in == "relative" else f"{100 * (c - r):+.2f} points"


def judge(lc: LayoutCheck, cand: Optional[dict[int, Any]], ref: Optional[dict[int, Any]], *,
          shown: Optional[tuple[dict[int, Any], dict[int, Any]]] = None, shown_where: str = "",
          unit: str = "tokens") -> stats.Check:
    """Check ``lc`` on the candidate's and the reference's ``{length: value}`` of ``lc.metric``
    (lengths in tokens, bases or pixels; the shortest is the training length; values are
    :class:`~goat_jax.reproduce.stats.Estimate` s over seeds or plain numbers): judged at
    ``lc.multiplier`` x the training length; the change at ``lc.shown_multiplier`` x it read
    from ``shown`` (the same pair when None; ``shown_where`` names it, e.g. ' canvas') goes into
    the numbers, unjudged. A row without values is "not measured", and so is the judged length
    when either row lacks it (naming it in ``unit``)."""
    name = claim(lc)
    if not cand or not ref:
        return stats.Check(name, None, "not measured")
    n = lc.multiplier * min(cand)
    if n not in cand or n not in ref:
        return stats.Check(name, None, f"not measured ({n} {unit} not evaluated)")
    c, r = cand[n], ref[n]
    higher_is_better = LAYOUT_METRICS[lc.metric][1]
    if lc.margin_in == "relative":
        worse = 1 - c / r if higher_is_better else c / r - 1
        what = (f"1 - {lc.candidate} / {lc.reference}" if higher_is_better else f"{lc.candidate} / {lc.reference} - 1")
        what += f" - {100 * lc.margin:g}% (points)"
    else:
        worse = r - c if higher_is_better else c - r
        what = (f"{lc.reference} - {lc.candidate}" if higher_is_better else f"{lc.candidate} - {lc.reference}")
        what += f" - {100 * lc.margin:g} (points)"
    sc, sr = shown if shown is not None else (cand, ref)
    s = lc.shown_multiplier * min(sc) if sc else None
    extra = (f"; at {lc.shown_multiplier}x{shown_where} {_change(lc, sc[s], sr[s])} (not judged)"
             if sc and sr and s in sc and s in sr else "")
    return stats.judged(name, worse <= lc.margin, f"{lc.candidate} {_value(lc, c)}, {lc.reference} "
                        f"{_value(lc, r)} at {n} ({_change(lc, c, r)}){extra}", 100 * (worse - lc.margin), -1,
                        what, ".2f")
