"""JSON that another process or a person wrote (a workdir's ``config.json`` and records, a
compare ROOT's ``cell.json`` and ``cost.json``, evaluation files, the route table), parsed
with bounds: :func:`loads`. It imports nothing of the package, so anything may import it.

Python's parser recurses once per nesting level, so a document nested 100,000 levels deep
raises ``RecursionError`` there (or in any code that walks it); one larger than memory
allows fails late. :func:`loads` turns both into a ``ValueError`` its caller words as one
line naming the file, and so does a document nested deeper than any the tools write.
"""

from __future__ import annotations

import json
from typing import Any

MAX_BYTES = 64 * 2**20  # far above any document the tools write (a results.json: ~100 KiB)
MAX_DEPTH = 32  # the tools nest at most about 8 levels (results.json's tables)


def depth(data: Any) -> int:
  """How many lists and objects ``data`` nests (a number or string: 0), without recursing."""
  deepest, stack = 0, [(data, 1)]
  while stack:
    value, level = stack.pop()
    if isinstance(value, dict):
      value = list(value.values())
    elif not isinstance(value, list):
      continue
    deepest = max(deepest, level)
    stack.extend((item, level + 1) for item in value)
  return deepest


def loads(text: str | bytes) -> Any:
  """``json.loads(text)``, refusing with ``ValueError`` (its message says which bound) text
  over :data:`MAX_BYTES` or nested deeper than :data:`MAX_DEPTH`, and any malformed JSON."""
  if len(text) > MAX_BYTES:
    raise ValueError(f"{len(text)} bytes; at most {MAX_BYTES} in a document")
  try:
    data = json.loads(text)
  except RecursionError:
    raise ValueError(f"nested too deep; at most {MAX_DEPTH} levels") from None
  levels = depth(data)
  if levels > MAX_DEPTH:
    raise ValueError(f"nested {levels} levels deep; at most {MAX_DEPTH}")
  return data
