"""Fine-tuning on the bundled WordNet tasks (real text, offline, CPU-sized).

The config lives in the package, posenc_jax/configs/finetune_wordnet.py (its docstring lists the
argument); this file keeps ``--config=configs/finetune_wordnet.py`` working from a clone.
"""

from posenc_jax.configs.finetune_wordnet import get_config  # noqa: F401
