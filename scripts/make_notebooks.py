"""Writes colab/*.ipynb from the cell sources below (outputs cleared, deterministic ids).

  python scripts/make_notebooks.py           # (re)write colab/*.ipynb
  python scripts/make_notebooks.py --check   # exit 1 if a committed notebook differs

The notebooks are reviewed here, as Python strings; the .ipynb files are this
script's output (tests/test_notebooks.py checks they are up to date and runs
them headless with their small settings).
"""

from __future__ import annotations

import pathlib
import sys

import nbformat

COLAB = pathlib.Path(__file__).resolve().parent.parent / "colab"

# --- shared cells ------------------------------------------------------------------------------

INSTALL = '''\
# Install: pip-installs posenc-jax with its `train` and `analysis` extras from SOURCE (and, on a
# GPU or TPU runtime, JAX's plugin). Skipped when posenc_jax is already importable (a clone with
# `pip install -e ".[test]"`, a second run of this cell, or the tests).
import importlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

# Where posenc-jax comes from: its git repository ("git+https://<host>/<owner>/posenc-jax.git",
# "@<tag or commit>" appended to pin it) or a folder holding a clone. Set POSENC_JAX_SOURCE or
# edit this line (colab/README.md).
SOURCE = os.environ.get("POSENC_JAX_SOURCE", "git+https://github.com/<owner>/posenc-jax.git")

if importlib.util.find_spec("posenc_jax") is None:
  if "<owner>" in SOURCE:
    raise SystemExit("set SOURCE (or POSENC_JAX_SOURCE) to posenc-jax's git URL or a clone")
  extras = "train,analysis"
  if shutil.which("nvidia-smi"):
    extras += ",cuda12"
  elif pathlib.Path("/dev/accel0").exists() or "TPU_ACCELERATOR_TYPE" in os.environ:
    extras += ",tpu"
  folder = pathlib.Path(SOURCE).expanduser()
  requirement = (f"{folder.resolve()}[{extras}]" if folder.is_dir()
                 else f"posenc-jax[{extras}] @ {SOURCE}")
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], check=True)
  importlib.invalidate_caches()  # the new package is importable without a restart

import posenc_jax

print("posenc_jax from", pathlib.Path(posenc_jax.__file__).parent)
'''

SHOW = '''\
import io

from IPython.display import Image, display


def show(fig):
  """Displays a matplotlib Figure inline as a PNG.

  The analysis plots draw off-screen on their own Figure (no pyplot state), so
  the same code runs in Colab, Jupyter and headless.
  """
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png")
  display(Image(buffer.getvalue()))
'''

# --- quickstart --------------------------------------------------------------------------------

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
  (500 steps; `--config.total_steps=...` to change).'''),
]

# --- schemes tour ------------------------------------------------------------------------------

TOUR = [
    ("markdown", '''\
# A tour of the positional schemes

Every scheme this library implements, seen through the same lens:

1. the **content-free positional term** of each scheme on one page
   (DIET Fig. 2/8, TUPE Fig. 5), and identical-word probing of each;
2. the **rank** argument of DIET (Chen et al. 2021, Theorem 1): with an input
   absolute position embedding (APE) each head's attention logits have rank at most
   the head width `d_h`, while DIET-ABS adds a term of its own rank `d_p`;
3. the **parameter table** (DIET Table 6) computed from the models' real initialisation.

All models here are freshly initialised `bert_tiny` encoders (2 layers, `d_model` 128,
2 heads of width 64): nothing is trained, so the pictures show each scheme's *form*
(fixed patterns, Toeplitz structure, low rank), not what training makes of it. It runs
in about a minute on a CPU.'''),
    ("code", INSTALL),
    ("code", '''\
import os

import jax
import numpy as np

SMALL = os.environ.get("POSENC_NOTEBOOK_SMALL") == "1"  # the test's quick settings
SIZE = "bert_tiny"
LENGTH = 64                           # positions shown
PROBE_WORDS = 10 if SMALL else 100    # identical-word probing: random words averaged over

print("devices:", jax.devices())
print("SMALL =", SMALL)
'''),
    ("code", SHOW),
    ("markdown", '''\
## 1. Every scheme's positional term

The registry (`posenc_jax.schemes.registry.SCHEMES`) maps each name to its module. For each
one we build a `bert_tiny` encoder with that scheme and compute the content-free part of the
first layer's logits with `analysis.positional_attention`:

| scheme | paper | the term |
|---|---|---|
| `none` | BERT without PE | none |
| `learned_ape` | Devlin et al. (BERT) | input table `p_i`: `c (P W_Q)(P W_K)^T` |
| `sinusoidal_ape` | Vaswani et al. | fixed sinusoids at the input, same form |
| `shaw` | Shaw et al. | query-dependent `q_i . a^K_{j-i}`: no content-free term |
| `sinusoidal_rpe` | Wang et al. | Shaw's form with a sinusoidal table, on keys and values (eq. 5): none |
| `t5` | Raffel et al. | a learned bias per log-spaced offset bucket |
| `diet_rel` | Chen et al. (DIET-REL) | a learned bias per clipped offset |
| `diet_abs` | Chen et al. (DIET-ABS) | factored `P_Q^h P_K^{hT}` of rank `d_p` |
| `tupe_a`, `tupe_r` | Ke et al. (TUPE) | untied `(p_i U_Q)(p_j U_K)^T` with the `[CLS]` reset (+ T5 bias for `-r`) |
| `bert_ad` | Ke et al. (BERT-A^d ablation) | q/k shifted by projected positions: its position-position term |
| `alibi` | Press et al. | fixed `-m_h \\|i - j\\|` |
| `rope` | Su et al. | rotation of q and k: none |
| `kerple_log`, `kerple_power` | Chi et al. (KERPLE) | `-r1 log(1 + r2 \\|i - j\\|)`, `-r1 \\|i - j\\|^r2` per head |
| `fire` | Li et al. (FIRE) | an MLP of `log(c (i - j) + 1) / log(c max(L, i) + 1)` per head |
| `xpos` | Sun et al. (xPos) | RoPE with an exponential scale per pair: none |

Three kinds of registered schemes are left out: the **segment** schemes (`segment_input`,
`segment_per_head`), which encode token types rather than positions, those that need
Linformer attention (`diet_abs_lin`, whose key side has `k` projected rows instead of
`L` positions), and those for causal attention only, CoPE (`cope`) and the forgetting gates
(`fox`), which have no encoder form and whose terms are computed from the content. Each panel
shows head 0 of layer 0 with its own colour scale.'''),
    ("code", '''\
from posenc_jax import analysis
from posenc_jax.models import ModelConfigError
from posenc_jax.presets import preset_config
from posenc_jax.schemes import SegmentInput, SegmentPerHead
from posenc_jax.schemes.registry import SCHEMES

models, skipped = {}, {}
for name, spec in SCHEMES.items():
  if issubclass(spec.module, (SegmentInput, SegmentPerHead)):
    skipped[name] = "a segment (token type) scheme, not a positional one"
    continue
  if spec.module.causal_only:
    skipped[name] = "causal attention only (no encoder form), computed from the content"
    continue
  config = preset_config(SIZE)
  config.model.scheme = {"name": name}
  try:
    models[name] = analysis.from_config(config, name=f"{SIZE},{name}")
  except ModelConfigError as e:  # e.g. diet_abs_lin: needs attention='linformer'
    skipped[name] = str(e)

positional = {name: analysis.positional_attention(m.encoder, m.variables, length=LENGTH)
              for name, m in models.items()}
for name, p in positional.items():
  print(f"{name:<16}{p.kind:<12}{', '.join(p.parts) or '-'}")
print()
for name, why in skipped.items():
  print(f"skipped {name}: {why}")
'''),
    ("code", '''\
import math

from matplotlib.figure import Figure


def grid(panels, title, cmap, colour_label):
  """One heatmap per (name, matrix, note) on a 4-column grid; a None matrix: the note alone."""
  cols = 4
  rows = math.ceil(len(panels) / cols)
  fig = Figure(figsize=(3.2 * cols, 2.9 * rows + 0.4), dpi=90, layout="constrained")
  axes = np.atleast_1d(fig.subplots(rows, cols)).reshape(-1)
  for ax, (name, matrix, note) in zip(axes, panels):
    ax.set_title(f"{name}\\n{note}" if matrix is not None else name, fontsize=9)
    if matrix is None:
      ax.text(0.5, 0.5, note, ha="center", va="center", fontsize=9, transform=ax.transAxes)
      ax.set_xticks([])
      ax.set_yticks([])
      continue
    image = ax.imshow(matrix, cmap=cmap, interpolation="nearest")
    ax.set_xlabel("key position j", fontsize=8)
    ax.set_ylabel("query position i", fontsize=8)
    ax.tick_params(labelsize=7)
    bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
    bar.set_label(colour_label, fontsize=8)
    bar.ax.tick_params(labelsize=7)
  for ax in axes[len(panels):]:
    ax.set_axis_off()
  fig.suptitle(title, fontsize=12)
  return fig


def describe(name, p):
  if p.kind == "none":
    if name == "none":
      return "no position information"
    return "no content-free term\\n(query-dependent)"
  return " + ".join("input table" if part.startswith("input") else part for part in p.parts)


panels = [(name, None if p.kind == "none" else p.values[0], describe(name, p))
          for name, p in positional.items()]
show(grid(panels, f"Content-free positional logits, layer 0 head 0 ({SIZE}, at initialisation)",
          "viridis", "positional logit"))
'''),
    ("markdown", '''\
What to look for:

* **input APEs** (`learned_ape`, `sinusoidal_ape`): `c (P W_Q)(P W_K)^T`, seen through the
  first layer's (random) projections. The fixed sinusoids give a smooth pattern, but not a
  translation-invariant one: `W_Q W_K^T` mixes the frequencies. A learned table starts as noise.
* **relative biases** (`t5`, `diet_rel`, `alibi`): constant along each diagonal
  (Toeplitz), the defining property of a relative scheme. T5's log-spaced buckets show as
  widening stripes; ALiBi is a fixed linear penalty in `|i - j|` (head 0 has the steepest slope).
* **DIET-ABS**: `P_Q P_K^T`, absolute (no Toeplitz structure) and of rank `d_p` per head.
* **TUPE**: row 0 and column 0 are constant, the `[CLS]` reset: two learned values
  `theta_1` (from `[CLS]`) and `theta_2` (to `[CLS]`) replace `[CLS]`'s positional
  correlations. TUPE-R adds a T5 bias (faint diagonal stripes).
* **BERT-A^d**: the position-position term of positions projected by their own `U_Q, U_K`.
* **Shaw, sinusoidal RPE, RoPE**: the positional effect multiplies the query, so there is no
  content-free term to draw. Identical-word probing below shows what they do.

## Identical-word probing of every scheme

The first layer's attention on `[CLS] w ... w [SEP]`, averaged over random words and heads
(Wang et al. 2021, Fig. 2), for the same untrained models. The colour scale of each panel is
clipped at its 99th percentile so that the diagonal does not take it all.'''),
    ("code", '''\
probing = {name: analysis.identical_word_probing(m.encoder, m.variables, m.tokens, length=LENGTH,
                                                 num_words=PROBE_WORDS, batch_size=PROBE_WORDS)
           for name, m in models.items()}
panels = [(name, np.minimum(p.attention, np.percentile(p.attention, 99)), "mean over heads")
          for name, p in probing.items()]
show(grid(panels, f"Identical-word probing, layer 0 ({SIZE}, at initialisation)", "Blues",
          "attention probability"))
'''),
    ("markdown", '''\
## 2. Rank: input APE vs DIET-ABS (DIET Theorem 1, Fig. 2/8)

With an input APE, position and content are added before the projections, so each head's
logits `c (X W_Q)(X W_K)^T` are a product through a `d_h`-dimensional space: their rank is at
most `d_h` (64 here) whatever the sequence length. DIET-ABS adds `P_Q P_K^T` of rank `d_p`
(128 in the `diet_abs` preset) to the logits, so they can reach full rank `L`.

`analysis.rank_report` counts singular values above `1e-4 * s_max` for each head's `[L, L]`
logits on a batch of random words (`L` = 128) and for the positional term.'''),
    ("code", '''\
RANK_MODELS = {"input APE (bert)": "bert", "DIET-ABS, d_p = 128 (diet_abs)": "diet_abs"}

rank_models = {label: analysis.from_config(f"{SIZE},{scheme}")
               for label, scheme in RANK_MODELS.items()}
reports = {label: analysis.rank_report(m.encoder, m.variables, m.tokens, batch_size=16)
           for label, m in rank_models.items()}

length = next(iter(reports.values()))["length"]
head_dim = next(iter(reports.values()))["head_dim"]
print(f"L = {length}, d_h = {head_dim}, rtol = {analysis.DEFAULT_RTOL:g}")
print(f"{'model':<34}{'logit rank min/mean/max':>26}{'positional rank':>18}")
for label, r in reports.items():
  lg, pos = r["logits"], r.get("positional")
  pos_text = f"{pos['min']}-{pos['max']} ({pos['kind']})" if pos else "-"
  print(f"{label:<34}{lg['min']:>10}/{lg['mean']:>6.1f}/{lg['max']:<8}{pos_text:>18}")

ranks = {f"logits: {label}": r["logits"]["ranks"] for label, r in reports.items()}
title = f"Rank of per-head attention logits, {SIZE}, L = {length}"
show(analysis.plots.plot_rank_histogram(ranks, head_dim=head_dim, length=length,
                                        rtol=analysis.DEFAULT_RTOL, title=title))
'''),
    ("markdown", '''\
The histogram counts one rank per head and example. The input-APE model's logits stop at the
dashed line `d_h`; DIET-ABS's go past it, up to `L` (a random square `P_Q P_K^T` has a few
tiny singular values, so some counts land at 126-127 rather than 128). The singular values of
the positional term itself show the same cut: the input APE's drop by orders of magnitude
right after `d_h`, while DIET-ABS's stay above the tolerance up to `d_p` (= `L` here).'''),
    ("code", '''\
fig = Figure(figsize=(6.2, 3.6), dpi=90, layout="constrained")
ax = fig.subplots()
for label, m in rank_models.items():
  values = analysis.positional_attention(m.encoder, m.variables, length=length).values[0]
  s = np.linalg.svd(np.asarray(values, np.float64), compute_uv=False)
  ax.semilogy(np.arange(1, len(s) + 1), s / s[0], label=label)
ax.axvline(head_dim, color="k", linestyle="--", linewidth=1, label=f"d_h = {head_dim}")
ax.axhline(analysis.DEFAULT_RTOL, color="grey", linestyle=":", linewidth=1, label="rank tolerance")
ax.set_xlabel("singular value index")
ax.set_ylabel("s_k / s_1")
ax.set_title("Singular values of the positional term (layer 0, head 0)")
ax.legend(fontsize=8)
show(fig)
'''),
    ("markdown", '''\
## 3. Parameters (DIET Table 6)

DIET Table 6 lists the parameter counts of BERT-base with each scheme, for the English
(30,522 WordPieces) and the multilingual (120,000) vocabulary. Ours come from each model's
real initialisation under `jax.eval_shape` (no memory is spent on BERT-base). The Shaw row is
reported, not matched: the paper does not say which tables its Shaw model kept.'''),
    ("code", '''\
from posenc_jax.params import diet6_rows, format_diet6, model_counts

print(format_diet6(diet6_rows()))
'''),
    ("markdown", '''\
And every scheme preset side by side: the parameters the scheme itself owns (`bert/position`:
tables, biases, projections) and the total of the BERT-base MLM model. The Linformer rows also
count Linformer's `E`/`F` projections in the total. Schemes for causal attention only (CoPE,
the forgetting gates) have no encoder form: their rows (`lm`) count a BERT-base-sized causal
LM (`configs/lm.py`: no pooler, no token types), the model the benchmarks time them on.'''),
    ("code", '''\
from posenc_jax import presets
from posenc_jax.benchmarks.model_steps import model_of
from posenc_jax.configs import lm

print(f"{'preset':<22}{'scheme config':<52}{'position params':>16}{'total (M)':>11}")
for name, preset in presets.SCHEME_PRESETS.items():
  if "scheme" not in preset:  # modifiers: segment_per_head, pre_ln, ...
    continue
  causal = model_of(name) == "lm"  # a causal-only scheme: counted in the causal LM
  config = lm.get_config(f"bert_base,{name}") if causal else preset_config(f"bert_base,{name}")
  counts = model_counts(config)
  own = counts["modules"].get("decoder/position" if causal else "bert/position", 0)
  scheme = dict(preset["scheme"])
  options = [f"{k}={v}" for k, v in scheme.items() if k != "name"]
  if "attention" in preset:
    options += [f"attention={preset['attention']}", f"linformer_k={preset['linformer_k']}"]
  described = scheme["name"] + (f" ({', '.join(options)})" if options else "")
  print(f"{name:<22}{described:<52}{own:>16,}{counts['total'] / 1e6:>11.1f}"
        + ("  lm" if causal else ""))
'''),
]

# --- compare schemes ---------------------------------------------------------------------------

COMPARE = [
    ("markdown", """\
# Compare positional schemes: train short, test long

The standard comparison of positional encodings since ALiBi (Press et al. 2022,
*Train Short, Test Long*): train a causal language model per scheme at a short length,
then report perplexity at longer lengths **on the same tokens**. This notebook runs that
grid with `posenc_jax.compare` (the library behind `python -m posenc_jax.compare
--config=configs/compare.py:extrapolation`): one `train.py` run per scheme, then the
`evaluate` tool's extrapolation protocol on each, then one table, one plot, and each
scheme's training-step time and memory relative to the first scheme (DIET Table 1's cost
columns).

The text is the bundled long-document corpus (the Python standard library's source, one
token per byte), so every scheme sees real documents longer than 16x its training length.
Each scheme (Press et al.'s four: sinusoidal, RoPE, T5, ALiBi) is trained at 128 tokens and
scored at 128 to 2048. On a CPU runtime the grid runs one seed for 200 steps (about 6
minutes on 2 cores); on a GPU or TPU runtime it runs the shipped experiment (3 seeds, 300
steps), and `configs/compare.py:extrapolation,gpu` is the larger grid for about a GPU-hour.
A seed whose model did not learn (perplexity at the training length above half the unigram
model's) is reported as such instead of numbers; a scheme that cannot reach a length
(BERT's learned table of `max_len` rows) shows `n/a` with the reason."""),
    ("code", INSTALL),
    ("code", SHOW),
    ("markdown", """\
## Settings

`SMALL` is set by the notebook test (`POSENC_NOTEBOOK_SMALL=1`): two schemes, 20 steps,
so the notebook runs in about a minute; the numbers then mean nothing (the models have not
learned). Any field of `config` can be changed here: `config.schemes = "rope,alibi,none"`
adds a scheme, `config.seeds = "0,1,2,3,4"` more seeds, `config.train.total_steps` a longer
budget."""),
    ("code", """\
import os
import tempfile

import jax

from posenc_jax.configs.compare import get_config

SMALL = os.environ.get("POSENC_NOTEBOOK_SMALL") == "1"  # the test's quick settings
ACCELERATOR = jax.default_backend() != "cpu"
ROOT = os.environ.get("POSENC_NOTEBOOK_WORKDIR") or tempfile.mkdtemp(prefix="posenc_compare_")

config = get_config("extrapolation")  # configs/compare.py: schemes, budgets, lengths
if SMALL:
  config.schemes, config.seeds = "bert,alibi", "0"
  config.train.update(dict(total_steps=20, log_every=10, eval_every=20, checkpoint_every=20,
                           seq_len=16, optimizer=dict(warmup_steps=5)))
  config.lengths = "16,64,256"
  config.evaluate.tokens = 1024
  config.cost.update(dict(lengths="16", batch=2, repeats=2))
elif not ACCELERATOR:  # a CPU runtime: one seed, 200 steps (about 6 minutes on 2 cores)
  config.seeds = "0"
  config.train.update(dict(total_steps=200, eval_every=200, checkpoint_every=200))
  config.evaluate.tokens = 16384
print(f"SMALL = {SMALL} | schemes: {config.schemes} | steps: {config.train.total_steps} | "
      f"trained at {config.train.seq_len}, tested at {config.lengths} | root: {ROOT} | "
      f"devices: {jax.devices()}")"""),
    ("markdown", """\
## Run the grid

One cell per scheme (and seed), each in `ROOT/<scheme>/seed<k>` with its output in
`log.txt`. Run this cell again and finished cells are not rerun; a failed cell is reported
and the others go on. `python -m posenc_jax.compare ... --dry_run` prints the same cells'
command lines, to submit to a cluster's scheduler instead."""),
    ("code", """\
from posenc_jax import compare

summary = compare.compare(config, ROOT)"""),
    ("markdown", """\
## The table and the curves

Perplexity at each evaluation length (median over seeds, with the range when there are
several), the cost columns beside it, and the reasons for every `n/a`. The same table is in
`ROOT/results.md`, every number in `ROOT/results.json`."""),
    ("code", """\
from IPython.display import Markdown

from posenc_jax.comparison import report

text = report.markdown(summary)
print(text)
display(Markdown(text))
for table in summary["tables"]:
  show(report.plot(table))"""),
    ("markdown", """\
## One run, another protocol

`posenc_jax.evaluation.evaluate_workdir` is the `evaluate` tool as a function. Sliding
windows give every scored token the same context as far as they can (each window scores
only its last `stride` tokens); Press et al.'s main tables use non-overlapping windows, as
above."""),
    ("code", """\
from posenc_jax import evaluation

last = config.schemes.split(",")[-1]
lengths = [int(n) for n in config.lengths.split(",")][:2]
doc = evaluation.evaluate_workdir(os.path.join(ROOT, last, "seed0", "train"), "extrapolation",
                                  lengths=lengths, windows="sliding", stride=lengths[0] // 2,
                                  tokens=config.evaluate.tokens)
for row in doc["rows"]:
  print(f"{last} at {row['length']}: perplexity {row['value']:.1f} with sliding windows "
        f"(stride {doc['stride']}), {row['scored_tokens']} tokens scored")"""),
    ("markdown", """\
## Next

* The papers' fine-tuning tables: `python -m posenc_jax.compare
  --config=configs/compare.py:glue_table --workdir=/tmp/glue` (pre-train, fine-tune every
  task, median over seeds of each run's best dev score).
* Synthetic probes (copy, MQAR, passkey) trained short and scored long:
  `--config=configs/compare.py:synthetic`.
* Any one workdir: `python -m posenc_jax.evaluate --workdir=DIR --protocol=extrapolation
  --lengths=64,128,256,512`."""),
]

NOTEBOOKS = {"quickstart.ipynb": QUICKSTART, "schemes_tour.ipynb": TOUR,
             "compare_schemes.ipynb": COMPARE}


def build(cells: list[tuple[str, str]], stem: str) -> nbformat.NotebookNode:
  """A notebook of ``cells`` with ids ``<stem>-NN`` and no outputs."""
  nb = nbformat.v4.new_notebook()
  nb.metadata = {
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
      "language_info": {"name": "python"},
      "colab": {"provenance": []},
  }
  new = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
  for i, (kind, source) in enumerate(cells):
    cell = new[kind](source.rstrip("\n"))
    cell.id = f"{stem}-{i:02d}"
    nb.cells.append(cell)
  nbformat.validate(nb)
  return nb


def render(name: str) -> str:
  return nbformat.writes(build(NOTEBOOKS[name], pathlib.Path(name).stem.replace("_", "-")),
                         version=4) + "\n"


def main(argv: list[str]) -> int:
  check = "--check" in argv
  stale = []
  for name in NOTEBOOKS:
    path = COLAB / name
    text = render(name)
    if check:
      if not path.exists() or path.read_text(encoding="utf-8") != text:
        stale.append(name)
    else:
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text, encoding="utf-8")
      print(f"wrote {path}")
  if stale:
    print(f"out of date: {', '.join(stale)} (run python scripts/make_notebooks.py)")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
