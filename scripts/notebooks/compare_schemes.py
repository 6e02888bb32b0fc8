"""colab/compare_schemes.ipynb: train short, test long, with posenc_jax.compare."""

from notebooks.cells import INSTALL, SHOW

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

from posenc_jax.comparison import pages, plots

text = pages.markdown(summary)
print(text)
display(Markdown(text))
for table in summary["tables"]:
  if table["protocol"] in plots.PLOTS:
    show(plots.PLOTS[table["protocol"]](table))"""),
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
  --config=configs/compare.py:pretrain_finetune --workdir=/tmp/pf` (pre-train, fine-tune every
  task, median over seeds of each run's best dev score).
* Synthetic probes (copy, MQAR, passkey) trained short and scored long:
  `--config=configs/compare.py:synthetic`.
* Any one workdir: `python -m posenc_jax.evaluate --workdir=DIR --protocol=extrapolation
  --lengths=64,128,256,512`."""),
]
