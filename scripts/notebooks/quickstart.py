"""colab/quickstart.ipynb: pick a scheme, pre-train a small BERT, probe it."""

from notebooks.cells import INSTALL, SHOW

QUICKSTART = [
    ("markdown", '''\
# posenc-jax quickstart: pick a scheme, pre-train a small BERT, probe it

This notebook walks through the library end to end on a CPU in a few minutes
(a GPU or TPU runtime is used automatically when present):

1. **install** the package (skipped when it is already importable);
2. **pick a positional scheme** by name, e.g. DIET-ABS with layer-wise sharing
   (Chen et al. 2021, *A Simple and Effective Positional Encoding for Transformers*);
3. **build a BERT** encoder with it and count its parameters;
4. **pre-train** it for a few hundred masked-LM steps on the bundled WordNet corpus
   with the same trainer as `train.py`;
5. **probe** the trained model as Wang et al. (2021, *On Position Embeddings in BERT*)
   do: identical-word probing, their property indicators (Table 2), and heatmaps of
   the attention and of the content-free positional term.'''),
    ("code", INSTALL),
    ("markdown", '''\
## Settings

`SMALL` is set by the notebook test (`POSENC_NOTEBOOK_SMALL=1`): 30 training steps
instead of 300 and fewer probing words, so the whole notebook runs in about a minute.
JAX picks the accelerator on its own: the device list below says what this runtime has.'''),
    ("code", '''\
import os
import tempfile

import jax

SMALL = os.environ.get("POSENC_NOTEBOOK_SMALL") == "1"  # the test's quick settings
STEPS = 30 if SMALL else 300          # pre-training steps (configs/pretrain.py's demo runs 500)
PROBE_WORDS = 50 if SMALL else 300    # Wang et al. average over 300 random words
# Checkpoints, metrics.jsonl and TensorBoard events go here (a fresh folder: train() resumes
# from any checkpoint it finds in its workdir).
WORKDIR = os.environ.get("POSENC_NOTEBOOK_WORKDIR") or tempfile.mkdtemp(prefix="posenc_quickstart_")

print("devices:", jax.devices())
print("SMALL =", SMALL, "| steps:", STEPS, "| workdir:", WORKDIR)
'''),
    ("code", SHOW),
    ("markdown", '''\
## 1. Pick a scheme

A model is a **size** preset followed by **scheme** and modifier presets, named after the
papers' rows (`posenc_jax/presets.py`). Change `SCHEME` to any of the names printed below,
for instance `bert` (BERT's learned absolute position embedding, *input APE*), `t5`
(Raffel et al.'s bucketed relative bias), `tupe_a` (Ke et al.'s untied positions),
`alibi` or `rope`. The default, `diet_abs_share`, is DIET-ABS: per head a learned
factored term `P_Q P_K^T` of rank `d_p = 128` added to the attention logits, one pair of
tables shared by all layers.'''),
    ("code", '''\
from posenc_jax import presets

SIZE = "bert_tiny"          # 2 layers, d_model 128, 2 heads, 8k vocabulary
SCHEME = "diet_abs_share"   # change me

print("sizes:  ", ", ".join(presets.SIZES))
print("schemes:", ", ".join(presets.SCHEME_PRESETS))
'''),
    ("markdown", '''\
The training config is `configs/pretrain.py`'s, as `train.py --config=configs/pretrain.py:<size>,<scheme>`
reads it: masked-LM pre-training (no NSP, full-sentence packing, 15% masking 80/10/10) on the
bundled WordNet glosses, batch 32 of 64 tokens, AdamW. Only the number of steps (and the
logging, evaluation and checkpoint intervals that follow from it) are changed here.'''),
    ("code", '''\
from posenc_jax import analysis

# configs/pretrain.py ships inside the package: found from any folder.
config = analysis.read_config(f"configs/pretrain.py:{SIZE},{SCHEME}")
config.total_steps = STEPS
config.optimizer.warmup_steps = STEPS // 10
config.log_every = max(1, STEPS // 12)
config.eval_every = STEPS // 3
config.checkpoint_every = STEPS

print("model:")
print(config.model)
print({k: config[k] for k in ("task", "objective", "seq_len", "batch_size", "total_steps")})
print("optimizer:", dict(config.optimizer))
'''),
    ("markdown", '''\
## 2. Build the BERT

`build_model` turns the config into a Flax module (here `BertForMaskedLM`); the parameter
count comes from its real initialisation under `jax.eval_shape`, so nothing is allocated.
The scheme's own parameters sit under `bert/position`.'''),
    ("code", '''\
from posenc_jax import params as param_counts
from posenc_jax.models.build import abstract_params, build_model

model = build_model(config.model, config.head)
shapes = abstract_params(model)
print(f"{type(model).__name__}: {param_counts.count(shapes):,} parameters")
for module, n in param_counts.breakdown(shapes).items():
  print(f"  {module:<22}{n:>12,}")
'''),
    ("markdown", '''\
## 3. Pre-train

`posenc_jax.training.loop.train` is what `train.py` runs: it builds the input pipeline
(seqio task `wordnet_glosses`), compiles one training step, prints a progress line
every few steps, evaluates on the validation split and saves a checkpoint at the end.
It returns the final state and the logged history.'''),
    ("code", '''\
from posenc_jax.training.loop import train

result = train(config, WORKDIR)
history = result["history"]
'''),
    ("code", '''\
from matplotlib.figure import Figure

fig = Figure(figsize=(6, 3.5), layout="constrained")
ax = fig.subplots()
ax.plot([h["step"] for h in history], [h["loss"] for h in history], "o-", label="train loss")
evals = [h for h in history if "eval_loss" in h]
ax.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "s--", label="eval loss")
ax.set_xlabel("step")
ax.set_ylabel("masked-LM cross-entropy")
ax.set_title(f"{SIZE},{SCHEME}: masked-LM pre-training")
ax.legend()
show(fig)
'''),
    ("markdown", '''\
## 4. Probe the trained model

`analysis.from_checkpoint` reads only the parameters from the newest checkpoint in the
workdir and returns the encoder (the `bert` subtree of the MLM model), its variables and the
vocabulary's probing tokens.

**Identical-word probing** (Wang et al. 2021, Sec. 4.2) feeds sequences
`[CLS] w w ... w [SEP]` made of one random word `w`: with the content fixed, the first
layer's attention, averaged over words (and heads), shows what the positional machinery
alone does. We probe at the training length (64): positions beyond it were never trained.
An untrained copy of the same model is probed too, for comparison.'''),
    ("code", '''\
LENGTH = config.seq_len

trained = analysis.from_checkpoint(WORKDIR, config)
fresh = analysis.from_config(config, name=f"{SIZE},{SCHEME}")
print(trained.source)

probes = {}
for label, loaded in (("untrained", fresh), (f"trained {trained.step} steps", trained)):
  probes[label] = analysis.identical_word_probing(loaded.encoder, loaded.variables, loaded.tokens,
                                                  length=LENGTH, num_words=PROBE_WORDS)

probe = probes[f"trained {trained.step} steps"]
title = f"Identical-word probing, {SIZE},{SCHEME} after {trained.step} steps"
show(analysis.plots.plot_probing(probe, per_head=True, title=title))
'''),
    ("markdown", '''\
Each panel is the first layer's attention probability from query position `i` (rows) to
key position `j` (columns). A bright diagonal band means the layer attends to nearby
positions; bright first/last columns are attention to `[CLS]`/`[SEP]`; a flat picture is a
bag of words. The special tokens often take the whole colour scale, so the same average is
drawn again without their rows and columns (as Wang et al.'s "w/o [CLS]" indicators do).
After a few hundred steps on a small corpus the structure is faint; the indicators below
quantify it.'''),
    ("code", '''\
inner = analysis.drop_positions(probe.attention, probe.special_positions)
show(analysis.plots.plot_probing(
    inner, title=f"Without [CLS]/[SEP]: positions 1..{LENGTH - 2}"))
'''),
    ("markdown", '''\
### Property indicators (Wang et al. Table 2)

* **monotonicity**: ordered pair ratio of the attention going away from the diagonal
  (0: strictly decreasing with distance, 0.5: no order);
* **translation invariance**: variance within each offset `j - i`, relative to the total
  (0: the matrix depends on the offset only), with and without the `[CLS]`/`[SEP]` rows;
* **symmetry**: mean `|A[i,j] - A[j,i]|`;
* **direction balance**: attention to preceding over succeeding keys within 20 positions.

`relative_spread_without_cls` (std / mean) near 0 means an almost uniform matrix, whose
other indicators then only measure rounding. The paper's rows (BERT-base, fully trained)
follow ours for reference.'''),
    ("code", '''\
rows = []
for label, result_probe in probes.items():
  values = analysis.indicators(result_probe.attention, result_probe.special_positions)
  rows.append({"label": f"{SCHEME}, {label}", "indicators": values,
               "paper_row": analysis.paper_row(trained.config.scheme)})
  spread = values["relative_spread_without_cls"]
  print(f"{label}: relative spread without [CLS]/[SEP] = {spread:.4f}")
print()
print(analysis.format_table2(rows))
'''),
    ("markdown", '''\
### The positional term per head

The content-free part of each head's logits (DIET Fig. 2/8, TUPE Fig. 5): for DIET-ABS
`P_Q^h P_K^{hT}`; for an input APE `c (P W_Q^h)(P W_K^h)^T` with the first layer's kernels;
for relative biases (T5, DIET-REL, ALiBi) the bias itself. Schemes whose positional effect
depends on the query (Shaw, RoPE) have none, and the figure is all zero.'''),
    ("code", '''\
positional = analysis.positional_attention(trained.encoder, trained.variables, length=LENGTH)
print("kind:", positional.kind, "| parts:", positional.parts)
show(analysis.plots.plot_positional_attention(
    positional, title=f"Positional attention, {SIZE},{SCHEME} after {trained.step} steps"))
'''),
    ("markdown", '''\
### Position vectors (Wang et al. Fig. 1)

Dot products and cosine similarities between the model's position vectors: the input table
`p_i` for an APE, DIET-ABS's `P_Q` (heads concatenated), or the relative key table of Shaw's
scheme. Schemes without position vectors (ALiBi, RoPE, biases) print a line instead.'''),
    ("code", '''\
vectors = analysis.position_vectors(trained.encoder, trained.variables, length=LENGTH)
if vectors is None:
  print(f"{SCHEME}: no position vectors to compare")
else:
  show(analysis.plots.plot_position_similarity(vectors, title=f"{SIZE},{SCHEME}"))
'''),
    ("markdown", '''\
## Next

* `schemes_tour.ipynb`: every scheme's positional term side by side, DIET's rank argument,
  and the parameter table.
* The same analysis from the command line:
  `python -m posenc_jax.analysis {probe,indicators,rank,plots,params} --help`.
* A longer run: `python train.py --config=configs/pretrain.py:bert_tiny,diet_abs_share --workdir=/tmp/run`
  (800 steps, about 3 minutes on 2 CPU cores; `--config.total_steps=...` to change).'''),
]
