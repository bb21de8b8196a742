"""The tiny report's notes type no measured number (issue: notes with typed numbers drift from
results.json the first time a run is redone). Measured numbers live in the tables and checks the
harness writes from the results; a note may only name protocol settings, listed below with what
fixes them."""

import json
import os
import re

from goat_jax.reproduce import notes, suites

# Every decimal a note may contain, and why it is not a measurement.
PROTOCOL_DECIMALS = {
    "0.02": "the token-embedding init scale of lm_tiny (configs/lm_tiny.py)",
    "0.993": "sigmoid(5): FoX's forget gate at the gate bias 5 decided in docs/protocols.md",
    "0.05": "the 95% half-width of a correlation over 1,600 windows (docs/protocols.md, DNA)",
    "1.5": "the 64x / 1x ratio below which a row gets the 512x and 1024x columns, applied once to the "
           "report of 2026-12-04 (docs/protocols.md, 'Extrapolation to 1024x and the 64-wide layout')",
}
PROTOCOL_PERCENTS = {
    "95%": "the confidence of every interval (docs/protocols.md, 'Seeds and intervals')",
    "90%": "the training share of MG1655 (configs/dna_tiny.py)",
}


def _all_notes():
    return [(family, n) for family, group in (("lm", notes.LM_NOTES), ("vit", notes.VIT_NOTES),
                                              ("dna", notes.DNA_NOTES)) for n in group]


def test_notes_quote_no_measured_number():
    for family, note in _all_notes():
        for number in re.findall(r"(?<![\w.])\d+\.\d+", note):
            assert number in PROTOCOL_DECIMALS, (family, number, note[:80])
        for percent in re.findall(r"(?<![\w.])\d+(?:\.\d+)?%", note):
            assert percent in PROTOCOL_PERCENTS, (family, percent, "a percentage is a measurement", note[:80])
        assert "+-" not in note.replace("+-0.05", ""), (family, "an interval is a measurement", note[:80])


def test_no_number_of_the_results_appears_in_the_notes():
    """Independently of the pattern above: no value of the committed results.json, formatted as
    the report's tables format it (3 and 2 decimals, whole percents), occurs in a note, so a
    rerun that changes the results cannot leave a stale copy behind in the notes."""
    path = os.path.join(suites.ROOT, "reports", "tiny", "results.json")
    with open(path) as f:
        results = json.load(f)
    found = set()

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, float) and not x.is_integer():
            found.update({f"{x:.3f}", f"{x:.2f}"} - set(PROTOCOL_DECIMALS))
            if 0 < x < 1:
                found.add(f"{100 * x:.0f}%")

    walk(results)
    found -= set(PROTOCOL_PERCENTS)
    assert len(found) > 100  # the walk reached the numbers
    text = " ".join(n for _, n in _all_notes())
    stale = sorted(n for n in found if re.search(rf"(?<![\w.]){re.escape(n)}(?![\d])", text))
    assert not stale, stale


def test_the_tiny_suite_reports_these_notes():
    tiny = suites.SUITES["tiny"]
    assert (tiny.notes, tiny.vit_notes, tiny.dna_notes) == (notes.LM_NOTES, notes.VIT_NOTES, notes.DNA_NOTES)
