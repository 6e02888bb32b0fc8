"""The config files of ``train.py``, ``finetune.py``, ``python -m posenc_jax.params`` and
``python -m posenc_jax.analysis``, shipped inside the package.

``--config=configs/<file>.py[:<arg>]`` finds them from any folder (see
:func:`posenc_jax.cli.config_path`); a file of that path in the working folder, the
repository's thin ``configs/`` included, comes first. Each file's ``get_config(arg)``
documents its argument.
"""
