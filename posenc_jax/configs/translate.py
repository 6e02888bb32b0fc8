"""Encoder-decoder translation training with teacher forcing.

  python train.py --config=configs/translate.py:transformer_base,diet_rel \
      --config.task=wmt18_en_de --workdir=/data/runs/wmt18_en_de_diet_rel

The argument is ``<size>[,<scheme>...][,diet_protocol]`` (sizes
transformer_base, transformer_big; schemes as in ``configs/model.py``: the
scheme applies to the encoder and decoder self-attention). ``diet_protocol``
is DIET's WMT18 setting (``shared/spec/RESULTS.md`` section 5): Vaswani base,
Adam, 250k steps, beam 10, length penalty 0.6, SacreBLEU on newstest2018.
The WMT18 tasks come with the data issue's task registry.
"""

from posenc_jax.presets import preset_config
from posenc_jax.training.config import base_train_config

PROTOCOLS = {
    # 512 pairs a batch: about 25k target tokens at WMT's average length, as Vaswani et al.
    "diet_protocol": dict(total_steps=250_000, batch_size=512, input_len=256,
                          target_len=256, eval_every=5000, checkpoint_every=5000),
}


def get_config(arg="transformer_base,sinusoidal"):
  names = arg.split(",")
  protocol = [n for n in names if n in PROTOCOLS]
  config = base_train_config()
  config.update(preset_config(",".join(n for n in names if n not in PROTOCOLS)))
  config.objective = "translation"
  config.head = "translation"
  config.task = "wmt18_en_de"
  config.input_len = 256
  config.target_len = 256
  config.seq_len = 256
  config.total_steps = 100_000  # Vaswani et al.'s base model
  config.label_smoothing = 0.1
  # Vaswani et al.'s Adam (b2 0.98, eps 1e-9) with inverse-sqrt decay after 4k warm-up
  # steps; the peak d^-0.5 * 4000^-0.5 = 7e-4 for d = 512.
  config.optimizer.update(dict(name="adam", learning_rate=7e-4, warmup_steps=4000,
                               schedule="rsqrt", b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0,
                               grad_clip_norm=0.0))
  # Beam search for the BLEU evaluation (DIET: beam 10, length penalty 0.6) on
  # ``eval_batches`` validation batches at every eval (0: teacher-forced eval only).
  config.decode = dict(beam_size=10, alpha=0.6, max_decode_len=256, eval_batches=0)
  for key, value in (PROTOCOLS[protocol[0]] if protocol else {}).items():
    config[key] = value
  return config
