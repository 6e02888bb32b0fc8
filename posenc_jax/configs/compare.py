"""The experiments of ``python -m posenc_jax.compare``: a grid of schemes x seeds (x sizes),
each cell trained and scored through train.py, finetune.py and the evaluate tool.

  python -m posenc_jax.compare --config=configs/compare.py:extrapolation --workdir=/tmp/cmp
  python -m posenc_jax.compare --config=configs/compare.py:pretrain_finetune --workdir=/tmp/pf \
      --config.schemes=bert,diet_abs_share,diet_rel --config.seeds=0,1,2,3,4

The argument is the experiment, optionally with a variant: ``<experiment>[,<variant>]``.

* ``pretrain_finetune`` (DIET Tables 2-9, TUPE Table 2 and Fig. 4, Wang et al. Tables 2-4;
  ``glue_table`` is the same experiment): pre-train each scheme once as masked-LM BERT on
  the bundled WordNet glosses (``train_config``: the demo of configs/pretrain.py at 800 steps,
  each scheme at its calibrated position learning rate), then fine-tune it with every seed
  (``pretrain_seeds``: 0, as DIET and TUPE fine-tune one pre-trained model with several
  seeds) on ``wordnet_order`` (is the gloss as WordNet wrote it, or cut in two with its
  halves swapped: no position scores exactly 50%), 200 steps. Tables: pre-training
  (held-out masked-LM perplexity against the unigram's, steps to the baseline's final loss,
  curves), per task the median over seeds of each run's best dev score with the range, a
  majority-class row, each pre-trained model's property indicators beside Wang et al.'s
  rows (the evaluate tool's ``indicators``), and the cost (training and inference). On CPUs
  its cells run one a core (``parallel``: auto). Default: the core contrasts (learned APE, TUPE-A,
  DIET-ABS shared, DIET-REL, T5, none), 3 seeds. Variants: ``quick`` (DIET-REL against
  none, 1 seed, 300 pre-training steps, no cost), ``all`` (every encoder scheme of the
  seeds: learned and sinusoidal APE, Shaw, sinusoidal RPE, T5, TUPE-A, TUPE-R, BERT-A^d,
  DIET-REL with and without layer-wise sharing, DIET-ABS at rank 64 and 128 and with sharing
  none, layer and head, DIET-ABS with per-head segments (``diet_abs_share+segment_per_head``)
  against input segments, Linformer with input APE against DIET-ABS-LIN, RoPE, ALiBi and
  none; and ``wordnet_hypernym``, a gloss pair, 600 fine-tuning steps, for the segment
  comparison's rows, ``SEGMENT_SCHEMES``), ``gpu`` and ``tpu`` (``bert_small`` pre-trained on
  English Wikipedia, 100k steps of 256 x 128, then the GLUE tasks and SQuAD v1.1 with
  configs/finetune_glue.py; prepare the data first: see docs/data.md).
* ``extrapolation`` (Press et al. 2022): a ``bert_tiny``-sized causal LM per scheme and
  seed on the bundled long documents (``configs/lm.py:{size},{scheme},stdlib``: the Python
  standard library's source, one token per byte), 300 steps of 32 x 128 tokens at lr 3e-3,
  then perplexity at 128 to 2048 (1x-16x) on the first 65,536 validation tokens, 3 seeds of
  Press et al.'s four schemes (sinusoidal, RoPE, T5, ALiBi). Variants: ``quick`` (a smoke
  run: RoPE and ALiBi, 1 seed, 200 steps, 1x and 4x, no cost), ``all`` (the 12 causal
  schemes: learned APE, sinusoidal, RoPE, T5, ALiBi, KERPLE, FIRE, xPos, FoX, CoPE, DIET-REL,
  NoPE), ``gpu`` (``bert_small`` at 512, 5000 steps of 64, tested to 8192 on 262,144 tokens:
  about an hour on one GPU for the 12 cells). ``--config.train_config=configs/lm.py:{size},
  {scheme},pg19`` runs it on PG-19 (``c4``: C4).
* ``synthetic`` (Kazemnejad et al. 2023): a causal LM per scheme and seed trained on copy at
  every instance length up to 10 symbols (``seq_len`` 21, ``probe.min_symbols=1``, 100
  symbols), 4 layers, 64 wide, 4 heads (pre-LN), 4000 steps of 64 at lr 2e-3, then scored
  on 256 held-out examples of the longest instance at 21, 31 and 41 (1x to 2x): whole
  answers and answer tokens, 3 seeds of NoPE, ALiBi and RoPE. Variants: ``quick`` (RoPE,
  1 seed, 1000 steps, 1x and 2x), ``all`` (Kazemnejad et al.'s five: NoPE, T5, ALiBi, RoPE,
  learned APE, on copy and reverse), ``gpu`` (the five on copy and reverse, 6 layers, 256
  wide, 8 heads, trained to 40 symbols (``seq_len`` 81), tested to 2x, 20,000 steps of
  128). ``tasks`` may name any probe (copy, reverse, mqar, passkey): one run per probe.

Lists (``schemes``, ``seeds``, ``pretrain_seeds``, ``sizes``, ``tasks``, ``lengths``) are
comma-separated strings; ``pretrain_seeds`` (fine-tuning experiments; empty: every seed)
names the seeds that pre-train, the others fine-tuning the first one's model.
``train_config``, ``finetune_config`` are config specs where ``{size}``,
``{scheme}`` and ``{task}`` are filled in per cell; ``train`` and ``finetune`` hold
``--config.<field>`` overrides for every run (the budgets; a field not listed there is
added in a copy of this file); ``finetune_by_task.<task>`` holds one task's overrides, over
``finetune``'s, and ``task_schemes.<task>`` the rows fine-tuned on that task (unset: every
row); ``evaluate`` holds the evaluate tool's flags (unset: its
defaults; ``windows`` may list both kinds, ``non_overlapping,sliding``, each then an
evaluation of its own). ``cost`` times each scheme's training step and its peak memory
against ``baseline`` (default: the first scheme) with ``posenc_jax.benchmarks``, on the model
the experiment trains (the causal LM of an LM experiment; else the masked-LM BERT, and the
causal LM for a causal-only scheme and the baseline beside it), at ``cost.lengths`` (empty:
the training length and the longest evaluated length), with the baseline timed against
itself for the noise.

``keep`` is what a cell keeps on disk: by default (``params``) it trains with one
checkpoint (``--config.keep_checkpoints=1``, enough to resume a killed cell) and, once
finished, keeps its final parameters only, without the optimizer state
(:func:`posenc_jax.training.params_only.keep_params_only`): what its evaluation reads.
``--config.keep=all`` keeps every checkpoint train.py and finetune.py keep. ``parallel`` is
how many cells run at once on this host (``compare --parallel`` overrides it): ``1``, N, or
``auto``, one per GPU, TPU chip or CPU core.
"""

from ml_collections import config_dict

from posenc_jax.messages import nearest

# The probe runs' config spec (configs/probe.py), filled in per cell.
PROBE_CONFIG = "configs/probe.py:{size},{scheme},{task}"
EXPERIMENTS = ("pretrain_finetune", "extrapolation", "synthetic")
ALIASES = {"glue_table": "pretrain_finetune"}  # the experiment's name before 2026-11-28


def _base(experiment: str, protocol: str, schemes: str, seeds: str) -> config_dict.ConfigDict:
  config = config_dict.ConfigDict()
  config.experiment = experiment
  config.protocol = protocol  # finetune, extrapolation or probes
  config.schemes = schemes
  config.baseline = ""  # empty: the first scheme
  config.seeds = seeds
  config.pretrain_seeds = ""  # the fine-tuning protocol's seeds that pre-train; empty: every seed
  config.sizes = "bert_tiny"
  config.train_config = ""
  config.train = config_dict.ConfigDict()
  # What a cell keeps on disk: "params" (while it trains, one checkpoint, enough to resume it;
  # once finished, its final parameters only, without the optimizer state) or "all" (every
  # checkpoint train.py and finetune.py keep, optimizer state included).
  config.keep = "params"
  config.tasks = ""
  config.finetune_config = ""
  config.finetune = config_dict.ConfigDict()
  # <task>: overrides of that task's fine-tuning runs, over `finetune` (its own budget).
  config.finetune_by_task = config_dict.ConfigDict()
  # <task>: the comma-separated rows that fine-tune on it (absent: every row).
  config.task_schemes = config_dict.ConfigDict()
  config.lengths = ""
  # N of the rows <scheme>+randomized_positions: their position ids are drawn from [0, N).
  config.randomized_positions = config_dict.placeholder(int)
  # The evaluate tool's flags (unset: its defaults): windows non_overlapping|sliding, the
  # sliding stride, the first N tokens of the split, the checkpoint (latest, best, a step).
  config.evaluate = config_dict.ConfigDict(dict(
      windows=config_dict.placeholder(str), stride=config_dict.placeholder(int),
      tokens=config_dict.placeholder(int), checkpoint=config_dict.placeholder(str)))
  # lengths: comma-separated; empty: the training length and the longest evaluated length.
  # The device kind the grid is sized for (cpu, gpu, tpu): what --dry_run estimates it on.
  config.device = "cpu"
  # Cells at once on this host (compare --parallel, which overrides it): N, or auto (one per
  # GPU, TPU chip or CPU core; posenc_jax/comparison/slots.py).
  config.parallel = "1"
  config.cost = config_dict.ConfigDict(dict(enabled=True, batch=8, lengths="", repeats=5,
                                            dtype="float32"))
  return config


# Press et al.'s four schemes (their Figure 1): the default extrapolation grid.
PRESS_SCHEMES = "sinusoidal,rope,t5,alibi"
# Every scheme a causal LM compares today (issue: learned APE, sinusoidal, RoPE, T5, ALiBi,
# KERPLE, FIRE, xPos, FoX, CoPE, DIET-REL and NoPE): the `all` variant.
CAUSAL_SCHEMES = "bert,sinusoidal,rope,t5,alibi,kerple_log,fire,xpos,fox,cope,diet_rel,none"
# Kazemnejad et al. 2023's five (NoPE, T5's bias, ALiBi, RoPE, learned APE): synthetic's `all`.
KAZEMNEJAD_SCHEMES = "none,t5,alibi,rope,bert"
# The seeds' core contrasts (DIET, TUPE, Wang et al.): learned APE, TUPE-A, DIET-ABS with
# layer-wise sharing, DIET-REL, T5's buckets, and no position as the control row.
CORE_ENCODER_SCHEMES = "bert,tupe_a,diet_abs_share,diet_rel,t5,none"
# Every encoder scheme of the seeds (DIET-ABS at rank 64 and 128 and with sharing none,
# layer and head, and with per-head segments against input segments; DIET-REL with and
# without layer-wise sharing, which DIET finds helps DIET-ABS and hurts DIET-REL; DIET-ABS-LIN
# against Linformer with input APE), with RoPE, ALiBi and none.
SEED_ENCODER_SCHEMES = ("bert,sinusoidal,shaw,sinusoidal_rpe,t5,tupe_a,tupe_r,bert_ad,diet_rel,"
                        "diet_rel_share,diet_abs,diet_abs_share,diet_abs_share+segment_per_head,"
                        "diet_abs_rank64_share,diet_abs_share_head,linformer,diet_abs_lin,rope,"
                        "alibi,none")
# Every cell's pre-training: longer than the demo's 600 steps (configs/pretrain.py), because
# DIET-ABS's and TUPE-A's position terms learn order between steps 600 and 800: pre-trained
# 600 steps, both fine-tuned wordnet_order to 50.0-51.4% (every seed), where 800 steps give
# 73.6-84.0% and 69.0-70.6% (docs/results/pretrain-calibration-cpu.md).
# The segment comparison (DIET-ABS with input segments against per-head ones, learned APE
# beside them) on `wordnet_hypernym`, a gloss pair: 1,580 training pairs, fine-tuned 600
# steps (the config's, 12 epochs; from learned APE its dev accuracy rose to 65.8% at step
# 300 and stayed within 61-66%, where 200 steps left seeds at 51.5-58.4%), evaluated every
# 100. Its 202 dev pairs give a standard error of about 3.4 points: wider than the papers'
# segment differences (0.1-0.5 points), so this is a smoke test of the pair path, not a test
# of the direction (the gpu variant's GLUE pair tasks are).
SEGMENT_SCHEMES = "bert,diet_abs_share,diet_abs_share+segment_per_head"
HYPERNYM_STEPS = 600
PRETRAIN_STEPS = 800
QUICK_PRETRAIN_STEPS = 300
FINETUNE_STEPS = 200
# GLUE (DIET Table 2, TUPE Table 2) and SQuAD v1.1 (Wang et al. Table 4): the accelerator grid.
ACCELERATOR_TASKS = ("glue_cola,glue_sst2,glue_mrpc,glue_stsb,glue_qqp,glue_mnli,glue_qnli,"
                     "glue_rte,squad_v1")
# Variants, after the experiment's name: configs/compare.py:<experiment>[,<variant>].
VARIANTS = ("quick", "all", "gpu", "tpu")
ACCELERATOR_VARIANTS = ("gpu", "tpu")


def _extrapolation(variant: str | None) -> config_dict.ConfigDict:
  """Press et al.'s protocol on the bundled long documents (module docstring)."""
  config = _base("extrapolation", "extrapolation", PRESS_SCHEMES, "0,1,2")
  config.train_config = "configs/lm.py:{size},{scheme},stdlib"
  config.train.update(dict(total_steps=300, seq_len=128, batch_size=32, log_every=100,
                           eval_every=300, checkpoint_every=300,
                           optimizer=dict(learning_rate=3e-3, warmup_steps=50)))
  config.lengths = "128,256,512,1024,2048"  # 1x to 16x
  config.evaluate.tokens = 65_536
  if variant == "quick":  # a smoke run: two schemes, one seed, 200 steps, 1x and 4x
    config.schemes, config.seeds, config.lengths = "rope,alibi", "0", "128,512"
    config.train.update(dict(total_steps=200, eval_every=200, checkpoint_every=200))
    config.evaluate.tokens = 8192
    config.cost.enabled = False
  elif variant == "all":
    config.schemes = CAUSAL_SCHEMES
  elif variant == "gpu":  # about one GPU-hour per grid of 4 schemes x 3 seeds
    config.device = "gpu"
    config.sizes = "bert_small"
    config.train.update(dict(total_steps=5000, seq_len=512, batch_size=64, log_every=500,
                             eval_every=1000, checkpoint_every=1000,
                             optimizer=dict(learning_rate=1e-3, warmup_steps=500)))
    config.train.model = config_dict.ConfigDict(dict(max_len=512))
    config.lengths = "512,1024,2048,4096,8192"
    config.evaluate.tokens = 262_144
  return config


def _synthetic(variant: str | None) -> config_dict.ConfigDict:
  """Kazemnejad et al.'s length generalisation on copy (module docstring). The model and
  budget are the smallest measured at which NoPE, ALiBi and RoPE each copy every held-out
  answer at the training length on 2 CPU cores (docs/results/synthetic-copy-cpu)."""
  config = _base("synthetic", "probes", "none,alibi,rope", "0,1,2")
  config.train_config = PROBE_CONFIG
  config.train.update(dict(total_steps=4000, seq_len=21, batch_size=64, log_every=500,
                           eval_every=4000, checkpoint_every=1000,
                           optimizer=dict(learning_rate=2e-3, warmup_steps=200),
                           probe=dict(alphabet=100, min_symbols=1)))
  config.train.model = config_dict.ConfigDict(dict(num_layers=4, num_heads=4, d_model=64,
                                                   mlp_dim=256, pre_ln=True))
  config.tasks = "copy"
  config.lengths = "21,31,41"  # 1x, 1.5x, 2x
  config.cost.enabled = False  # the step's cost is the extrapolation experiment's question
  if variant == "quick":  # a smoke run: RoPE (copies every answer by step 1000), one seed
    config.schemes, config.seeds, config.lengths = "rope", "0", "21,41"
    config.train.update(dict(total_steps=1000, eval_every=1000, checkpoint_every=1000))
  elif variant == "all":
    config.schemes, config.tasks = KAZEMNEJAD_SCHEMES, "copy,reverse"
  elif variant == "gpu":  # the five on copy and reverse at 40 symbols, tested to 80
    config.device = "gpu"
    config.schemes, config.tasks = KAZEMNEJAD_SCHEMES, "copy,reverse"
    config.train.update(dict(total_steps=20_000, seq_len=81, batch_size=128,
                             eval_every=20_000, checkpoint_every=2000,
                             optimizer=dict(learning_rate=1e-3, warmup_steps=1000)))
    config.train.model.update(dict(num_layers=6, num_heads=8, d_model=256, mlp_dim=1024,
                                   max_len=256))
    config.lengths = "81,121,161"
  return config


def _pretrain_finetune(variant: str | None) -> config_dict.ConfigDict:
  """DIET's, TUPE's and Wang et al.'s experiment: pre-train, then fine-tune (module
  docstring). The pre-training is the bundled demo's, each scheme at its calibrated
  position learning rate (configs/pretrain.py, docs/results/pretrain-calibration-cpu.md);
  one pre-training per scheme, fine-tuned with every seed, as DIET and TUPE do."""
  config = _base("pretrain_finetune", "finetune", CORE_ENCODER_SCHEMES, "0,1,2")
  config.pretrain_seeds = "0"
  config.sizes = "bert_demo"  # the demo's model
  config.train_config = "configs/pretrain.py:{size},{scheme}"
  config.train.update(dict(total_steps=PRETRAIN_STEPS, log_every=100, eval_every=100,
                           checkpoint_every=PRETRAIN_STEPS))
  config.tasks = "wordnet_order"
  config.finetune_config = "configs/finetune_wordnet.py:{task}"
  # The fine-tuning configs warm up over optimizer.warmup_fraction (10%); finetune.py refuses
  # a warmup_steps that the fraction would override.
  config.finetune.update(dict(total_steps=FINETUNE_STEPS, log_every=100,
                              eval_every=FINETUNE_STEPS // 2, checkpoint_every=FINETUNE_STEPS))
  # On CPUs one cell a core: a bert_demo pre-training on one core makes 0.74x the steps per
  # second of one on two (4.0 against 5.4, the same losses to the last digit; AMD EPYC,
  # 2026-11-29), and a step's start-up (imports, tracing) is one core's work either way, so
  # two cells at once finish the grid sooner (docs/results/pretrain-finetune-cpu).
  config.parallel = "auto"
  if variant == "quick":  # DIET-REL against no position, one seed, a shorter pre-training
    config.schemes, config.seeds = "diet_rel,none", "0"
    config.train.update(dict(total_steps=QUICK_PRETRAIN_STEPS, eval_every=100,
                             checkpoint_every=QUICK_PRETRAIN_STEPS))
    config.cost.enabled = False
  elif variant == "all":  # with the pair task of the segment comparisons
    config.schemes = SEED_ENCODER_SCHEMES
    config.tasks = "wordnet_order,wordnet_hypernym"
    config.task_schemes.wordnet_hypernym = SEGMENT_SCHEMES
    config.finetune_by_task.wordnet_hypernym = config_dict.ConfigDict(dict(
        total_steps=HYPERNYM_STEPS, eval_every=100, checkpoint_every=HYPERNYM_STEPS))
  elif variant in ACCELERATOR_VARIANTS:  # the real GLUE tasks and SQuAD at bert_small
    config.device = variant
    config.parallel = "1"  # every device on one cell (data parallel): bert_small at batch 256
    config.sizes = "bert_small"
    config.train_config = "configs/pretrain.py:{size},{scheme}"
    config.train = config_dict.ConfigDict(dict(
        task="wikipedia_en", total_steps=100_000, batch_size=256, seq_len=128,
        log_every=1000, eval_every=5000, eval_steps=20, checkpoint_every=5000,
        optimizer=dict(learning_rate=5e-4, warmup_steps=5000)))
    config.tasks = ACCELERATOR_TASKS
    config.finetune_config = "configs/finetune_glue.py:{task}"
    config.finetune = config_dict.ConfigDict()
  return config


def get_config(arg="extrapolation"):
  experiment, _, variant = arg.partition(",")
  experiment = ALIASES.get(experiment, experiment)
  if experiment not in EXPERIMENTS:
    raise ValueError(f"config argument: experiment {experiment!r} is unknown"
                     f"{nearest(experiment, EXPERIMENTS)} allowed: {', '.join(EXPERIMENTS)}")
  if variant and variant not in VARIANTS:
    raise ValueError(f"config argument: variant {variant!r} is unknown{nearest(variant, VARIANTS)}"
                     f" allowed: {', '.join(VARIANTS)}")
  tpu = variant == "tpu"  # the accelerator grid: the same on a TPU as on a GPU
  build = {"pretrain_finetune": _pretrain_finetune, "extrapolation": _extrapolation,
           "synthetic": _synthetic}[experiment]
  config = build(("gpu" if tpu and experiment != "pretrain_finetune" else variant) or None)
  if tpu:
    config.device = "tpu"
  return config
