"""The argument of a config file (``configs/<name>.py:<arg>``), parsed the same way by every config.

An argument is a comma-separated list of tokens; each token belongs to one group (e.g. the
position encoding, the size variant), each group is given at most once, and every token must be
known::

    parse_config_arg("rope,smoke", "configs/lm_tiny.py",
                     encoding=(POSITION_ENCODINGS, "goat"), size=(("smoke",), None))
    -> {"encoding": "rope", "size": "smoke"}

An unknown token (``smok``) or two tokens of one group (``goat,rope``) raise a one-line
ValueError naming the accepted tokens, so a typo never silently runs another experiment.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

REQUIRED = object()  # the default of a mandatory group


def parse_config_arg(arg: Optional[str], config_file: str,
                     **groups: Tuple[Sequence[str], Any]) -> Dict[str, Any]:
    """Parses ``arg`` into ``{group: token}``.

    Args:
      arg: the text after ``:`` in ``--config file.py:arg`` (None or '' means all defaults).
      config_file: the config's path, for the error message.
      **groups: ``name=(accepted tokens, default)``; a default of :data:`REQUIRED` makes the
        group mandatory. Token sets of different groups must be disjoint.

    Returns:
      ``{name: the given token or the default}`` for every group.

    Raises:
      ValueError: naming the offending token(s) and the accepted tokens of every group.
    """
    owner = {}
    for name, (tokens, _) in groups.items():
        for token in tokens:
            if token in owner:
                raise ValueError(f"{config_file}: token {token!r} is in groups {owner[token]!r} and {name!r}.")
            owner[token] = name
    accepted = "; ".join(f"{name}: {'|'.join(tokens)}" for name, (tokens, _) in groups.items())
    usage = f"accepted tokens, comma-separated, at most one per group: {accepted}"
    chosen: Dict[str, str] = {}
    for token in (t.strip() for t in (arg or "").split(",")):
        if not token:
            continue
        if token not in owner:
            raise ValueError(f"{config_file}: unknown config argument token {token!r}. {usage}.")
        group = owner[token]
        if chosen.get(group) == token:
            raise ValueError(f"{config_file}: config argument token {token!r} is given twice. {usage}.")
        if group in chosen:
            raise ValueError(f"{config_file}: config argument tokens {chosen[group]!r} and {token!r} "
                             f"conflict (both set {group}); give one. {usage}.")
        chosen[group] = token
    out = {}
    for name, (_, default) in groups.items():
        if name not in chosen and default is REQUIRED:
            raise ValueError(f"{config_file}: the config argument needs a {name} token. {usage}.")
        out[name] = chosen.get(name, default)
    return out

