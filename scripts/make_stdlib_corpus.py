"""Writes the bundled long-document corpus in ``posenc_jax/data/bundled/stdlib/``.

The source is a CPython 3.13.0 installation's standard library (``sysconfig``'s ``stdlib``
path) and its ``LICENSE.txt`` (PSF License Agreement). A document is one ``.py`` file of at
least :data:`MIN_BYTES` bytes, outside the folders of :data:`SKIP` (tests, the IDLE and
turtle demos, codec tables, generated data, vendored packages). Its split is
:func:`posenc_jax.data.stdlib_corpus.split_of` (a stable hash of the path).

Outputs (xz of fixed settings, so a rerun from the same Python is byte-identical):

    stdlib_py313.jsonl.xz   one ``{"path", "split", "text"}`` per line, in path order
    LICENSE                 the PSF licence of the Python it was read from
    README.md               counts, sizes, the content SHA-256 and this command

Run from the repository root with the Python whose library it reads (about 10 s)::

    python3.13 scripts/make_stdlib_corpus.py

then pin the printed SHA-256 as ``CONTENT_SHA256`` in ``posenc_jax/data/stdlib_corpus.py``.
``--stdlib`` reads another copy; ``--out`` writes elsewhere.
"""

import argparse
import hashlib
import json
import lzma
import os
import pathlib
import platform
import statistics
import sys
import sysconfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from posenc_jax.data import stdlib_corpus  # noqa: E402 - the split lives there

MIN_BYTES = 4096
SKIP = ("idlelib", "encodings", "pydoc_data", "turtledemo", "ensurepip", "unittest", "venv",
        "lib2to3", "site-packages", "__pycache__")
PYTHON = "3.13.0"


def source_files(stdlib: pathlib.Path) -> list[str]:
  """The documents' paths relative to ``stdlib``, sorted."""
  paths = []
  for folder, subfolders, files in os.walk(stdlib):
    subfolders[:] = sorted(d for d in subfolders if d not in SKIP and not d.startswith(
        ("test", "config-")))
    for name in files:
      path = pathlib.Path(folder) / name
      if name.endswith(".py") and path.stat().st_size >= MIN_BYTES:
        paths.append(path.relative_to(stdlib).as_posix())
  return sorted(paths)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
  parser.add_argument("--out", default=str(stdlib_corpus.CORPUS_DIR))
  args = parser.parse_args()
  if platform.python_version() != PYTHON and args.stdlib == sysconfig.get_paths()["stdlib"]:
    sys.exit(f"make_stdlib_corpus: run it with Python {PYTHON} (this is "
             f"{platform.python_version()}), or pass --stdlib")
  stdlib, out = pathlib.Path(args.stdlib), pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  records = []
  for path in source_files(stdlib):
    text = (stdlib / path).read_text(encoding="utf-8")
    records.append({"path": path, "split": stdlib_corpus.split_of(path), "text": text})
  content = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
  (out / stdlib_corpus.CORPUS_FILE.name).write_bytes(
      lzma.compress(content, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                    preset=9 | lzma.PRESET_EXTREME))
  (out / "LICENSE").write_text((stdlib / "LICENSE.txt").read_text(encoding="utf-8"))
  digest = hashlib.sha256(content).hexdigest()
  rows = []
  for split in stdlib_corpus.SPLITS:
    sizes = [len(r["text"].encode()) for r in records if r["split"] == split]
    rows.append(f"| {split} | {len(sizes):,} | {sum(sizes):,} | {statistics.median(sizes):,.0f} "
                f"| {min(sizes):,} | {max(sizes):,} |")
  (out / "README.md").write_text(f"""# The Python {PYTHON} standard library, the bundled long documents

Every `.py` file of at least {MIN_BYTES:,} bytes in CPython {PYTHON}'s `Lib/`, outside
`test*` and {', '.join(f'`{s}`' for s in SKIP)}: source code with its docstrings and comments,
one document per file. Copyright Python Software Foundation and the CPython contributors,
under the PSF License Agreement (`LICENSE`, the `LICENSE.txt` of the installation it was read
from). Read by `posenc_jax.data.stdlib_corpus`; the causal-LM task is `python_stdlib_lm`
(one token per UTF-8 byte).

| split | files | bytes | median bytes | shortest | longest |
|---|---|---|---|---|---|
{chr(10).join(rows)}

The split is a stable hash of the path (first 8 bytes of its SHA-256, modulo 1000: below
{stdlib_corpus.VALIDATION_BUCKETS} `validation`). `stdlib_py313.jsonl.xz` holds one
`{{"path", "split", "text"}}` per line, in path order; the SHA-256 of its decompressed
content is

    {digest}

Rebuild it, byte-identical, with Python {PYTHON}:

    python3.13 scripts/make_stdlib_corpus.py
""")
  print(f"{len(records)} files, {len(content):,} bytes of JSON lines; content SHA-256 {digest}")


if __name__ == "__main__":
  main()
