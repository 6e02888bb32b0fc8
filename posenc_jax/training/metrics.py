"""Training metrics: JSON lines and TensorBoard events in the workdir, a compact console line.

Throughput follows t5x: steps/s, tokens/s, tokens/s per device, the
compile time (the first step, excluded from rates), an ETA, and MFU where
the device's peak FLOP/s is known.

MFU is ``train_flops_per_step * steps/s / (sum of the devices' peak FLOP/s)``:

* :func:`train_flops_per_step` counts the matmul FLOPs of the model the loop
  runs, from its :class:`~posenc_jax.models.ModelConfig` (layers, attention,
  folded positional terms, the head), 3 x the forward pass for training.
* :func:`peak_flops` looks the device up in :data:`PEAK_FLOPS` by the exact
  ``jax.Device.device_kind`` JAX reports, per JAX device, for the model's
  compute dtype. A device it does not know gets no MFU, never a guessed one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from etils import epath

from posenc_jax.paths import write_atomic
from posenc_jax.models.config import (HEADS, ModelConfig, causal_variant, model_config,
                                      position_schemes, scheme_dims)
from posenc_jax.schemes.base import is_int
from posenc_jax.schemes.registry import SchemePart, scheme_parts
from posenc_jax.training.workdir import METRICS_FILE, WorkdirError, read_metrics

# Dense (no 2:4 sparsity) peak FLOP/s of one JAX device, ``(bfloat16, float32)``, keyed by the
# exact ``jax.Device.device_kind``. "float32" is the rate of JAX's default precision for
# float32 matmuls: TF32 on NVIDIA Ampere and later (jax-ml/jax#18934, #4873), one bfloat16
# pass on TPU (jax-ml/jax#1856), so on TPU both columns are the bf16 peak. Attention run with
# ``attention_precision='float32'`` (exact) is slower than that rate, so its MFU reads lower.
#
# TPUs: Cloud TPU "system architecture" pages (cloud.google.com/tpu/docs/<version>) give the
# bf16 peak per chip; JAX's jax/_src/tpu_info.py gives TensorCores per chip and which chips
# run megacore (both cores as one JAX device). A JAX device of v2, v3 and TPU7x is one
# TensorCore, half a chip; of v4 and v5p (megacore) the whole chip. Kind strings: the ones
# jax/_src/tpu_info.py ``chip_version_from_device_kind`` accepts (devices report the first of
# each pair: "TPU v5 lite", "TPU v5", "TPU v6 lite"; "TPU v5e", "TPU v5p", "TPU v6e" are the
# aliases it also takes).
#
# GPUs: the CUDA device name (JAX's device_kind), one GPU per JAX device. Peaks from NVIDIA's
# datasheets, which print the tensor-core rates with sparsity: the dense rate is half.
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    # v2: 45 TFLOP/s bf16 per chip (cloud.google.com/tpu/docs/v2), 2 TensorCores.
    "TPU v2": (22.5e12, 22.5e12),
    # v3: 123 TFLOP/s bf16 per chip (cloud.google.com/tpu/docs/v3), 2 TensorCores. (JAX's
    # tpu_info.py has 140 per chip; the Cloud page and 2 cores x 2 MXUs x 128^2 x 2 x 940 MHz
    # give 123.)
    "TPU v3": (61.5e12, 61.5e12),
    # v4: 275 per chip (cloud.google.com/tpu/docs/v4), megacore: one device per chip.
    "TPU v4": (275e12, 275e12),
    # v4i: no Cloud page; 137 per chip, 1 TensorCore, from JAX's tpu_info.py.
    "TPU v4 lite": (137e12, 137e12),
    # v5e: 197 per chip (cloud.google.com/tpu/docs/v5e), 1 TensorCore.
    "TPU v5 lite": (197e12, 197e12),
    "TPU v5e": (197e12, 197e12),
    # v5p: 459 per chip (cloud.google.com/tpu/docs/v5p), megacore: one device per chip.
    "TPU v5": (459e12, 459e12),
    "TPU v5p": (459e12, 459e12),
    # v6e (Trillium): 918 per chip (cloud.google.com/tpu/docs/v6e), 1 TensorCore.
    "TPU v6 lite": (918e12, 918e12),
    "TPU v6e": (918e12, 918e12),
    # TPU7x (Ironwood): 2307 per chip (cloud.google.com/tpu/docs/tpu7x), 2 TensorCores, no
    # megacore: one device per TensorCore.
    "TPU7x": (1153.5e12, 1153.5e12),
    # A100, every board: BF16 312, TF32 156 dense (NVIDIA A100 datasheet).
    "NVIDIA A100-SXM4-40GB": (312e12, 156e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 156e12),
    "NVIDIA A100-PCIE-40GB": (312e12, 156e12),
    "NVIDIA A100 80GB PCIe": (312e12, 156e12),
    # H100 SXM5: BF16 989.4, TF32 494.7 dense (NVIDIA H100 Tensor Core GPU Architecture
    # whitepaper, table 3); H100 PCIe: 756, 378 (same table).
    "NVIDIA H100 80GB HBM3": (989.4e12, 494.7e12),
    "NVIDIA H100 PCIe": (756e12, 378e12),
    # H100 NVL: BF16 1671, TF32 835 with sparsity (NVIDIA H100 datasheet, H100 NVL column).
    "NVIDIA H100 NVL": (835.5e12, 417.5e12),
    # GH200 (its H100-class GPU): BF16 1979, TF32 989 with sparsity (NVIDIA GH200 datasheet).
    "NVIDIA GH200 480GB": (989.5e12, 494.5e12),
    # H200 SXM: BF16 1979, TF32 989 with sparsity; H200 NVL: 1671, 835 (NVIDIA H200 datasheet).
    "NVIDIA H200": (989.5e12, 494.5e12),
    "NVIDIA H200 NVL": (835.5e12, 417.5e12),
    # B200 (HGX, 1000 W): BF16 4.5 PFLOP/s, TF32 2.2 PFLOP/s per GPU with sparsity (NVIDIA
    # HGX B200 datasheet).
    "NVIDIA B200": (2250e12, 1100e12),
}
# Kinds whose JAX device is a megacore (two TensorCores) by default; a device that reports
# ``num_cores`` (JAX's TPU devices do) is rated ``num_cores / 2`` of the chip (split mode: 1).
MEGACORE_KINDS = ("TPU v4", "TPU v5", "TPU v5p")
# Prefix rules, tried after an exact match: ``(prefix, table key)``. The kind must be the
# prefix or go on with " " or "-". A100 boards differ in memory only (one datasheet peak);
# GH200 names carry the memory size ("NVIDIA GH200 480GB", "NVIDIA GH200 120GB", ...).
# Never a prefix for H100 or H200: SXM, PCIe and NVL boards have different peaks.
PEAK_PREFIXES = (("NVIDIA A100", "NVIDIA A100-SXM4-80GB"),
                 ("NVIDIA GH200", "NVIDIA GH200 480GB"))
PEAK_DTYPES = ("bfloat16", "float32")


def peak_flops_for_kind(kind: str, dtype: Any = "bfloat16", num_cores: int | None = None
                        ) -> float | None:
  """Dense peak FLOP/s of one JAX device of ``kind``, or None when unknown.

  Args:
    kind: a ``jax.Device.device_kind``. Matched exactly, then by :data:`PEAK_PREFIXES`; a MIG
      slice of a GPU (" MIG " in the name) has a fraction of the GPU's peak and is unknown.
    dtype: the model's compute dtype (``bfloat16`` or ``float32``; others are unknown).
    num_cores: TensorCores the device drives (``jax.Device.num_cores`` on TPU), for the
      megacore kinds; None keeps the default (megacore, the whole chip).

  Returns:
    FLOP/s, or None.
  """
  try:
    column = PEAK_DTYPES.index(jnp.dtype(dtype).name)
  except (TypeError, ValueError):
    return None
  if "MIG" in kind.split():
    return None
  key = kind if kind in PEAK_FLOPS else None
  for prefix, target in PEAK_PREFIXES:
    if key is None and kind.startswith(prefix) and kind[len(prefix):len(prefix) + 1] in " -":
      key = target
  if key is None:
    return None
  flops = PEAK_FLOPS[key][column]
  if key in MEGACORE_KINDS and is_int(num_cores) and num_cores > 0:
    flops *= num_cores / 2
  return flops


def peak_flops(device: jax.Device | None = None, dtype: Any = "bfloat16") -> float | None:
  """Dense peak FLOP/s of ``device`` (None: the first device) for ``dtype``, or None when
  unknown (CPUs, kinds not in :data:`PEAK_FLOPS`). The bfloat16 default is the higher of the
  two columns, so a caller that omits the dtype never overstates MFU."""
  device = jax.devices()[0] if device is None else device
  return peak_flops_for_kind(device.device_kind, dtype, getattr(device, "num_cores", None))


# --- Analytic FLOPs of the model the loop runs -------------------------------------------------


def _attention(cfg: ModelConfig, q_len: int, k_len: int, *, rank: int = 0,
               causal: bool = False, linformer: bool = False) -> int:
  """Forward FLOPs of one attention block for one example: the q/k/v/o projections, the
  sequence projections of Linformer's layer input, ``Q K^T`` over the head dim plus the
  folded rank, and ``P V``. Causal halves ``Q K^T`` and ``P V``."""
  inner = cfg.num_heads * cfg.dim_per_head
  keys, flops = k_len, 0
  if linformer:  # E X and F X along the sequence (one when E = F), then W_K, W_V on k rows
    keys = cfg.linformer_k
    flops = (2 if cfg.linformer_sharing == "none" else 1) * 2 * keys * k_len * cfg.d_model
  flops += 2 * cfg.d_model * inner * (2 * q_len + 2 * keys)
  mixing = 2 * cfg.num_heads * q_len * keys * (2 * cfg.dim_per_head + rank)
  return flops + (mixing // 2 if causal else mixing)


def _mlp(cfg: ModelConfig, tokens: int) -> int:
  return 2 * 2 * cfg.d_model * cfg.mlp_dim * tokens


def _stack(cfg: ModelConfig, num_layers: int, length: int,
           schemes: tuple[tuple[SchemePart, ...], tuple[SchemePart, ...]],
           shared: tuple[SchemePart, ...] = (), **attention: bool) -> int:
  """Forward FLOPs of one example through ``num_layers`` layers of self-attention over
  ``length`` tokens and MLP, with the position scheme's parts and the alternate scheme's
  (``schemes``; the latter on the layers ``cfg.alternate_layers`` marks) and the ``shared``
  parts on every layer: the folded rank each adds to ``Q K^T``, its terms' work in each of
  its layers, and its own once per pass (the classes'
  :meth:`~posenc_jax.schemes.Scheme.folded_rank`, ``layer_flops`` and ``input_flops``).
  ``attention``: :func:`_attention`'s ``causal`` and ``linformer``."""
  dims = scheme_dims(cfg, num_layers)

  def layer(parts):
    rank = sum(p.module.folded_rank(p.values, cfg.dim_per_head) for p in parts)
    return (_attention(cfg, length, length, rank=rank, **attention) + _mlp(cfg, length)
            + sum(p.module.layer_flops(p.values, dims, length) for p in parts))

  own, other = schemes
  alternate = sum(cfg.alternate_layers(num_layers))
  flops = (num_layers - alternate) * layer(own + shared) + (
      alternate * layer(other + shared) if alternate else 0)
  return flops + sum(p.module.input_flops(p.values, dims, length) for p in own + other + shared)


def _position_parts(cfg: ModelConfig, causal: bool = False
                    ) -> tuple[tuple[SchemePart, ...], tuple[SchemePart, ...]]:
  """The parts of the position scheme and of the alternate scheme (none without its
  interval), in their causal forms for a decoder."""
  parts = [scheme_parts(causal_variant(form) if causal else form)
           for _, form in position_schemes(cfg)]
  return parts[0], parts[1] if len(parts) > 1 else ()


def _encoder(cfg: ModelConfig, length: int) -> int:
  """Forward FLOPs of the encoder stack for one example of ``length`` tokens."""
  segment = () if cfg.segment is None else scheme_parts(cfg.segment)
  return _stack(cfg, cfg.num_layers, length, _position_parts(cfg), segment,
                linformer=cfg.attention == "linformer")


def _decoder(cfg: ModelConfig, num_layers: int, length: int,
             source_length: int | None = None) -> int:
  """Forward FLOPs of a decoder stack of ``num_layers`` layers for one example: causal
  self-attention with the scheme's causal form, content-only cross-attention to
  ``source_length`` states (None: decoder-only, none), MLP."""
  flops = _stack(cfg, num_layers, length, _position_parts(cfg, causal=True), causal=True)
  if source_length is not None:
    flops += num_layers * _attention(cfg, length, source_length)
  return flops


def _fail(field: str, value: Any, allowed: str) -> None:
  raise ValueError(f"train_flops_per_step: {field}: got {value!r}; allowed: {allowed}")


def train_flops_per_step(cfg: ModelConfig | Mapping[str, Any], batch: int, length: int, *,
                         target_length: int | None = None,
                         predictions_per_seq: int | None = None, head: str | None = None,
                         num_labels: int = 2) -> float:
  """Analytic matmul FLOPs of one training step of the model ``cfg`` builds (3 x forward).

  Counted per example, 2 FLOPs per multiply-add, from the config alone (what each scheme
  adds, its class says: :meth:`~posenc_jax.schemes.Scheme.folded_rank`, ``layer_flops``
  and ``input_flops``):

  * each encoder layer: the q/k/v/o projections ``4 x 2 L d HD``, the MLP ``2 x 2 L d F``,
    ``Q K^T`` ``2 H L^2 (D + r)`` and ``P V`` ``2 H L^2 D``, where ``r`` is the rank the
    fused attention route folds into q and k (DIET-ABS(-LIN) ``d_p``, TUPE ``D`` (+2 with
    the [CLS] reset), per-head segments ``n_seg``); Shaw's and the sinusoidal RPE's
    query-offset products ``2 H L (2t + 1) D`` (twice with a value table); under
    Linformer the layer input projected along the sequence, ``2 k L d`` (twice unless
    ``E = F``), the key and value projections on its ``k`` rows, and attention over ``k``
    keys;
  * embeddings: lookups cost nothing; BERT's token-type one-hot times its table,
    ``2 L n_seg d``, and the per-head segments' ``u``, ``2 L n_seg^2`` per table;
  * the head: MLM transform and tied decoder ``2 d^2 + 2 d V`` at every position, or at
    ``P = predictions_per_seq`` positions plus their one-hot selection from the hidden
    states, ``2 P L d`` (a matmul, so that no gather or scatter runs); the classifier's
    pooler and output ``2 d^2 + 2 d C``; span logits ``2 L d 2``; the encoder head's pooler
    ``2 d^2`` when the config has one (the MLM and span models drop the pooled vector, and
    so does XLA);
  * the encoder-decoder: the encoder over ``length`` source tokens; per decoder layer causal
    self-attention (``Q K^T`` and ``P V`` halved: ``L_t^2 / 2`` of the pairs), cross-attention
    (q and o over the ``L_t`` targets, k and v over the ``length`` sources, ``2 H L_t L_s D``
    twice) and the MLP; the output projection ``2 d V`` per target token;
  * the causal language model (head ``lm``): ``num_layers`` decoder layers without
    cross-attention over ``length`` tokens, and the output projection ``2 d V`` per token.

  Left out: softmax, LayerNorm, activations, biases, dropout (not matmuls); a scheme's
  batch-free work, done once per forward pass whatever the batch (TUPE's and BERT-A^d's
  position projections, Toeplitz bias tables, DIET-ABS's ``P_Q P_K^T`` where the reference
  route materialises it instead of folding: the count follows the fused route that GPUs
  and TPUs run); the padding of a folded head dim to a multiple of 8 (zeros, no model
  FLOPs).

  Args:
    cfg: the model config (a :class:`ModelConfig`, or a dict/ConfigDict of its fields).
    batch: examples per step (the global batch, all micro-batches).
    length: tokens per example; the source length of an encoder-decoder.
    target_length: target tokens per example of an encoder-decoder (None: ``length``).
    predictions_per_seq: MLM positions per example the head runs at (None: all ``length``).
    head: ``mlm``, ``encoder``, ``classification``, ``span``, ``translation`` or ``lm``
      (None: ``translation`` for a config with decoder layers, else ``mlm``).
    num_labels: the classifier's outputs (1 for regression).

  Returns:
    FLOPs of one training step.

  Raises:
    ValueError: one line naming an argument that does not fit the model.
  """
  cfg = cfg if isinstance(cfg, ModelConfig) else model_config(cfg)
  if head is None:
    head = "translation" if cfg.num_decoder_layers else "mlm"
  if head not in HEADS:
    _fail("head", head, ", ".join(HEADS))
  for field, value in (("batch", batch), ("length", length)):
    if not (is_int(value) and value > 0):
      _fail(field, value, "a positive integer")
  if (head == "translation") != bool(cfg.num_decoder_layers):
    _fail("head", head, "'translation' exactly when the model has decoder layers "
          f"(num_decoder_layers={cfg.num_decoder_layers})")
  if target_length is not None and head != "translation":
    _fail("target_length", target_length, "None for a model without a decoder")
  if target_length is not None and not (is_int(target_length) and target_length > 0):
    _fail("target_length", target_length, "a positive integer or None")
  if predictions_per_seq is not None and (
      head != "mlm" or not (is_int(predictions_per_seq) and 0 < predictions_per_seq <= length)):
    _fail("predictions_per_seq", predictions_per_seq,
          f"None, or with head 'mlm' an integer in [1, length={length}]")
  if not (is_int(num_labels) and num_labels > 0):
    _fail("num_labels", num_labels, "a positive integer")

  d, vocab = cfg.d_model, cfg.vocab_size
  if head == "translation":
    target = length if target_length is None else target_length
    forward = (_encoder(cfg, length) + _decoder(cfg, cfg.num_decoder_layers, target, length)
               + 2 * d * vocab * target)
  elif head == "lm":
    forward = _decoder(cfg, cfg.num_layers, length) + 2 * d * vocab * length
  else:
    forward = _encoder(cfg, length)
    if head == "mlm":
      if predictions_per_seq is None:
        forward += length * (2 * d * d + 2 * d * vocab)
      else:
        forward += predictions_per_seq * (2 * length * d + 2 * d * d + 2 * d * vocab)
    elif head == "classification":
      forward += 2 * d * d + 2 * d * num_labels
    elif head == "span":
      forward += 2 * length * d * 2
    elif cfg.pooler:  # encoder
      forward += 2 * d * d
  return 3.0 * batch * forward


class Throughput:
  """Rates over the steps since the last report, compilation excluded.

  Args:
    total_steps: for the ETA.
    tokens_per_step: global tokens in one step.
    flops_per_step: analytic FLOPs of one step (None: no MFU).
    dtype: the model's compute dtype, which picks the peak (:func:`peak_flops`); the
      bfloat16 default is the higher peak, so MFU is never overstated.
  """

  def __init__(self, total_steps: int, tokens_per_step: int, flops_per_step: float | None = None,
               *, dtype: Any = "bfloat16"):
    self.total_steps = total_steps
    self.tokens_per_step = tokens_per_step
    self.flops_per_step = flops_per_step
    self.dtype = dtype
    self.compile_seconds: float | None = None
    self._mark: tuple[int, float] | None = None
    self._peak: float | None = None

  def peak(self) -> float | None:
    """Summed peak FLOP/s of every device of the job (None if any one is unknown)."""
    if self._peak is None:
      peaks = [peak_flops(device, self.dtype) for device in jax.devices()]
      self._peak = 0.0 if None in peaks else float(sum(peaks))
    return self._peak or None

  def start(self, step: int) -> None:
    """Call once the first (compiling) step has finished."""
    self._mark = (step, time.perf_counter())

  def report(self, step: int) -> dict[str, float]:
    """Rates since the previous report: steps/s, tokens/s (also per device), ETA in
    seconds, and ``mfu`` (a fraction of 1) where the devices' peak is known."""
    if self._mark is None:
      return {}
    last_step, last_time = self._mark
    now = time.perf_counter()
    self._mark = (step, now)
    if step <= last_step:
      return {}
    steps_per_s = (step - last_step) / max(now - last_time, 1e-9)
    tokens = steps_per_s * self.tokens_per_step
    out = {"steps_per_s": steps_per_s, "tokens_per_s": tokens,
           "tokens_per_s_per_device": tokens / jax.device_count(),
           "eta_s": (self.total_steps - step) / steps_per_s}
    peak = self.peak()
    if self.flops_per_step and peak:
      out["mfu"] = self.flops_per_step * steps_per_s / peak
    return out


def _truncate_after(path: epath.Path, step: int) -> None:
  """Keeps the records of ``path`` (:data:`~posenc_jax.training.workdir.METRICS_FILE`) up to
  ``step``, each on its own line; a torn last line is dropped with a warning (the record of
  a later step, recomputed now). Replaced atomically, and only when that changes it."""
  records, torn = read_metrics(path)
  if torn is not None:
    logging.warning("%s: dropped its last line, torn by a killed write (%r); its step is "
                    "recomputed", path, torn[:60])
  kept = "".join(line + "\n" for s, line in records if s <= step)
  if not path.exists() or kept == path.read_text():
    return
  write_atomic(path, kept)


EVENTS_PREFIX = "posencjax"  # tensorboardX opens "<prefix>://<path>" through _EventFiles


class _GuardedFile:
  """An event file that never raises into tensorboardX (whose writer thread and exit hook
  would print tracebacks after the run's one line): the first ``OSError`` is kept in
  ``error``, the file is closed, and every later write, flush and close does nothing."""

  def __init__(self, file: Any):
    self._file, self.error = file, None

  def _do(self, name: str, *args: Any) -> None:
    if self.error is not None:
      return
    try:
      getattr(self._file, name)(*args)
    except OSError as e:
      self.error = e
      with contextlib.suppress(OSError):
        self._file.close()

  def write(self, data: bytes) -> None:
    self._do("write", data)

  def flush(self) -> None:
    self._do("flush")

  def close(self) -> None:
    self._do("close")


class _EventFiles:
  """The tensorboardX writer factory of every run's event files (registered once, under
  :data:`EVENTS_PREFIX`): files opened through ``etils.epath`` (so a ``gs://`` workdir gets
  its events where TensorBoard reads them; tensorboardX's own GCS writer needs the
  google-cloud-storage client), each a :class:`_GuardedFile` kept by path."""

  def __init__(self):
    self.files: dict[str, _GuardedFile] = {}

  @staticmethod
  def path(uri: str) -> str:
    return uri.removeprefix(f"{EVENTS_PREFIX}://")

  def open(self, uri: str) -> _GuardedFile:
    file = _GuardedFile(epath.Path(self.path(uri)).open("wb"))
    self.files[self.path(uri)] = file
    return file

  def directory_check(self, uri: str) -> None:
    folder = epath.Path(self.path(uri))
    if folder.exists() and not folder.is_dir():  # mkdir would say "File exists"
      raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
    folder.mkdir(parents=True, exist_ok=True)

  def error(self, folder: str) -> OSError | None:
    """The first failed write of an event file in ``folder``, if any."""
    return next((f.error for path, f in self.files.items()
                 if path.startswith(folder.rstrip("/") + "/") and f.error is not None), None)


_EVENT_FILES = _EventFiles()


class MetricWriter:
  """Writes scalars to ``<workdir>/metrics.jsonl`` and TensorBoard events (host 0 only).

  A run resumed at ``start_step`` first drops the file's lines of later steps
  (written after that checkpoint by the interrupted run, and about to be
  recomputed; a torn last line with a warning), so every step appears once;
  TensorBoard hides those steps' events (``purge_step``). A write that fails (a
  read-only file, a full disk) is one :class:`~posenc_jax.training.workdir.WorkdirError`
  line, and nothing is written or retried after it (at exit neither).
  """

  def __init__(self, workdir: str, start_step: int = 0):
    self.active = jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    if self.active:
      folder = epath.Path(workdir)
      self.path = folder / METRICS_FILE
      self._events = str(folder / "tensorboard")
      with self._writing(folder):
        folder.mkdir(parents=True, exist_ok=True)
        _truncate_after(self.path, start_step)
        self._jsonl = self.path.open("a")
        from tensorboardX import SummaryWriter, record_writer  # noqa: PLC0415
        record_writer.register_writer_factory(EVENTS_PREFIX, _EVENT_FILES)
        self._tb = SummaryWriter(f"{EVENTS_PREFIX}://{self._events}",
                                 purge_step=start_step + 1 if start_step else None)

  @contextlib.contextmanager
  def _writing(self, path: epath.Path):
    """Turns a failed write under ``path`` (read-only, disk full) into one line, after
    closing the files (their unwritten buffers dropped)."""
    try:
      yield
      error = _EVENT_FILES.error(self._events) if self._tb is not None else None
      if error is not None:
        raise error
    except OSError as e:
      self._abandon()
      raise WorkdirError(f"workdir: writing {e.filename or path} failed "
                         f"({e.strerror or e})") from None

  def _abandon(self) -> None:
    jsonl, self._jsonl = self._jsonl, None
    if jsonl is not None:
      with contextlib.suppress(OSError):
        jsonl.close()  # closes the descriptor even where the flush fails
    if self._tb is not None:
      tb, self._tb = self._tb, None
      with contextlib.suppress(OSError):
        tb.close()
    self.active = False

  def write(self, step: int, scalars: dict[str, Any]) -> None:
    if not self.active:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    with self._writing(self.path):
      self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
      self._jsonl.flush()
    with self._writing(self.path.parent / "tensorboard"):
      for name, value in scalars.items():
        if math.isfinite(value):
          self._tb.add_scalar(name, value, step)
      self._tb.flush()

  def close(self) -> None:
    if self.active:
      with self._writing(self.path):
        self._jsonl.close()
        self._tb.close()


def console_line(step: int, total: int, scalars: dict[str, float]) -> str:
  """``step 120/1000 ( 12%) loss 6.912 acc 0.041 lr 1.2e-04 | 8.1 steps/s ETA 1m48s``."""
  eta = scalars.get("eta_s")
  eta_text = f" ETA {int(eta // 60)}m{int(eta % 60):02d}s" if eta is not None else ""
  rate = f" | {scalars['steps_per_s']:.2f} steps/s" if "steps_per_s" in scalars else ""
  parts = [f"step {step}/{total} ({100 * step / total:3.0f}%)"]
  for key, label, fmt in (("loss", "loss", ".4f"), ("accuracy", "acc", ".3f"),
                          ("learning_rate", "lr", ".2e"), ("grad_norm", "gnorm", ".3f")):
    if key in scalars:
      parts.append(f"{label} {scalars[key]:{fmt}}")
  return " ".join(parts) + rate + eta_text


def eval_line(step: int, scalars: dict[str, float]) -> str | None:
  """``eval at step 100: loss 6.8123 ppl 908.3 (unigram 978.1) acc 0.052 | task bleu 12.40``:
  the evaluation's loss, perplexity (pre-training) beside the unigram model's of the same
  tokens, and accuracy, then the task's metrics; None without an evaluation in ``scalars``."""
  parts = [text.format(scalars[key])
           for key, text in (("eval_loss", "loss {:.4f}"), ("eval_perplexity", "ppl {:.1f}"),
                             ("eval_unigram_perplexity", "(unigram {:.1f})"),
                             ("eval_accuracy", "acc {:.3f}"))
           if key in scalars]
  task = [f"{key.removeprefix('task_')} {value:.2f}" for key, value in sorted(scalars.items())
          if key.startswith("task_")]
  groups = [" ".join(parts)] if parts else []
  if task:
    groups.append("task " + " ".join(task))
  return f"eval at step {step}: {' | '.join(groups)}" if groups else None
