"""How posenc-jax words its one-line errors: the helpers every layer may use.

The library's rule is that bad input ends in one line naming the offending field or value
(``"<field>: got <value>; allowed: ..."``). This module holds the two pieces of wording that
the core (attention, schemes), the trainer and the command-line tools share; it imports
nothing of the package, so anything may import it.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def nearest(name: str, allowed: Sequence[str]) -> str:
  """``"; did you mean 'x'?;"`` for the closest allowed name, else ``";"``."""
  close = difflib.get_close_matches(str(name), [str(a) for a in allowed], n=1, cutoff=0.6)
  return f"; did you mean {close[0]!r}?;" if close else ";"


def first_line(error: BaseException) -> str:
  """The first line of ``error``'s message (without a KeyError's quotes), or its type's name."""
  text = str(error).strip()
  if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a KeyError's repr
    text = text[1:-1]
  return text.splitlines()[0] if text else type(error).__name__
