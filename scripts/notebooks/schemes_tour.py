"""colab/schemes_tour.ipynb: every scheme's positional term, rank and parameters."""

from notebooks.cells import INSTALL, SHOW

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
