"""The device check's markdown report, rewritten after every section (a timeout keeps what ran)."""

from __future__ import annotations

import os
from typing import List, Optional


class Report:
    """Markdown sections, rewritten to ``path`` after each one (a timeout keeps what ran)."""

    def __init__(self, path: Optional[str], header: List[str]):
        self.path, self.lines = path, list(header)

    def section(self, title: str, lines: List[str]) -> None:
        """Appends ``## title`` and ``lines``, prints them and rewrites the file."""
        self.lines += [f"## {title}", ""] + lines + [""]
        print("\n".join([f"## {title}"] + lines), flush=True)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def table(head: List[str], rows: List[List]) -> List[str]:
    """A markdown table."""
    fmt = lambda x: "-" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows])


def error_text(err: BaseException, limit: int = 200) -> str:
    """``**ERROR** Type: first line`` of an exception, for a table cell or a section."""
    return f"**ERROR** {type(err).__name__}: {str(err).splitlines()[0][:limit] if str(err) else ''}"
