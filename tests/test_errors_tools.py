"""Every bad flag of the command-line tools (``train.py``, ``python -m
posenc_jax.benchmarks.steps``, ``.params``, ``.analysis``) is one line naming the flag, what was
given and what is allowed, and stops the tool before it prints, compiles or writes anything
(``finetune.py``'s own fields: tests/test_errors_finetune.py).

Each case runs the tool in a process of its own, forked from one that has imported the libraries
(tests/forked_cli.py: 0.1 s a case against 1.5-7 s for a plain subprocess); the cases run two at
a time.
"""

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import forked_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "--config=configs/model.py:bert_tiny,alibi"
RUN = "--workdir={tmp}/run"  # train.py's workdir: never created by a bad flag

# (tool, arguments, start of the error line, texts in it). In arguments and texts, {dir} is an
# empty directory, {file} a file and {ro} a directory the tool cannot write into.
CASES = [
    # train.py: the config argument, overrides of every kind of field, the workdir.
    ("train.py", ["--config=configs/pretrain.py:bert_tiny,diet_abz", RUN],
     "train.py: config preset:", ["'diet_abz' is unknown", "did you mean 'diet_abs'?"]),
    ("train.py", ["--config=configs/pretrain.py:bert_base,diet_protocl", RUN],
     "train.py: config preset:", ["'diet_protocl' is unknown"]),
    ("train.py", ["--config=configs/pretrain.py:bert_tny", RUN], "train.py: config preset:",
     ["'bert_tny' is not a model size", "did you mean 'bert_tiny'?"]),
    ("train.py", ["--config=configs/nope.py", RUN], "train.py: config:",
     ["'configs/nope.py' does not load", "No such file"]),
    ("train.py", ["--config.totl_steps=3", RUN], "train.py: config.totl_steps: unknown field",
     ["did you mean 'total_steps'?"]),
    ("train.py", ["--config.model.dtpe=bfloat16", RUN],
     "train.py: config.model.dtpe: unknown field", ["did you mean 'dtype'?"]),
    ("train.py", ["--config.optimizer.lr=3", RUN], "train.py: config.optimizer.lr: unknown field",
     ["fields of config.optimizer: b1"]),
    ("train.py", ["--config.total_steps=abc", RUN], "train.py: --config.total_steps=abc:",
     ["invalid literal for int() with base 10: 'abc'"]),
    ("train.py", ["--config.async_checkpointing=maybe", RUN],
     "train.py: --config.async_checkpointing=maybe:", ["Non-boolean argument"]),
    ("train.py", ["--config.total_steps=0", RUN], "train.py: total_steps:",
     ["got 0", "a positive integer"]),
    ("train.py", ["--config.batch_size=-1", RUN], "train.py: batch_size:", ["got -1"]),
    ("train.py", ["--config.seq_len=1", RUN], "train.py: seq_len:", ["got 1", ">= 2"]),
    ("train.py", ["--config.mask_rate=0.0", RUN], "train.py: mask_rate:", ["got 0.0", "(0, 1]"]),
    ("train.py", ["--config.mask_rate=1.5", RUN], "train.py: mask_rate:", ["got 1.5"]),
    ("train.py", ["--config.eval_steps=-1", RUN], "train.py: eval_steps:", ["got -1"]),
    ("benchmarks.pipeline", ["--hosts=0"], "posenc_jax.benchmarks.pipeline: --hosts:",
     ["got 0; allowed: a positive integer"]),
    ("benchmarks.pipeline", ["--json={dir}"], "posenc_jax.benchmarks.pipeline: --json:",
     ["is a directory"]),
    ("train.py", ["--config.cache_data=sometimes", RUN], "train.py: cache_data:",
     ["got 'sometimes'", "auto, true, false"]),
    ("train.py", ["--config.data_sharding=files", RUN], "train.py: data_sharding:",
     ["got 'files'", "'source' or 'stream'"]),
    ("train.py", ["--config.eval_every=-5", RUN], "train.py: eval_every:", ["got -5", ">= 0"]),
    ("train.py", ["--config.log_every=0", RUN], "train.py: log_every:", ["got 0"]),
    ("train.py", ["--config.keep_checkpoints=0", RUN], "train.py: keep_checkpoints:", ["got 0"]),
    ("train.py", ["--config.seed=-1", RUN], "train.py: seed:", ["got -1"]),
    ("train.py", ["--config.label_smoothing=1.0", RUN], "train.py: label_smoothing:",
     ["got 1.0", "[0, 1)"]),
    ("train.py", ["--config.objective=mlmm", RUN], "train.py: objective:",
     ["got 'mlmm'", "did you mean 'mlm'?"]),
    ("train.py", ["--config.head=classification", RUN], "train.py: head:",
     ["got 'classification'", "'mlm' for objective 'mlm'"]),
    ("train.py", ["--config.grad_accum_steps=3", RUN], "train.py: batch_size:",
     ["got 32", "a multiple of grad_accum_steps=3"]),
    ("train.py", ["--config.optimizer.grad_clip_norm=-1.0", RUN],
     "train.py: optimizer.grad_clip_norm:", ["got -1.0"]),
    ("train.py", ["--config.optimizer.b1=1.5", RUN], "train.py: optimizer.b1:",
     ["got 1.5", "[0, 1)"]),
    ("train.py", ["--config.optimizer.b2=-0.1", RUN], "train.py: optimizer.b2:", ["got -0.1"]),
    ("train.py", ["--config.optimizer.eps=0.0", RUN], "train.py: optimizer.eps:", ["got 0.0"]),
    ("train.py", ["--config.optimizer.learning_rate=inf", RUN],
     "train.py: optimizer.learning_rate:", ["got inf", "finite"]),
    ("train.py", ["--config.optimizer.name=adamm", RUN], "train.py: optimizer.name:",
     ["got 'adamm'", "did you mean 'adam"]),
    ("train.py", ["--config.optimizer.name=adam", RUN], "train.py: optimizer.weight_decay:",
     ["got 0.01", "use 'adamw'"]),
    ("train.py", ["--config.optimizer.position_lr_scale=0.0", RUN],
     "train.py: optimizer.position_lr_scale:", ["got 0.0", "positive"]),
    ("train.py", ["--config.optimizer.schedule=cosine", RUN], "train.py: optimizer.schedule:",
     ["got 'cosine'"]),
    ("train.py", ["--config.optimizer.warmup_steps=100000", RUN],
     "train.py: optimizer.warmup_steps:", ["got 100000", "total_steps=600"]),
    ("train.py", ["--config.model.dtype=float16", RUN], "train.py: model.dtype:",
     ["got 'float16'", "bfloat16"]),
    ("train.py", ["--config.model.head_dim=-3", RUN], "train.py: model.head_dim:", ["got -3"]),
    ("train.py", ["--config.model.max_len=32", RUN], "train.py: seq_len:",
     ["64 exceeds model.max_len=32", "'diet_abs'"]),
    ("train.py", ["--config.model.route=fast", RUN], "train.py: model.route:",
     ["got 'fast'", "fused"]),
    ("train.py", ["--config.model.scheme.name=diet_abz", RUN], "train.py: model.scheme:",
     ["'diet_abz'", "did you mean 'diet_abs'?"]),
    ("train.py", ["--config.model.scheme.rank=0", RUN], "train.py: model.scheme:",
     ["rank", "got 0"]),
    ("train.py", ["--config.mesh.shape=(3,1)", RUN], "train.py: mesh.shape:",
     ["(3, 1) does not divide the 1 devices"]),
    ("train.py", ["--config.mesh.axes=('batch','model')", RUN], "train.py: mesh.axes:",
     ["('batch', 'model')", "including 'data'"]),
    ("train.py", ["--config.mesh.rules=(('batch','dp'),)", RUN], "train.py: mesh.rules:",
     ["mesh axis 'dp'"]),
    ("train.py", ["--config.model.vocab_size=100", RUN], "train.py: model.vocab_size:",
     ["100 is smaller than task 'wordnet_glosses'"]),
    ("train.py", ["--config.task=glue_nope", RUN], "train.py: task:",
     ["'glue_nope' is not a registered seqio task"]),
    ("train.py", ["--workdir={file}/run"], "train.py: workdir:", ["{file}", "is a file"]),
    ("train.py", ["--workdir={ro}/run"], "train.py: workdir:", ["{ro}/run", "cannot be created"]),
    ("train.py", [], "train.py: --workdir is required", []),
    # train.py with the causal-LM config: what the language model cannot run.
    ("train.py", ["--config=configs/lm.py:transformer_base", RUN],
     "train.py: model.num_decoder_layers:", ["got 6", "0 for the language model",
                                             "model.num_layers"]),
    ("train.py", ["--config=configs/lm.py:bert_tiny,linformer", RUN], "train.py: model.attention:",
     ["the language model runs full attention", "'linformer'"]),
    ("train.py", ["--config=configs/lm.py", "--config.task=wordnet_glosses", RUN],
     "train.py: task:", ["'wordnet_glosses' has no 'targets' feature", "'wordnet_glosses_lm'"]),
    ("train.py", ["--config=configs/lm.py", "--config.head=mlm", RUN], "train.py: head:",
     ["got 'mlm'", "'lm' for objective 'lm'"]),
    ("train.py", ["--config=configs/probe.py:bert_tiny,rope,cpy", RUN], "train.py: config preset:",
     ["'cpy' is unknown", "did you mean 'copy'?", "a probe (copy, reverse, mqar, passkey)",
      "preset (bert, "]),
    ("train.py", ["--workdirr=x"], "train.py: Unknown command line flag 'workdirr'",
     ["Did you mean: workdir"]),
    # bench: argparse flags.
    ("benchmarks.steps", ["--length", "-5"], "posenc_jax.benchmarks.steps: --length:",
     ["got -5", "a positive integer"]),
    ("benchmarks.steps", ["--length", "0"], "posenc_jax.benchmarks.steps: --length:",
     ["got 0", "a positive integer"]),
    ("benchmarks.steps", ["--length", "x"], "posenc_jax.benchmarks.steps: --length:",
     ["got 'x'", "a positive integer"]),
    ("benchmarks.steps", ["--length"], "posenc_jax.benchmarks.steps: --length:",
     ["expected one argument"]),
    ("benchmarks.steps", ["--batch", "0"], "posenc_jax.benchmarks.steps: --batch:",
     ["got 0", "a positive integer"]),
    ("benchmarks.steps", ["--repeats", "0"], "posenc_jax.benchmarks.steps: --repeats:",
     ["got 0", "a positive integer"]),
    ("benchmarks.steps", ["--schemes", ""], "posenc_jax.benchmarks.steps: --schemes:",
     ["got ''", "allowed: bert, none"]),
    ("benchmarks.steps", ["--schemes", "bert,,t5"], "posenc_jax.benchmarks.steps: --schemes:",
     ["got '' in 'bert,,t5'"]),
    ("benchmarks.steps", ["--schemes", "t5,diet_abz"], "posenc_jax.benchmarks.steps: --schemes:",
     ["got 'diet_abz' in 't5,diet_abz'", "did you mean 'diet_abs'?", "allowed: bert"]),
    ("benchmarks.steps", ["--schemes", "bf16"], "posenc_jax.benchmarks.steps: --schemes:",
     ["got 'bf16'", "allowed: bert"]),
    ("benchmarks.steps", ["--baseline", "nope"], "posenc_jax.benchmarks.steps: --baseline:",
     ["got 'nope'", "allowed: bert"]),
    ("benchmarks.steps", ["--size", "tinyy"], "posenc_jax.benchmarks.steps: --size:",
     ["got 'tinyy'", "did you mean 'tiny'?", "allowed: tiny, demo, small, base"]),
    ("benchmarks.steps", ["--dtype", "float16"], "posenc_jax.benchmarks.steps: --dtype:",
     ["got 'float16'", "float32, bfloat16"]),
    ("benchmarks.steps", ["--route", "fuse"], "posenc_jax.benchmarks.steps: --route:",
     ["got 'fuse'", "did you mean 'fused'?"]),
    ("benchmarks.steps", ["--lenght", "5"], "posenc_jax.benchmarks.steps: --lenght: unknown flag",
     ["did you mean '--length'?"]),
    ("benchmarks.steps", ["tiny"], "posenc_jax.benchmarks.steps: unexpected argument", ["'tiny'"]),
    ("benchmarks.steps", ["--json", "{dir}"], "posenc_jax.benchmarks.steps: --json:",
     ["{dir}", "is a directory, not a file"]),
    ("benchmarks.steps", ["--json", "{file}/out.json"], "posenc_jax.benchmarks.steps: --json:",
     ["{file}", "is a file"]),
    ("benchmarks.steps", ["--json", "{ro}/out.json"], "posenc_jax.benchmarks.steps: --json:",
     ["{ro}", "is not writable"]),
    # params: absl flags and the config's presets and fields.
    ("params", ["--config=configs/model.py:bert_tiny,diet_abz"], "params: config preset:",
     ["'diet_abz' is unknown", "did you mean 'diet_abs'?"]),
    ("params", ["--config=configs/model.py:bert_tinyy"], "params: config preset:",
     ["'bert_tinyy' is not a model size", "did you mean 'bert_tiny'?"]),
    ("params", ["--config=configs/pretrain.py:bert_tiny,diet_protocl"], "params: config preset:",
     ["'diet_protocl' is unknown"]),
    ("params", ["--config=configs/nope.py"], "params: config:",
     ["'configs/nope.py' does not load"]),
    ("params", [MODEL, "--config.model.num_layer=3"], "params: config.model.num_layer:",
     ["unknown field", "did you mean 'num_layers'?"]),
    ("params", [MODEL, "--config.model.num_layers=x"], "params: --config.model.num_layers=x:",
     ["invalid literal for int()"]),
    ("params", [MODEL, "--config.model.num_layers=0"], "params: model.num_layers:",
     ["got 0", "a positive integer"]),
    ("params", [MODEL, "--config.head=mlmm"], "params: head:", ["got 'mlmm'", "allowed: mlm"]),
    ("params", ["--table=diet7"], "params: --table=diet7:", ["diet6"]),
    ("params", ["--table=diet6", MODEL], "params: table:", ["got 'diet6' and a config"]),
    ("params", ["--tabel=diet6"], "params: Unknown command line flag 'tabel'",
     ["Did you mean: table"]),
    ("params", [MODEL, "bert_tiny"], "params: unexpected argument", ["'bert_tiny'"]),
    # analysis: the command, absl bounds, the model source, the model's dimensions, outputs.
    ("analysis", ["rnak", MODEL], "analysis: command:", ["got 'rnak'", "did you mean 'rank'?"]),
    ("analysis", [MODEL], "analysis: command:", ["got none", "allowed: one of probe"]),
    ("analysis", ["rank", MODEL, "--rank_batch=0"], "analysis: --rank_batch=0:",
     ["not a positive integer"]),
    ("analysis", ["probe", MODEL, "--num_words=0"], "analysis: --num_words=0:",
     ["not a positive integer"]),
    ("analysis", ["probe", MODEL, "--batch_size=-2"], "analysis: --batch_size=-2:",
     ["not a positive integer"]),
    ("analysis", ["rank", MODEL, "--seed=-1"], "analysis: --seed=-1:",
     ["not a non-negative integer"]),
    ("analysis", ["rank", MODEL, "--rtol=0"], "analysis: --rtol=0.0:", ["a number in (0, 1)"]),
    ("analysis", ["rank", MODEL, "--rtol=1.5"], "analysis: --rtol=1.5:", ["a number in (0, 1)"]),
    ("analysis", ["probe", MODEL, "--special=cls_sepp"], "analysis: --special=cls_sepp:",
     ["cls_sep|cls|none"]),
    ("analysis", ["rank", MODEL, "--lenght=5"], "analysis: Unknown command line flag 'lenght'",
     ["Did you mean: length"]),
    ("analysis", ["rank", "--config=configs/model.py:bert_tiny,diet_abz"],
     "analysis: config preset:", ["'diet_abz' is unknown", "did you mean 'diet_abs'?"]),
    ("analysis", ["rank", "--config=configs/pretrain.py:bert_tiny,diet_protocl",
                  "--workdir={dir}"], "analysis: config preset:", ["'diet_protocl' is unknown"]),
    ("analysis", ["rank", MODEL, "--config.model.num_layer=3"],
     "analysis: config.model.num_layer:", ["did you mean 'num_layers'?"]),
    ("analysis", ["rank", MODEL, "--config.model.max_len=0"], "analysis rank: model.max_len:",
     ["got 0"]),
    ("analysis", ["params", MODEL, "--config.model.num_heads=3"],
     "analysis params: model.num_heads:", ["got 3", "a divisor of d_model=128"]),
    ("analysis", ["params", MODEL, "--length=32"], "analysis params: length:",
     ["got 32", "read by: probe, indicators, rank, plots"]),
    ("analysis", ["rank", MODEL, "--num_words=5"], "analysis rank: num_words:",
     ["got 5", "read by: probe, indicators, plots"]),
    ("analysis", ["indicators", MODEL, "--out_dir={dir}/pics"], "analysis indicators: out_dir:",
     ["{dir}/pics", "read by: probe, rank, plots"]),
    ("analysis", ["rank", "--workdir={dir}"], "analysis rank: config: required;",
     ["the workdir '{dir}' has no config.json"]),
    ("analysis", ["rank", "--hf_dir={dir}", "--hf_package"], "analysis rank: hf_package:",
     ["hf_dir='{dir}'"]),
    ("analysis", ["rank", MODEL, "--hf_package"], "analysis rank: hf_package:",
     ["got True with a config"]),
    ("analysis", ["rank", MODEL, "--step=3"], "analysis rank: step:", ["got 3 without workdir"]),
    ("analysis", ["rank", "--hf_dir={dir}"], "analysis rank: hf_dir:", ["{dir}: no config.json"]),
    ("analysis", ["rank"], "analysis rank: config: required", ["hf_dir"]),
    ("analysis", ["rank", MODEL, "--layer=2"], "analysis rank: layer:", ["got 2", "0..1"]),
    ("analysis", ["probe", MODEL, "--layer=-1"], "analysis probe: layer:", ["got -1", "0..1"]),
    ("analysis", ["rank", MODEL, "--length=129"], "analysis rank: length:",
     ["got 129", "2..128 (the model's max_len)"]),
    ("analysis", ["indicators", MODEL, "--length=32", "--k=33"], "analysis indicators: k:",
     ["got 33", "1..32"]),
    ("analysis", ["indicators", MODEL, "--length=32", "--db_offset=32"],
     "analysis indicators: db_offset:", ["got 32", "1..31"]),
    ("analysis", ["rank", "--config=configs/model.py:bert_tiny,linformer"],
     "analysis rank: model.attention:", ["'linformer'", "attention='full'"]),
    ("analysis", ["plots", MODEL], "analysis plots: out_dir:", ["required"]),
    ("analysis", ["rank", MODEL, "--out={dir}"], "analysis rank: out:",
     ["{dir}", "is a directory, not a file"]),
    ("analysis", ["rank", MODEL, "--out={file}/rank.json"], "analysis rank: out:",
     ["{file}", "is a file"]),
    ("analysis", ["rank", MODEL, "--out="], "analysis rank: out:", ["got ''"]),
    ("analysis", ["plots", MODEL, "--out_dir={file}"], "analysis plots: out_dir:",
     ["{file}", "is a file"]),
    ("analysis", ["probe", MODEL, "--out_dir={ro}"], "analysis probe: out_dir:",
     ["{ro}", "is not writable"]),
]


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
  """Runs every selected case, two at a time: ``{case index: (places, process, listing before,
  listing after)}`` where the listings are of the case's own directories."""
  selected = [item.callspec.params["index"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and "index" in item.callspec.params]

  # Made here, in one thread: pytest's tmp_path_factory creates its base directory on first use
  # and two threads doing so at once collide (FileExistsError).
  case_places = {index: _places(tmp_path_factory.mktemp(f"case{index}")) for index in selected}

  def run(index):
    tool, argv, _, _ = CASES[index]
    places = case_places[index]
    before = _listing(places)
    command = [tool] if tool.endswith(".py") else ["-m", f"posenc_jax.{tool}"]
    proc = forked_cli.run([*command, *(a.format(**places) for a in argv)], cwd=str(ROOT),
                          timeout=120)
    return index, (places, proc, before, _listing(places))

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    return dict(pool.map(run, selected))


def _places(tmp: pathlib.Path) -> dict[str, str]:
  (tmp / "dir").mkdir()
  (tmp / "file").write_text("not a directory\n")
  if os.geteuid() == 0:  # root writes through permission bits, not into /proc/self
    ro = pathlib.Path("/proc/self")
  else:
    ro = tmp / "ro"
    ro.mkdir(mode=0o555)
  return {"dir": str(tmp / "dir"), "file": str(tmp / "file"), "ro": str(ro), "tmp": str(tmp)}


def _listing(places: dict[str, str]) -> list[str]:
  return sorted(str(p) for p in pathlib.Path(places["tmp"]).rglob("*"))


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[" ".join([tool, *(a for a in argv if a not in (MODEL, RUN))])
                              for tool, argv, _, _ in CASES])
def test_bad_flag_is_one_line_before_any_work(index, results):
  _, _, prefix, texts = CASES[index]
  places, proc, before, after = results[index]
  line = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
  assert proc.returncode != 0, proc.stdout[-2000:]
  assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
  assert line.startswith(prefix), line
  for text in texts:
    assert text.format(**places) in line, line
  assert proc.stdout == ""  # nothing ran: bench prints its header before compiling
  assert after == before  # no output file or folder written


# Positive controls: valid flags still work (bench and analysis runs: test_readme.py and
# test_analysis_cli.py).


def test_params_counts_bert_tiny():
  proc = subprocess.run([sys.executable, "-m", "posenc_jax.params", MODEL,
                         "--config.model.num_layers=3"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  counts = json.loads(proc.stdout)
  assert counts["total"] == sum(counts["modules"].values()) and "bert/layers_*" in counts["modules"]


def test_bench_help_lists_the_schemes():
  proc = subprocess.run([sys.executable, "-m", "posenc_jax.benchmarks.steps", "--help"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and "diet_abs_share" in proc.stdout and "--repeats" in proc.stdout

