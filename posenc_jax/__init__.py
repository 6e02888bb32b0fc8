"""posenc-jax: Transformer positional encodings as composable attention-logit terms.

``import posenc_jax`` loads JAX and Flax only (no TensorFlow).
"""

from posenc_jax import interrupts

interrupts.install()  # first: a Ctrl-C during the imports below is one line too

from posenc_jax.attention import MultiHeadAttention, attend  # noqa: E402
from posenc_jax.schemes import SCHEMES, Scheme, SchemeConfigError, build_scheme  # noqa: E402
from posenc_jax.terms import (Bias, Factored, InputEmbedding, QKShift,  # noqa: E402
                              QueryRelative, Rotation, SchemeTerms, Term, Toeplitz)

__version__ = "0.1.0"

__all__ = [
    "SCHEMES", "Bias", "Factored", "InputEmbedding", "MultiHeadAttention", "QKShift",
    "QueryRelative", "Rotation", "Scheme", "SchemeConfigError", "SchemeTerms", "Term", "Toeplitz",
    "attend", "build_scheme",
]
