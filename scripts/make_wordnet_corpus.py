"""Writes the bundled WordNet 3.0 corpus in ``posenc_jax/data/bundled/wordnet/``.

The source is the WordNet 3.0 database of the Debian package ``wordnet-base``
(``apt-get install wordnet-base``: ``/usr/share/wordnet/data.{noun,verb,adj,adv}``, licence in
``/usr/share/doc/wordnet-base/copyright``). Every synset of the four data files is one record:

    offset       byte offset of the synset in its data file (the WordNet synset id, unique
                 within a part of speech; ``key`` = pos letter + 8 digits, e.g. ``n02084071``)
    pos          the data file: ``n``, ``v``, ``a``, ``r``
    ss_type      ``n``, ``v``, ``a``, ``s`` (adjective satellite), ``r``
    lexname      one of the 45 lexicographer file names (``noun.animal``, ``verb.motion``, ...)
    words        the synset's lemmas, underscores as spaces, adjective markers such as ``(p)``
                 dropped
    gloss        the raw gloss after ``|``: definitions and ``"quoted"`` usage examples
    definition   the gloss without its examples
    examples     the quoted usage examples, quotes removed
    hypernyms    offsets of the ``@`` (hypernym) pointers, same pos
    instance_hypernyms   offsets of the ``@i`` (instance hypernym) pointers, same pos

Split, by a stable hash (first 8 bytes of SHA-256 of ``key``, modulo 1000):

    bucket < 100     held out (about 10%): kept for downstream tasks, never in pre-training text
    bucket < 150     ``validation`` (about 5%)
    otherwise        ``train`` (about 85%)

A synset whose definition is textually identical to a held-out synset's definition (WordNet
repeats a few hundred glosses) is dropped from the pre-training text too, so no held-out
definition can be read during pre-training.

Outputs (gzip with mtime 0 and no file name, so a rerun is byte-identical):

    pretrain_train.txt.gz, pretrain_validation.txt.gz
        one line per synset, in data-file order (noun, verb, adj, adv; by offset, which groups
        synsets by lexicographer file), ``"<words joined by ', '>: <gloss>"``, e.g.
        ``car, auto, automobile, machine, motorcar: a motor vehicle with four wheels; usually
        propelled by an internal combustion engine; "he needs a car to get to work"``
    synsets_heldout.jsonl.gz
        the held-out records, one JSON object per line (fields above), same order
    LICENSE
        the WordNet 3.0 licence from the Debian copyright file
    README.md
        counts, sizes, SHA-256 of each file, and the command below

    spm8k.model, spm8k.vocab
        the SentencePiece vocabulary (8192 pieces) trained on ``pretrain_train.txt.gz`` by
        ``posenc_jax.data.vocab``, the same as
        ``python -m posenc_jax.train_vocab --files=<out>/pretrain_train.txt.gz
        --vocab_size=8192 --output=<out>/spm8k``

Run from the repository root (about 10 s for the corpus, 25 s for the vocabulary)::

    python scripts/make_wordnet_corpus.py

``--wordnet_dir`` and ``--copyright`` read another copy of the database; ``--out`` writes
elsewhere; ``--skip_vocab`` writes the corpus only (Python standard library only; the
vocabulary needs ``sentencepiece``).
"""

import argparse
import gzip
import hashlib
import io
import json
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB_SIZE = 8192
DEFAULT_OUT = REPO / "posenc_jax" / "data" / "bundled" / "wordnet"
POS_FILES = (("n", "noun"), ("v", "verb"), ("a", "adj"), ("r", "adv"))

# lexnames(5WN): lexicographer file number -> name.
LEXNAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance",
    "noun.time", "verb.body", "verb.change", "verb.cognition", "verb.communication",
    "verb.competition", "verb.consumption", "verb.contact", "verb.creation", "verb.emotion",
    "verb.motion", "verb.perception", "verb.possession", "verb.social", "verb.stative",
    "verb.weather", "adj.ppl",
)
HELDOUT_PER_MILLE = 100
VALIDATION_PER_MILLE = 50
_ADJ_MARKER = re.compile(r"\((a|p|ip)\)$")


def synset_key(pos, offset):
  """``'n02084071'``: the part-of-speech letter and the 8-digit offset."""
  return f"{pos}{offset:08d}"


def bucket(key):
  """Stable bucket in [0, 1000) of a synset key (SHA-256, not Python's salted ``hash``)."""
  return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 1000


def split_of(key):
  """``'heldout'``, ``'validation'`` or ``'train'``."""
  b = bucket(key)
  if b < HELDOUT_PER_MILLE:
    return "heldout"
  if b < HELDOUT_PER_MILLE + VALIDATION_PER_MILLE:
    return "validation"
  return "train"


def split_gloss(gloss):
  """(definition, examples): ``;``-separated parts outside quotes; quoted parts are examples.

  ``'a dog; "the dog barked"; "a good dog"'`` -> ``('a dog', ['the dog barked', 'a good dog'])``.
  An example's trailing attribution (``"..." - Shakespeare``) stays with the example. The
  source has about 20 glosses with an unmatched quote; they are kept as they are.
  """
  parts, current, quoted = [], [], False
  for ch in gloss:
    if ch == '"':
      quoted = not quoted
    if ch == ";" and not quoted:
      parts.append("".join(current).strip())
      current = []
    else:
      current.append(ch)
  parts.append("".join(current).strip())
  definition, examples = [], []
  for part in filter(None, parts):
    if part.startswith('"'):
      examples.append(part.replace('"', "").strip())
    else:
      definition.append(part)
  return "; ".join(definition), examples


def parse_line(pos, line):
  """One record (dict, fields in the module docstring) from a line of a WordNet data file."""
  head, _, gloss = line.partition(" | ")
  fields = head.split()
  offset, lex_filenum, ss_type = int(fields[0]), int(fields[1]), fields[2]
  w_cnt = int(fields[3], 16)
  words = [_ADJ_MARKER.sub("", w).replace("_", " ") for w in fields[4:4 + 2 * w_cnt:2]]
  i = 4 + 2 * w_cnt
  p_cnt = int(fields[i])
  hypernyms, instance_hypernyms = [], []
  for j in range(p_cnt):
    symbol, target, target_pos = fields[i + 1 + 4 * j:i + 4 + 4 * j]
    if symbol == "@":
      hypernyms.append(int(target))
    elif symbol == "@i":
      instance_hypernyms.append(int(target))
    if symbol in ("@", "@i") and target_pos != pos:
      raise ValueError(f"{pos}{offset}: hypernym of another part of speech")
  gloss = gloss.strip()
  definition, examples = split_gloss(gloss)
  return dict(key=synset_key(pos, offset), offset=offset, pos=pos, ss_type=ss_type,
              lexname=LEXNAMES[lex_filenum], words=words, gloss=gloss, definition=definition,
              examples=examples, hypernyms=hypernyms, instance_hypernyms=instance_hypernyms)


def read_wordnet(wordnet_dir):
  """Every synset record in data-file order (noun, verb, adj, adv)."""
  records = []
  for pos, name in POS_FILES:
    with open(pathlib.Path(wordnet_dir) / f"data.{name}", encoding="utf-8") as f:
      for line in f:
        if not line.startswith("  "):    # the licence header's lines start with two spaces
          records.append(parse_line(pos, line))
  return records


def pretrain_line(record):
  """``'car, auto, ...: a motor vehicle with four wheels; ...; "he needs a car ..."'``."""
  return f"{', '.join(record['words'])}: {record['gloss']}"


def write_gzip(path, lines):
  """Writes text lines (``\\n``-terminated) gzip-compressed, byte-reproducibly (mtime 0)."""
  raw = io.BytesIO()
  with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
    for line in lines:
      f.write(line.encode("utf-8") + b"\n")
  pathlib.Path(path).write_bytes(raw.getvalue())


def licence_text(copyright_path):
  """The ``License: WordNet3.0`` paragraph of a Debian copyright file, unindented."""
  lines = pathlib.Path(copyright_path).read_text(encoding="utf-8").splitlines()
  start = lines.index("License: WordNet3.0") + 1
  body = []
  for line in lines[start:]:
    if not line.startswith(" "):
      break
    body.append("" if line.strip() == "." else line[1:])
  header = ("WordNet 3.0, Princeton University (https://wordnet.princeton.edu/).\n"
            "Glosses and usage examples in this folder are extracted from the WordNet 3.0\n"
            "database files of the Debian package wordnet-base; the licence below is\n"
            "copied from its /usr/share/doc/wordnet-base/copyright.\n\n")
  return header + "\n".join(body).rstrip() + "\n"


def build(records):
  """(train lines, validation lines, held-out records, counts)."""
  heldout = [r for r in records if split_of(r["key"]) == "heldout"]
  heldout_definitions = {r["definition"] for r in heldout}
  train, validation, dropped = [], [], 0
  for r in records:
    split = split_of(r["key"])
    if split == "heldout":
      continue
    if r["definition"] in heldout_definitions:
      dropped += 1
      continue
    (train if split == "train" else validation).append(pretrain_line(r))
  counts = dict(synsets=len(records), train=len(train), validation=len(validation),
                heldout=len(heldout), dropped_duplicate_definition=dropped)
  for name, lines in (("train", train), ("validation", validation)):
    counts[f"{name}_words"] = sum(len(line.split()) for line in lines)
    counts[f"{name}_bytes"] = sum(len(line.encode()) + 1 for line in lines)
  return train, validation, heldout, counts


def readme(counts, files, out):
  """The folder's README.md: counts, split rule, vocabulary ids, command, file hashes."""
  rows = "\n".join(f"| `{name}` | {(out / name).stat().st_size:,} | `{digest}` |"
                   for name, digest in files)
  held, valid = HELDOUT_PER_MILLE, HELDOUT_PER_MILLE + VALIDATION_PER_MILLE
  text_rows = "\n".join(
      f"| `pretrain_{split}.txt.gz` | {counts[split]:,} | {counts[split + '_words']:,} | "
      f"{counts[split + '_bytes']:,} |" for split in ("train", "validation"))
  return f"""# WordNet 3.0 glosses: the bundled pre-training corpus

Real English text: the lemmas, glosses and usage examples of every WordNet 3.0 synset
({counts['synsets']:,} synsets; Princeton University, licence in `LICENSE`), extracted from the
Debian package `wordnet-base` by `scripts/make_wordnet_corpus.py`, whose docstring documents
the record fields and the split.

| file | lines | words | text bytes |
|---|---|---|---|
{text_rows}
| `synsets_heldout.jsonl.gz` (never in pre-training text) | {counts['heldout']:,} | | |

The {counts['dropped_duplicate_definition']:,} synsets whose definition is identical to a
held-out synset's are in no pre-training file. A pre-training line is one synset,
`"<lemmas joined by ', '>: <gloss>"`:

    car, auto, automobile, machine, motorcar: a motor vehicle with four wheels; usually
    propelled by an internal combustion engine; "he needs a car to get to work"

(one line in the file). The split is a stable hash of the synset key (pos letter and
8-digit offset, `n02958343`): the first 8 bytes of its SHA-256, modulo 1000: below {held}
held out, below {valid} validation, the rest train. Held-out records (JSON lines) carry `key`,
`offset`, `pos`, `ss_type`, `lexname` (one of the 45 lexicographer file names), `words`,
`gloss`, `definition`, `examples`, `hypernyms` and `instance_hypernyms` (offsets, same pos),
for downstream tasks (supersenses, hypernymy).

`spm8k.model` / `spm8k.vocab`: SentencePiece unigram model, {VOCAB_SIZE} pieces, trained on
`pretrain_train.txt.gz` by `posenc_jax.data.vocab`; ids 0 `<pad>`, 1 `</s>`, 2 `<unk>`,
3 `[CLS]`, 4 `[SEP]`, 5 `[MASK]`. The corpus is ASCII, so other characters map to `<unk>`.

Regenerate everything, byte-identical (needs `apt-get install wordnet-base` and the `data`
extra; about 35 s):

    python scripts/make_wordnet_corpus.py

The vocabulary step is the same as

    python -m posenc_jax.train_vocab --vocab_size={VOCAB_SIZE} \\
        --files=posenc_jax/data/bundled/wordnet/pretrain_train.txt.gz \\
        --output=posenc_jax/data/bundled/wordnet/spm8k

| file | bytes | SHA-256 |
|---|---|---|
{rows}
"""


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--wordnet_dir", default="/usr/share/wordnet")
  parser.add_argument("--copyright", default="/usr/share/doc/wordnet-base/copyright")
  parser.add_argument("--out", default=str(DEFAULT_OUT))
  parser.add_argument("--skip_vocab", action="store_true", help="do not train spm8k")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)

  train, validation, heldout, counts = build(read_wordnet(args.wordnet_dir))
  write_gzip(out / "pretrain_train.txt.gz", train)
  write_gzip(out / "pretrain_validation.txt.gz", validation)
  write_gzip(out / "synsets_heldout.jsonl.gz",
             (json.dumps(r, ensure_ascii=False, sort_keys=True) for r in heldout))
  (out / "LICENSE").write_text(licence_text(args.copyright), encoding="utf-8")
  if not args.skip_vocab:
    sys.path.insert(0, str(REPO))
    from posenc_jax.data import vocab  # pylint: disable=g-import-not-at-top
    vocab.train(train, out / "spm8k", VOCAB_SIZE)

  names = ["pretrain_train.txt.gz", "pretrain_validation.txt.gz", "synsets_heldout.jsonl.gz",
           "LICENSE"] + sorted(p.name for p in out.glob("spm8k.*"))
  files = [(n, hashlib.sha256((out / n).read_bytes()).hexdigest()) for n in names]
  (out / "README.md").write_text(readme(counts, files, out), encoding="utf-8")
  print(json.dumps(counts))


if __name__ == "__main__":
  main()
