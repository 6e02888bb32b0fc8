"""The errors a user's config or run can raise: entry points print them as one line."""

from posenc_jax.paths import OutputPathError
from posenc_jax.convert.hf_bert import ConversionError
from posenc_jax.data.stdlib_corpus import CorpusError
from posenc_jax.models.config import ModelConfigError
from posenc_jax.route_table import RouteTableError
from posenc_jax.schemes import SchemeConfigError
from posenc_jax.training.checkpoint import CheckpointError
from posenc_jax.training.config import TrainConfigError
from posenc_jax.training.loop import DataError, NonFiniteLossError
from posenc_jax.training.mesh import MeshConfigError
from posenc_jax.training.optim import OptimizerConfigError
from posenc_jax.training.signals import TrainingInterrupted

USER_ERRORS = (ModelConfigError, SchemeConfigError, TrainConfigError, MeshConfigError,
               OptimizerConfigError, NonFiniteLossError, TrainingInterrupted, ConversionError,
               CheckpointError, DataError, OutputPathError, CorpusError, RouteTableError)
