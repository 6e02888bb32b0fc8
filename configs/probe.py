"""Synthetic probes of position: a causal LM trained on copy, reverse, MQAR or passkey.

The config lives in the package, posenc_jax/configs/probe.py (its docstring lists the
argument); this file keeps ``--config=configs/probe.py`` working from a clone.
"""

from posenc_jax.configs.probe import get_config  # noqa: F401
