"""A BERT encoder and its parameters from a preset (fresh), a train.py checkpoint, or a
Hugging Face folder; or the positional machinery of a causal language model.

Every loader returns a :class:`LoadedModel`: the :class:`ModelConfig`, the
:class:`~posenc_jax.models.BertEncoder`, its variables ``{'params': ...}``
(unboxed) and the vocabulary's probing tokens::

  model = from_config("bert_tiny,diet_abs_share")             # fresh initialisation
  model = from_checkpoint("/tmp/run", "configs/pretrain.py:bert_tiny,diet_abs_share")
  model = from_hf(package_model_dir())                        # e.g. MiniLM

A checkpoint is read from ``<workdir>/checkpoints`` (the layout of
:class:`posenc_jax.training.checkpoint.Checkpointer`, used by train.py): only
the ``params`` of the ``state`` item are restored (no optimizer state is
needed), onto the local device, checked against the config's model; the
encoder is the ``bert`` subtree (any BERT head: MLM, classification, span).
The run's ``config.json`` gives the model (or the config the run used).

A decoder-only causal language model (head ``lm``) loads as its *positional view*
(``causal=True``): a :class:`~posenc_jax.models.BertEncoder` whose scheme is the LM's causal
form (:func:`~posenc_jax.models.config.causal_variant`: T5 unidirectional, ALiBi causal),
holding only the LM's ``decoder/position`` and each layer's ``self_attention`` (as
``position`` and ``layers_{i}/attention``). The scheme modules are the LM's own classes and
parameters, so :func:`~posenc_jax.analysis.positional_attention`,
:func:`~posenc_jax.analysis.position_vectors` and the positional ranks are the LM's; nothing
that runs the layers (probing, logit ranks) applies to it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from posenc_jax.analysis.probing import (AnalysisError, ProbeTokens, bundled_tokens,
                                         wordpiece_tokens)
from posenc_jax.cli import absolute, config_path
from posenc_jax.models import BertEncoder, ModelConfig, model_config
from posenc_jax.models.config import causal_variant


@dataclasses.dataclass
class LoadedModel:
  """An encoder ready for analysis.

  Attributes:
    config: the encoder's :class:`ModelConfig`.
    encoder: the :class:`BertEncoder` module.
    variables: ``{'params': ...}`` of the encoder (unboxed arrays).
    tokens: ``[CLS]``/``[SEP]`` ids and candidate probing words of its vocabulary.
    source: where it came from (``fresh:<preset>``, ``checkpoint:<dir>@<step>``, ``hf:<dir>``).
    step: the checkpoint step, if any.
    causal: a causal language model's positional view (see the module docstring): its
      ``encoder`` and ``variables`` compute the positional term, not the layers.
  """

  config: ModelConfig
  encoder: BertEncoder
  variables: dict[str, Any]
  tokens: ProbeTokens
  source: str
  step: int | None = None
  causal: bool = False

  def describe(self) -> dict[str, Any]:
    """JSON-ready summary: source, step, the model's dimensions and schemes, and its mask
    (``causal``: future positions masked, a language model; ``bidirectional``: BERT)."""
    cfg = self.config.to_dict()
    keys = ("d_model", "num_layers", "num_heads", "max_len", "scheme", "segment", "attention")
    return {"source": self.source, "step": self.step, **{k: cfg[k] for k in keys},
            "head_dim": self.config.dim_per_head,
            "mask": "causal" if self.causal else "bidirectional"}


def read_config(spec: str) -> ml_collections.ConfigDict:
  """A config file with its argument, ``configs/pretrain.py:bert_tiny,alibi``, as
  ``--config=`` reads it (``get_config(arg)``)."""
  path, _, arg = config_path(spec).partition(":")
  if not os.path.isfile(path):
    raise AnalysisError(f"config: no such file {path!r}")
  module_spec = importlib.util.spec_from_file_location("posenc_analysis_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def _resolve(config: Any) -> tuple[ModelConfig, str, int, str]:
  """(model config, head, num_labels, label) from a preset string, a ``file.py:arg`` spec,
  a ConfigDict with ``model`` (and ``head``), or a model config."""
  if isinstance(config, str):
    label = config
    if ".py" in config.split(":")[0]:
      config = read_config(config)
    else:
      from posenc_jax.presets import preset_config  # noqa: PLC0415
      config = preset_config(config)
  else:
    label = "config"
  if isinstance(config, ModelConfig):
    return config, "encoder", 2, label
  if isinstance(config, Mapping) and "model" in config or hasattr(config, "model"):
    get = config.get if hasattr(config, "get") else lambda key, default: default
    return model_config(config["model"]), get("head", "mlm"), get("num_labels", 2), label
  return model_config(config), "encoder", 2, label


def _init_ids(cfg: ModelConfig) -> jax.Array:
  return jnp.ones((1, min(8, cfg.max_len)), jnp.int32)


LM_ANALYSES = ("rank", "plots")
CAUSAL_PROBING = ("identical-word probing (Wang et al.) needs attention to both sides of each "
                  "position, which causal attention lacks")


def check_model(cfg: ModelConfig, head: str, command: str | None = None) -> None:
  """Raises one :class:`AnalysisError` line for a model the analysis cannot run: an
  encoder-decoder, or a causal language model (head ``lm``) given to ``command`` ``probe``
  or ``indicators``. Identical-word probing (Wang et al. Sec. 4.2) reads the probabilities
  of attention over both sides of ``[CLS] w .. w [SEP]``, and the indicators are computed
  from them (SD and direction balance compare the two sides); a causal model has only the
  past. ``rank`` and ``plots`` run on its positional term (``command`` None: the loaders,
  which accept a language model)."""
  if cfg.num_decoder_layers or head == "translation":
    raise AnalysisError("model: an encoder-decoder (translation) model; probe, indicators, "
                        "rank and plots run a BERT encoder or a causal language model's "
                        "positional term; params counts any config")
  if head == "lm" and command is not None and command not in LM_ANALYSES:
    raise AnalysisError(f"model: a decoder-only causal language model (head 'lm'); {command}: "
                        f"{CAUSAL_PROBING}; rank and plots analyse its positional term")


def _lm_view(cfg: ModelConfig, params: Any) -> tuple[BertEncoder, dict[str, Any]]:
  """The positional view of a causal LM's parameters (see the module docstring)."""
  decoder = params["decoder"]
  # layers_{i} (unrolled) or layers (scanned, leading [N] axis): the same names either way.
  layers = {name: {"attention": layer["self_attention"]} for name, layer in decoder.items()
            if name.startswith("layers")}
  view = BertEncoder(cfg.replace(scheme=causal_variant(cfg.scheme)))
  return view, {"params": {"position": decoder.get("position", {}), **layers}}


def loaded(cfg: ModelConfig, head: str, params: Any, source: str, step: int | None = None
            ) -> LoadedModel:
  """The encoder of ``params`` (a BERT model's or head's: ``head`` ``encoder``, ``mlm``,
  ``classification``, ...) or an LM's positional view (``head`` ``lm``), as a
  :class:`LoadedModel` with the bundled vocabularies' probing tokens."""
  tokens = bundled_tokens(cfg.vocab_size)
  if head == "lm":
    encoder, variables = _lm_view(cfg, params)
    return LoadedModel(cfg, encoder, variables, tokens, source, step, causal=True)
  if head != "encoder":
    params = params["bert"]
  return LoadedModel(cfg, BertEncoder(cfg), {"params": params}, tokens, source, step)


def from_config(config: Any, *, seed: int = 0, name: str | None = None) -> LoadedModel:
  """A freshly initialised encoder, or a language model's positional view (a config with
  ``head='lm'``), from ``jax.random.key(seed)``.

  Args:
    config: a preset (``"bert_tiny,alibi"``), a config file spec
      (``"configs/pretrain.py:bert_tiny,alibi"``), a ConfigDict with ``model``,
      or a :class:`ModelConfig`/dict of its fields.
    seed: initialisation seed.
    name: the config's name in ``source`` (default: the preset or file spec).
  """
  cfg, head, _, label = _resolve(config)
  label = name or label
  check_model(cfg, head)
  from posenc_jax.models.build import build_model  # noqa: PLC0415
  model = build_model(cfg, "lm") if head == "lm" else BertEncoder(cfg)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(seed), _init_ids(cfg))["params"])
  return loaded(cfg, head if head == "lm" else "encoder", params,
                 f"fresh:{label} (seed {seed})")


def checkpoint_steps(workdir: str) -> list[int]:
  """Complete steps saved under ``<workdir>/checkpoints``, oldest first."""
  from posenc_jax.training import checkpoint  # noqa: PLC0415
  try:
    return checkpoint.checkpoint_steps(workdir)
  except checkpoint.CheckpointError as e:
    raise AnalysisError(str(e)) from None


def restore_params(workdir: str, abstract_params: Any, *, step: int | None = None
                   ) -> tuple[int, Any]:
  """``(step, params)`` of the newest checkpoint that restores and verifies (or of
  ``step``), shaped as ``abstract_params``, on the local device: see
  :func:`posenc_jax.training.checkpoint.restore_params` (damaged steps are skipped
  with a warning; a parameter tree other than the model's is an :class:`AnalysisError`
  saying what differs)."""
  from posenc_jax.training import checkpoint  # noqa: PLC0415
  try:
    return checkpoint.restore_params(workdir, abstract_params, step=step)
  except checkpoint.CheckpointError as e:
    raise AnalysisError(str(e)) from None


def run_config(workdir: str, config: Any = None) -> Any:
  """The config of the run in ``workdir``: the ``config.json`` it recorded, or ``config``
  when given, which must then describe the same model (its ``ARCHITECTURE`` fields).

  Raises:
    AnalysisError: ``config`` is another model, neither it nor ``config.json`` is there, or
      ``config.json`` is not one a run writes (a torn or foreign file: the trainer's line).
  """
  from posenc_jax.training.workdir import (WorkdirError,  # noqa: PLC0415
                                           architecture_differences, resolved_model,
                                           saved_config)

  try:
    saved = saved_config(workdir)
  except WorkdirError as e:
    raise AnalysisError(str(e)) from None
  if saved is None:
    if config is None:
      raise AnalysisError(f"config: required; the workdir {workdir!r} has no config.json "
                          "(give the run's --config)")
    return config
  if config is None:
    return saved
  diffs = architecture_differences(saved["model"], resolved_model(_resolve(config)[0]))
  if diffs:
    raise AnalysisError(f"config: {diffs[0].replace(' there,', ' in the workdir,', 1)}: not "
                        "the model the run trained; drop --config to analyse the run's "
                        "(its config.json)")
  return config


def from_checkpoint(workdir: str, config: Any = None, *, step: int | None = None
                    ) -> LoadedModel:
  """The encoder of a train.py (or fine-tuning) checkpoint, or a language model's
  positional view.

  Args:
    workdir: the run's ``--workdir``.
    config: None (the run's ``config.json``) or the run's config
      (``"configs/pretrain.py:bert_tiny,diet_abs_share"``, a ConfigDict with ``model`` and
      ``head``, ...), checked against ``config.json`` by :func:`run_config`.
    step: a saved step; None takes the newest that restores.
  """
  from posenc_jax.models.build import abstract_params, build_model  # noqa: PLC0415
  cfg, head, num_labels, _ = _resolve(run_config(workdir, config))
  check_model(cfg, head)
  model = build_model(cfg, head, num_labels=num_labels)
  step, params = restore_params(workdir, abstract_params(model), step=step)
  return loaded(cfg, head, params, f"checkpoint:{absolute(workdir)}@{step}", step)


def from_hf(model_dir: str | os.PathLike | None = None) -> LoadedModel:
  """A pretrained Hugging Face BERT folder (``config.json``, ``model.safetensors``,
  ``vocab.txt``) via :func:`posenc_jax.convert.load_hf_bert`; None: the MiniLM package's."""
  from posenc_jax.convert import load_hf_bert, package_model_dir, vocab_path  # noqa: PLC0415
  model_dir = package_model_dir() if model_dir is None else pathlib.Path(model_dir)
  cfg, variables, _ = load_hf_bert(model_dir)
  return LoadedModel(cfg, BertEncoder(cfg), {"params": nn.unbox(variables["params"])},
                     wordpiece_tokens(vocab_path(model_dir)), f"hf:{model_dir}")


def load(*, config: Any = None, workdir: str | None = None, hf_dir: str | None = None,
         seed: int = 0, step: int | None = None, name: str | None = None) -> LoadedModel:
  """One of the three sources: ``hf_dir``; ``workdir`` (with its ``config.json``, or
  ``config``); or ``config`` alone (fresh, named ``name`` in its ``source``)."""
  if hf_dir is not None:
    if workdir is not None or config is not None:
      raise AnalysisError("hf_dir: give either a Hugging Face folder, or a config "
                          "(with a workdir for a checkpoint), not both")
    return from_hf(hf_dir)
  if workdir is not None:
    return from_checkpoint(workdir, config, step=step)
  if config is None:
    raise AnalysisError("config: required (a preset or configs/<file>.py:<presets>), or give "
                        "workdir or hf_dir")
  return from_config(config, seed=seed, name=name)
