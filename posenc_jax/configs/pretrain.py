"""Masked-LM pre-training (no NSP, full-sentence packing, 15% masking 80/10/10).

  python train.py --config=configs/pretrain.py --workdir=/tmp/posenc_demo
  python train.py --config=configs/pretrain.py:bert_base,diet_abs_share,diet_protocol \
      --config.task=wikipedia_en --workdir=gs://...

The argument is ``<size>[,<scheme>...][,<protocol>]`` (see ``configs/model.py``
for sizes and schemes). Protocols reproduce the papers at full scale
(``shared/spec/RESULTS.md`` section 5):

* ``diet_protocol``: 500k steps, batch 4096, seq 128, LAMB, LR 0.0018, warm-up 2.5%;
  MLM logits at 20 positions per row (BERT's ``max_predictions_per_seq``).
* ``tupe_protocol``: 1M steps, batch 256, seq 512 (MLM logits at 80 positions), AdamW (eps 1e-6), LR 1e-4,
  10k warm-up steps, linear decay, weight decay 0.01, clip 1.0, dropout 0.1.

With no protocol it is the bundled demo (size ``bert_demo`` by default): a small DIET-ABS
BERT on the bundled WordNet corpus, a few minutes on a laptop CPU.
"""

import math

from posenc_jax.presets import preset_config
from posenc_jax.training.config import base_train_config

PROTOCOLS = {
    "diet_protocol": dict(total_steps=500_000, batch_size=4096, seq_len=128,
                          max_predictions_per_seq=20,
                          optimizer=dict(name="lamb", learning_rate=0.0018, warmup_steps=0,
                                         warmup_fraction=0.025, b1=0.9, b2=0.999, eps=1e-6,
                                         weight_decay=0.01)),
    "tupe_protocol": dict(total_steps=1_000_000, batch_size=256, seq_len=512,
                          max_predictions_per_seq=80,
                          optimizer=dict(name="adamw", learning_rate=1e-4, warmup_steps=10_000,
                                         warmup_fraction=0.0, b1=0.9, b2=0.999, eps=1e-6,
                                         weight_decay=0.01, grad_clip_norm=1.0)),
}

# The causal-LM demo's budget (configs/lm.py reads it; the extrapolation pages were measured
# with its model, not the masked-LM demo's below).
LM_DEMO = dict(total_steps=500, batch_size=32, seq_len=64, log_every=25, eval_every=100,
               eval_steps=4, checkpoint_every=100,
               optimizer=dict(name="adamw", learning_rate=1e-3, warmup_steps=50,
                              warmup_fraction=0.0))
# The bundled masked-LM demo, calibrated on 2 CPU cores (docs/results/pretrain-calibration-cpu.md):
# 40% masking (Wettig et al. 2023: more targets per step) at lr 3e-3, the bert_demo size
# (bert_tiny with its MLP at 256), 600 steps; the held-out perplexity of every scheme but
# learned APE ends below half the unigram's (with DEMO_POSITION_LR_SCALE below). 8
# evaluation batches: 16,384 tokens.
DEMO = dict(total_steps=600, batch_size=32, seq_len=64, mask_rate=0.4, log_every=50,
            eval_every=150, eval_steps=8, checkpoint_every=150,
            optimizer=dict(name="adamw", learning_rate=3e-3, warmup_steps=80,
                           warmup_fraction=0.0))


# The demo's optimizer.position_lr_scale per position scheme: the best measured (scales 0.1
# to 10, not every one for every scheme) by held-out perplexity at the demo's budget (docs/results/pretrain-calibration-cpu.md).
# Adam moves every parameter by about the learning rate per step, and the schemes'
# parameters live at different scales: T5's and DIET-REL's tables are attention logits
# (units; x10 is what lets them learn position in 800 steps: 0.17x the unigram's
# perplexity, against 0.41x for T5 at x1); DIET-ABS's term is a product of two learned
# factors, whose step grows with both (x3: 0.31x; x10 is worse than x1); TUPE-A (a product
# too) is best at x1. Learned APE (no scale helped it), a scheme not measured, and a composed
# one keep 1.
DEMO_POSITION_LR_SCALE = {"t5": 10.0, "diet_rel": 10.0, "diet_abs": 3.0}
# The demo's sinusoidal APE (fixed or learnable frequencies) at amplitude 1/sqrt(d_model):
# Vaswani et al.'s amplitude 1 is 35 times louder than BERT's N(0, 0.02) token table and the
# masked LM never leaves the unigram's plateau (1.01x, wordnet_order 50.0%; 0.15: 1.02x).
# Measured at the comparison's 800 steps (seed 0, d_model 128; docs/results/pretrain-
# calibration-cpu.md): 1/sqrt(d) ends at 0.60-0.61x and fine-tunes wordnet_order to
# 53.4-58.2% (marginal, but the only amplitude measured above chance); quieter sinusoids
# (0.05, 0.028) pass the perplexity criterion (0.52x, 0.48x) but learn no order (50.5%,
# 50.0%).
DEMO_SINUSOID_AMPLITUDE_X_SQRT_D = 1.0


def get_config(arg="bert_demo,diet_abs_share"):
  names = arg.split(",")
  protocol = [n for n in names if n in PROTOCOLS]
  config = base_train_config()
  config.update(preset_config(",".join(n for n in names if n not in PROTOCOLS)))
  settings = PROTOCOLS[protocol[0]] if protocol else DEMO
  for key, value in settings.items():
    if key == "optimizer":
      config.optimizer.update(value)
    else:
      config[key] = value
  if not protocol:  # no dropout: a few hundred steps cannot overfit
    config.model.dropout_rate = 0.0
    config.model.attention_dropout_rate = 0.0
    scheme = config.model.scheme
    name = scheme.get("name") if hasattr(scheme, "get") else None
    config.optimizer.position_lr_scale = DEMO_POSITION_LR_SCALE.get(name, 1.0)
    if name == "sinusoidal_ape":
      config.model.scheme.amplitude = DEMO_SINUSOID_AMPLITUDE_X_SQRT_D / math.sqrt(
          config.model.d_model)
  return config
