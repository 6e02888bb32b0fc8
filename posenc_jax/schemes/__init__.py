"""Every positional and segment scheme, one family per module."""

from posenc_jax.schemes.absolute import LearnedAPE, SinusoidalAPE
from posenc_jax.schemes.alibi import Alibi, alibi_slopes
from posenc_jax.schemes.base import SHARING, Composite, NoPosition, Scheme, SchemeConfigError
from posenc_jax.schemes.cope import Cope
from posenc_jax.schemes.diet import DietAbs, DietRel
from posenc_jax.schemes.fire import Fire
from posenc_jax.schemes.forgetting import Fox
from posenc_jax.schemes.kerple import Kerple
from posenc_jax.schemes.registry import SCHEMES, build_scheme, validate_scheme_config
from posenc_jax.schemes.rope import Rope
from posenc_jax.schemes.segment import SegmentInput, SegmentPerHead
from posenc_jax.schemes.shaw import ShawRPE, SinusoidalRPE
from posenc_jax.schemes.t5 import T5Bias, relative_position_bucket
from posenc_jax.schemes.tupe import BertAd, Tupe
from posenc_jax.schemes.xpos import Xpos

__all__ = [
    "SCHEMES", "SHARING", "Alibi", "BertAd", "Composite", "Cope", "DietAbs", "DietRel", "Fire",
    "Fox", "Kerple", "LearnedAPE", "NoPosition", "Rope", "Scheme", "SchemeConfigError",
    "SegmentInput", "SegmentPerHead", "ShawRPE", "SinusoidalAPE", "SinusoidalRPE", "T5Bias",
    "Tupe", "alibi_slopes",
    "Xpos", "build_scheme", "relative_position_bucket", "validate_scheme_config",
]
