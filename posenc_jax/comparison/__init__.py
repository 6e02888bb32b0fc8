"""``python -m posenc_jax.compare``: a grid of schemes x seeds (x sizes) trained, fine-tuned
and evaluated through the project's own tools, one workdir per cell, and the papers' tables
built from those workdirs.

* :mod:`~posenc_jax.comparison.plan`: the experiment's cells and each cell's command lines.
* :mod:`~posenc_jax.comparison.run`: runs cells in sequence as subprocesses, resumable.
* :mod:`~posenc_jax.comparison.collect`: reads workdirs (local or ``gs://``) into records.
* :mod:`~posenc_jax.comparison.report`: median-over-seeds tables, markdown, plots.
* :mod:`~posenc_jax.comparison.cost`: each scheme's step time and memory against a baseline.
"""
