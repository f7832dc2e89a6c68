"""End-to-end tests of decode.py, run as a subprocess on a tiny trained workdir.

The workdir is tests/fixtures/workdir_decode_cli: the demo task, a tiny model
and a short run of train.py, made once by
tests/fixtures/make_decode_cli_workdir.py and committed. Every decode.py run
pays a JAX import and compilations, so the successful runs are few, launched
together (two at a time) by one fixture, and share a persistent compilation
cache; each test then checks one property of their outputs. Error cases fail
before the model is loaded and are cheap.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys

import matplotlib.image
import pytest

import fork_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE = os.path.join(ROOT, "decode.py")
TRAINED_WORKDIR = os.path.join(ROOT, "tests", "fixtures", "workdir_decode_cli")
TRAIN_STEPS = 300  # (its one checkpoint: tests/fixtures/make_decode_cli_workdir.py)

# Line 2 is empty and line 4 blank; the last line has no newline. Sentences of
# one length bucket (few compilations) that the tiny model translates
# differently, so that a mix-up of the order shows.
LINES = [
    "nine hundred eighty-seven old lamps",
    "",
    "eight hundred nineteen old trees",
    "   ",
    "fifty-six small cars",
    "one hundred sixty-eight big cars",
    "eight hundred twenty-nine big cats",
    "forty-seven black flowers",
]
NON_EMPTY = [i for i, line in enumerate(LINES) if line.strip()]
# Longer than the model's max_len (128 tokens): truncated, with a warning.
TOO_LONG = " ".join(["seven hundred seventy-seven"] * 30)


def _text(lines, final_newline=True):
  return "\n".join(lines) + ("\n" if final_newline else "")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A copy of tests/fixtures/workdir_decode_cli: the demo's workdir as
  `python train.py` writes it (a tiny model, 300 steps, XLA's default
  optimizations; `tests/fixtures/make_decode_cli_workdir.py` made it and says
  how), committed so that no run trains it again; copied, so that nothing a
  test does writes into the repository."""
  path = tmp_path_factory.mktemp("decode_cli") / "run"
  shutil.copytree(TRAINED_WORKDIR, path)
  return str(path)


def product_caches(env: dict) -> dict:
  """`env` for a test of decode.py's own caches: no JAX cache given (decode.py
  chooses, from $TRANSFORMER_COMPILATION_CACHE), and the compiled decoders
  kept with it, as a user's decode.py keeps them (conftest.py turns that off)."""
  return {k: v for k, v in env.items()
          if not k.startswith("JAX_") and k != "TRANSFORMER_DECODER_CACHE"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  from helpers import shared_compilation_cache
  env = dict(os.environ)  # (XLA at -O0, as conftest.py set it: helpers.FAST_COMPILE_FLAGS)
  # Later runs reuse the compilations of earlier ones (same model and shapes)
  # from the tests' persistent cache (helpers.shared_compilation_cache).
  cache = shared_compilation_cache() or tmp_path_factory.mktemp("jax_cache")
  env.update(JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
             XLA_PYTHON_CLIENT_PREALLOCATE="false")  # share a GPU with this process
  return env


def run_decode(env, *flags, stdin: bytes | str = b"",
               timeout: float = 600) -> subprocess.CompletedProcess:
  """`python decode.py *flags`, a process of its own forked from one that
  imported decode.py's libraries (`fork_server`: 2 s of imports each)."""
  result = fork_server.run([DECODE, *flags], env, cwd=ROOT, preload=fork_server.DECODING,
                           stdin=stdin, timeout=timeout)
  result.stdout_text = result.stdout.decode()
  result.stderr_text = result.stderr.decode()
  return result


def _ok(result):
  assert result.returncode == 0, result.stderr_text[-3000:]
  assert "Traceback" not in result.stderr_text
  return result


@pytest.fixture(scope="module")
def runs(workdir, env, tmp_path_factory):
  """The successful decode.py runs, two at a time (they are mostly compilation)."""
  tmp = tmp_path_factory.mktemp("decode_runs")
  infile = tmp / "in.txt"
  infile.write_text(_text(LINES, final_newline=False))  # last line without "\n"
  out = tmp / "out.txt"
  plots = tmp / "plots"
  reversed_stdin = "".join(line + "\r\n" for line in LINES[::-1])  # Windows line ends
  with_long = tmp / "with_long.txt"
  with_long.write_text(_text(LINES + [TOO_LONG]))

  def beam_then_stdin():
    beam = run_decode(env, f"--workdir={workdir}", f"--input={infile}", f"--output={out}",
                      "--beam_size=4", "--batch_size=2", f"--plot_attention={plots}")
    # The same lines reversed, through stdin -> stdout, 2-best, the step by
    # number, each batch split over two CPU devices.
    n_best = run_decode(env, f"--workdir={workdir}", "--batch_size=2", "--n_best=2",
                        f"--checkpoint={TRAIN_STEPS}", "--cpu_devices=2",
                        stdin=reversed_stdin)
    return beam, n_best

  def greedy_then_sample():
    # --max_len a multiple of options.EARLY_EXIT_CHUNK: one loop body to compile.
    greedy = run_decode(env, f"--workdir={workdir}", f"--input={with_long}",
                        "--method=greedy", "--max_len=24", "--quiet")
    sample = run_decode(env, f"--workdir={workdir}", "--method=sample", "--top_k=1",
                        "--n_best=2", "--seed=3", "--temperature=1.5", "--max_len=24",
                        "--input=-", stdin=_text(LINES))
    bfloat16 = run_decode(env, f"--workdir={workdir}", f"--input={with_long}",
                          "--method=greedy", "--max_len=24", "--weights_dtype=bfloat16")
    return greedy, sample, bfloat16

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    first = pool.submit(beam_then_stdin)
    second = pool.submit(greedy_then_sample)
    (beam, n_best), (greedy, sample, bfloat16) = first.result(), second.result()
  return dict(beam=beam, n_best=n_best, greedy=greedy, sample=sample, bfloat16=bfloat16,
              out=out, plots=plots)


def _out_lines(text):
  assert text.endswith("\n")
  return text[:-1].split("\n")


# ----------------------------------------------------------------------------
# Successful runs
# ----------------------------------------------------------------------------


def test_file_to_file_one_line_per_input(runs):
  beam = _ok(runs["beam"])
  assert beam.stdout_text == ""  # everything went to --output
  lines = _out_lines(runs["out"].read_text())
  assert len(lines) == len(LINES)
  for i, line in enumerate(lines):
    assert (line != "") == (i in NON_EMPTY), (i, line)
  assert not [p for p in os.listdir(runs["out"].parent) if p.startswith(".out.txt")]


def test_summary_line_on_stderr(runs):
  err = _ok(runs["beam"]).stderr_text
  summary = [line for line in err.splitlines() if line.startswith("decoded ")]
  assert len(summary) == 1, err
  assert f"decoded {len(LINES)} sentences ({len(NON_EMPTY)} non-empty)" in summary[0]
  assert "tokens/s" in summary[0] and f"step {TRAIN_STEPS}" in summary[0]
  # Compilation is timed apart from decoding (this run compiles at least once,
  # unless an earlier run compiled its decoders: executable_cache.py).
  compiling = float(summary[0].split("(compiling ")[1].split(" s;")[0])
  total = float(summary[0].split(" tokens generated in ")[1].split(" s ")[0])
  assert compiling <= total
  if "compiled decoders loaded" not in summary[0]:
    assert 0 < compiling
  assert "warning" not in err  # nothing truncated
  # --quiet: no progress bar, no summary, only the warning about the long line.
  quiet = _ok(runs["greedy"]).stderr_text.strip().splitlines()
  assert len(quiet) == 1 and quiet[0].startswith("warning: 1 input line longer"), quiet
  assert "max_len=128" in quiet[0] and "truncated" in quiet[0]


def test_order_kept_stdin_stdout_and_n_best(runs):
  beam = _out_lines(runs["out"].read_text())
  translations = [beam[i] for i in NON_EMPTY]
  # Different inputs translate differently, so a shuffled order would show.
  assert len(set(translations)) >= 2, translations
  n_best = _ok(runs["n_best"])
  lines = _out_lines(n_best.stdout_text)
  assert len(lines) == len(LINES)
  best = []
  for line, source in zip(lines, LINES[::-1]):
    if not source.strip():
      assert line == ""
      best.append("")
      continue
    fields = line.split("\t")
    assert len(fields) == 2, line
    best.append(fields[0])
  # Reversed input -> reversed output; the best of 2 is the 1-best of the same
  # beam, on two devices as on one.
  assert best == beam[::-1]
  assert n_best.stderr_text.rstrip().endswith("on 2 devices"), n_best.stderr_text[-300:]
  assert "devices" not in runs["beam"].stderr_text.splitlines()[-1]


def test_sample_top_k_1_is_greedy(runs):
  greedy = _out_lines(_ok(runs["greedy"]).stdout_text)
  assert len(greedy) == len(LINES) + 1  # the over-long line too
  assert [bool(line) for line in greedy[:-1]] == [bool(line.strip()) for line in LINES]
  greedy = greedy[:-1]
  sample = _out_lines(_ok(runs["sample"]).stdout_text)
  assert len(sample) == len(LINES)
  for g, s, source in zip(greedy, sample, LINES):
    if source.strip():
      assert s.split("\t") == [g, g]
    else:
      assert s == ""


def test_bfloat16_weights_translate_as_float32(runs):
  """--weights_dtype=bfloat16: a line out per line in, the trained demo
  model's greedy translations those of its float32 weights; the summary
  line says the weights."""
  greedy = _out_lines(_ok(runs["greedy"]).stdout_text)
  assert _out_lines(_ok(runs["bfloat16"]).stdout_text) == greedy
  assert ", greedy, bfloat16 weights, " in runs["bfloat16"].stderr_text  # (the summary)


def test_plot_attention_one_png_per_sentence(runs):
  _ok(runs["beam"])
  plots = runs["plots"]
  assert sorted(os.listdir(plots)) == sorted(f"{i + 1}.png" for i in NON_EMPTY)
  for i in NON_EMPTY:
    image = matplotlib.image.imread(plots / f"{i + 1}.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # not blank


# ----------------------------------------------------------------------------
# Errors: one line on stderr naming the culprit, non-zero exit, no traceback
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode_py():
  """decode.py imported into this process (its flags defined in absl's FLAGS;
  importing it changes nothing else), for the option errors below."""
  import importlib.util
  from absl import flags as absl_flags
  before = set(absl_flags.FLAGS)
  spec = importlib.util.spec_from_file_location("decode_py_under_test", DECODE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  yield module
  # Its flags removed again: a later module of this worker may define flags
  # of the same names (train.py's --workdir, say).
  for name in set(absl_flags.FLAGS) - before:
    delattr(absl_flags.FLAGS, name)


def decode_in_process(decode_py, *flags, stdin: str = "a\n"):
  """decode.py's exit status and output for `flags` (a result like
  `run_decode`'s), run in this process as absl runs it in its own: the flags
  parsed, then `main`. For the errors decode.py finds in its options and in
  the workdir's files before it loads a model: the path under test is the
  check, not a process's start (~1.5-2.5 s of imports each;
  test_an_option_error_ends_the_process_in_one_line runs one as a process).
  The flags, absl's verbosity and the standard streams are restored after."""
  import contextlib
  import io
  from absl import flags as absl_flags
  from absl import logging as absl_logging
  verbosity, err = absl_logging.get_verbosity(), io.StringIO()
  out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # (a .buffer, as sys.stdout has)
  old_stdin = sys.stdin
  sys.stdin = io.StringIO(stdin)
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        argv = absl_flags.FLAGS(["decode.py", *flags])
      except absl_flags.Error as e:  # (as absl's app.run says it, exit status 1)
        print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
        code = 1
      else:
        code = decode_py.main(argv)
  finally:
    sys.stdin = old_stdin
    absl_flags.FLAGS.unparse_flags()
    absl_logging.set_verbosity(verbosity)
  out.flush()
  return subprocess.CompletedProcess(["decode.py", *flags], code, out.buffer.getvalue(),
                                     err.getvalue().encode())


def _error(result, *needles, code=None, stdout=""):
  if not hasattr(result, "stderr_text"):  # (`decode_in_process`'s)
    result.stdout_text, result.stderr_text = result.stdout.decode(), result.stderr.decode()
  err = result.stderr_text
  assert result.returncode != 0, err
  if code is not None:
    assert result.returncode == code, err
  assert "Traceback" not in err, err
  assert result.stdout_text == stdout
  message = [line for line in err.splitlines() if line.strip()]
  for needle in needles:
    assert any(needle in line for line in message), (needle, err)
  return err


def test_non_utf8_input_names_file_and_line(workdir, env, tmp_path):
  bad = tmp_path / "latin1.txt"
  bad.write_bytes("one red cat\ntwo small cats\nfünf große Hunde\n".encode("latin-1"))
  out = tmp_path / "out.txt"
  result = run_decode(env, f"--workdir={workdir}", f"--input={bad}", f"--output={out}",
                      "--method=greedy")
  # The message of text_io.NotUtf8Error, as for training data: file, line,
  # column (the "ü" of "fünf"), the byte, and the fix.
  _error(result, f"{bad}:3: line 3, column 2: byte 0xfc is not valid UTF-8",
         f"`iconv -f latin1 -t utf-8 {bad}`", code=2)
  # The lines before it are translated and kept, as the two alone would be,
  # and the progress record says so (the same command continues from there).
  alone = run_decode(env, f"--workdir={workdir}", "--method=greedy",
                     stdin="one red cat\ntwo small cats\n")
  _ok(alone)
  assert out.read_text() == alone.stdout_text and len(alone.stdout_text.splitlines()) == 2
  record = json.loads((tmp_path / "out.txt.progress.json").read_text())
  assert record["lines_done"] == 2 and record["output_bytes"] == len(out.read_bytes())
  ok = _ok(run_decode(env, f"--workdir={workdir}", "--method=greedy", stdin="ok\n"))
  result = run_decode(env, f"--workdir={workdir}", "--method=greedy", stdin=b"ok\n\xff\xfe\n")
  _error(result, "<stdin>:2: line 2, column 1: byte 0xff is not valid UTF-8",
         "pipe it through `iconv -f latin1 -t utf-8`", code=2,
         stdout=ok.stdout_text)  # "ok"'s translation came out first


def test_missing_workdir_pieces_name_what_to_do(workdir, decode_py, tmp_path):
  missing = tmp_path / "nowhere"
  _error(decode_in_process(decode_py, f"--workdir={missing}"),
         str(missing), "train.py", code=1)
  empty = tmp_path / "empty"
  empty.mkdir()
  _error(decode_in_process(decode_py, f"--workdir={empty}"),
         "model_config.json", "train.py", code=1)
  no_vocab = tmp_path / "no_vocab"
  no_vocab.mkdir()
  shutil.copy(os.path.join(workdir, "model_config.json"), no_vocab)
  _error(decode_in_process(decode_py, f"--workdir={no_vocab}"),
         "vocab.model", "train.py", code=1)
  no_ckpt = tmp_path / "no_checkpoint"
  no_ckpt.mkdir()
  for name in ("model_config.json", "vocab.model", "config.json"):
    shutil.copy(os.path.join(workdir, name), no_ckpt)
  _error(decode_in_process(decode_py, f"--workdir={no_ckpt}"),
         "no checkpoint", "train.py", code=1)


def test_unknown_checkpoint(workdir, decode_py):
  _error(decode_in_process(decode_py, f"--workdir={workdir}", "--checkpoint=123"),
         "--checkpoint=123", f"available steps: [{TRAIN_STEPS}]", code=1)
  _error(decode_in_process(decode_py, f"--workdir={workdir}", "--checkpoint=averaged"),
         "--checkpoint=averaged", "no averaged checkpoint", code=1)


@pytest.mark.parametrize("flags,needle", [
    (["--beam_size=0"], "--beam_size=0"),
    (["--n_best=5"], "--n_best=5"),                       # > --beam_size=4
    (["--method=greedy", "--n_best=2"], "--n_best=2"),
    (["--top_p=0"], "--top_p=0"),
    (["--top_p=1.5"], "--top_p=1.5"),
    (["--method=viterbi"], "--method=viterbi"),
    (["--beam_stop=soon"], "--beam_stop"),
    (["--checkpoint=best"], "--checkpoint=best"),
    (["--cpu_devices=-1"], "--cpu_devices=-1"),
    ([], "--workdir"),
])
def test_bad_flag_values_name_the_flag(workdir, decode_py, flags, needle):
  args = list(flags) if needle == "--workdir" else [f"--workdir={workdir}", *flags]
  _error(decode_in_process(decode_py, *args), needle, code=2)


def test_an_option_error_ends_the_process_in_one_line(workdir, env):
  """As a process (the tests above run decode.py's checks in this one): exit
  status 2, one line on stderr naming the flag, nothing on stdout."""
  err = _error(run_decode(env, f"--workdir={workdir}", "--beam_size=0", stdin="a\n"),
               "--beam_size=0", code=2)
  assert len(err.strip().splitlines()) == 1, err


def test_an_xla_flag_this_xla_lacks_is_one_line_not_xla_stopping_the_process(workdir, env,
                                                                              tmp_path):
  """XLA ends a process at its first computation on a flag it does not know,
  saying so in its C++ log (jaxlib 0.12 dropped flags 0.10 had): decode.py
  tries $XLA_FLAGS first and says it in one sentence; nothing is written."""
  out = tmp_path / "out.txt"
  bad = dict(env, XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_no_such_flag_anywhere=1")
  err = _error(run_decode(bad, f"--workdir={workdir}", f"--output={out}", stdin="a\n"),
               "error: $XLA_FLAGS sets --xla_no_such_flag_anywhere=1, which this XLA",
               "remove it from XLA_FLAGS", code=2)
  assert len(err.strip().splitlines()) == 1, err
  assert not out.exists() and not (tmp_path / "out.txt.progress.json").exists()


def test_output_in_missing_directory(workdir, decode_py, tmp_path):
  _error(decode_in_process(decode_py, f"--workdir={workdir}",
                           f"--output={tmp_path}/no/such/out.txt"), "--output=", code=2)


def test_vocab_path_from_config(workdir, decode_py, tmp_path):
  # A run trained with config.vocab_path has no vocab.model of its own: decode.py
  # reads the path from config.json where it lies inside the workdir (this error
  # proves it got past the vocabulary), and refuses one outside it: a workdir is
  # data, and does not choose which of this machine's files are read.
  run = tmp_path / "run"
  (run / "spm").mkdir(parents=True)
  shutil.copy(os.path.join(workdir, "vocab.model"), run / "spm" / "spm.model")
  shutil.copy(os.path.join(workdir, "model_config.json"), run)
  config = json.load(open(os.path.join(workdir, "config.json")))
  config["vocab_path"] = str(run / "spm" / "spm.model")
  (run / "config.json").write_text(json.dumps(config))
  _error(decode_in_process(decode_py, f"--workdir={run}"), "no checkpoint", code=1)
  config["vocab_path"] = os.path.join(workdir, "vocab.model")
  (run / "config.json").write_text(json.dumps(config))
  _error(decode_in_process(decode_py, f"--workdir={run}"), "outside the workdir", code=1)


def test_decode_py_runs_nothing_a_received_workdir_carries(workdir, env, tmp_path):
  """Issue 59 as a user met it: a workdir whose compiled/ files were each
  replaced by a pickle that runs a shell command, decoded on a machine whose
  cache is empty: the command never runs, one line on stderr names the
  workdir, and the output is byte-identical to the clean workdir's.
  (test_executable_cache.py: the other kinds of file, and --trust_compiled=KEY;
  below: --trust_compiled=KEY through decode.py.)"""
  import helpers
  env = product_caches(env)
  env.update(TRANSFORMER_COMPILATION_CACHE=str(tmp_path / "cache"),
             TRANSFORMER_WORKDIR_DECODERS="on")
  received = tmp_path / "received"
  shutil.copytree(workdir, received)
  flags = (f"--workdir={received}", "--method=greedy", "--max_len=24", "--quiet")
  clean = run_decode(env, *flags, stdin=_text(LINES))
  _ok(clean)
  compiled = received / "compiled"
  assert {p.suffix for p in compiled.iterdir()} == {".bin", ".shapes", ".logits_kernel"}
  marker = tmp_path / "the planted command ran"
  helpers.plant_hostile_files(compiled, "pickle", marker)
  env["TRANSFORMER_COMPILATION_CACHE"] = str(tmp_path / "empty_cache")
  hostile = run_decode(env, *flags, stdin=_text(LINES))
  _ok(hostile)
  assert not marker.exists()
  assert hostile.stdout == clean.stdout
  said = [line for line in hostile.stderr_text.splitlines() if "cannot prove" in line]
  assert len(said) == 1 and str(received) in said[0], hostile.stderr_text


FIXTURE_WORKDIR = os.path.join(ROOT, "tests", "fixtures", "workdir_d26a6fb")
FIXTURE_LINES = ["forty-two red apples and one small cat", "ten white lamps", "", "seven"]


def _on_machine(env, tmp_path, machine: str, cache: str) -> dict:
  """decode.py's environment on one of the user's machines: its signing key
  (`<tmp_path>/<machine>/signing.key`, made on first use), its compilation
  cache (`<tmp_path>/<cache>`), decoders kept in workdirs."""
  env = product_caches(env)
  return dict(env, TRANSFORMER_SIGNING_KEY=str(tmp_path / machine / "signing.key"),
              TRANSFORMER_COMPILATION_CACHE=str(tmp_path / cache),
              TRANSFORMER_WORKDIR_DECODERS="on")


def test_decode_py_trusts_a_key_never_a_file(env, tmp_path):
  """Issue 68 through decode.py: the fixture workdir compiled on machine A (its
  key, its cache), copied to machine B (another key, an empty cache). With
  --trust_compiled=A's signing.key a copy loads its decoders (the summary
  says so), and so does the next run without the flag. A copy whose
  compiled/ files are each MAGIC + 32 zero bytes + a pickle that runs a
  shell command (the attack), with the same flag: the command never runs,
  nothing is loaded, one line says so, the output is byte-identical."""
  import helpers
  from transformer.runtime import signing
  flags, stdin = ("--method=greedy", "--max_len=24"), _text(FIXTURE_LINES)
  own = tmp_path / "own"
  shutil.copytree(FIXTURE_WORKDIR, own)
  clean = _ok(run_decode(_on_machine(env, tmp_path, "a", "a_cache"), f"--workdir={own}",
                         *flags, "--quiet", stdin=stdin))
  a_key = tmp_path / "a" / "signing.key"
  trusted, forged = tmp_path / "trusted", tmp_path / "forged"
  for copy in (trusted, forged):
    shutil.copytree(own, copy)
  marker = tmp_path / "the planted command ran"
  for path in (forged / "compiled").iterdir():
    path.write_bytes(signing.MAGIC + bytes(signing.TAG_BYTES) + helpers.hostile_pickle(marker))

  hostile = _ok(run_decode(_on_machine(env, tmp_path, "b", "b_cache1"), f"--workdir={forged}",
                           *flags, f"--trust_compiled={a_key}", stdin=stdin))
  assert not marker.exists() and hostile.stdout == clean.stdout
  assert "compiled decoders loaded" not in hostile.stderr_text, hostile.stderr_text
  said = [line for line in hostile.stderr_text.splitlines() if "cannot prove" in line]
  assert len(said) == 1 and str(forged) in said[0], hostile.stderr_text

  for cache, trust in (("b_cache2", [f"--trust_compiled={a_key}"]), ("b_cache3", [])):
    warm = _ok(run_decode(_on_machine(env, tmp_path, "b", cache), f"--workdir={trusted}",
                          *flags, *trust, stdin=stdin))  # (then without the flag)
    assert warm.stdout == clean.stdout and "cannot prove" not in warm.stderr_text
    assert re.search(r"\b[1-9][0-9]* compiled decoders loaded", warm.stderr_text), \
        warm.stderr_text


def _bad_trusted_key(kind: str, tmp_path) -> str:
  """What --trust_compiled must refuse: a link to a key, a FIFO, a file of
  the wrong size, one that group members can write."""
  key = tmp_path / "elsewhere" / "signing.key"
  key.parent.mkdir()
  key.write_bytes(os.urandom(32))
  key.chmod(0o600)
  path = tmp_path / f"{kind}.key"
  if kind == "link":
    path.symlink_to(key)
  elif kind == "fifo":
    os.mkfifo(path)
  else:
    path.write_bytes(os.urandom(31 if kind == "short" else 32))
    path.chmod(0o620 if kind == "group-writable" else 0o600)
  return str(path)


@pytest.mark.parametrize("kind,needle", [
    ("link", "symbolic link"), ("fifo", "not a regular file"),
    ("short", "holds 31 bytes"), ("group-writable", "read or written by group or others"),
    ("the old switch", "name the key file"),
])
def test_decode_py_refuses_a_trusted_key_that_is_none_in_one_line(decode_py, tmp_path, kind,
                                                                  needle):
  """Before the workdir is read: one line naming the flag, its value and what
  is wrong, exit status 2 (a bad flag value); a FIFO is never waited on."""
  if kind == "the old switch":  # (absl takes the next flag for the value)
    flags = ["--trust_compiled", "--method=greedy"]
    value = "--method=greedy"
  else:
    value = _bad_trusted_key(kind, tmp_path)
    flags = [f"--trust_compiled={value}"]
  from helpers import within_seconds
  result = within_seconds(lambda: decode_in_process(decode_py, f"--workdir={FIXTURE_WORKDIR}",
                                                    *flags, stdin="seven\n"), 120)
  err = _error(result, f"--trust_compiled={value}: ", needle, code=2)
  assert len(err.strip().splitlines()) == 1, err


def test_second_decode_compiles_nothing(workdir, env, tmp_path):
  """The persistent compilation cache is on by default (here in the directory
  $TRANSFORMER_COMPILATION_CACHE names): the first decode.py run writes its
  compiled programs there and its decoders whole (executable_cache.py), the
  second finds them all (it writes no new one, and loads every decoder instead
  of tracing it: JAX compiles no program at all, not even a PRNG key's) and
  translates the same; --compilation_cache=off writes nothing."""
  cache = tmp_path / "cache"
  env = product_caches(env)
  env["TRANSFORMER_COMPILATION_CACHE"] = str(cache)
  flags = (f"--workdir={workdir}", "--method=greedy", "--max_len=24", "--quiet")
  first = _ok(run_decode(env, *flags, stdin=_text(LINES)))
  entries = sorted(p.name for p in cache.iterdir())
  assert entries, "the first run cached nothing"
  decoders = sorted(p.name for p in (cache / "decoders").iterdir())
  assert decoders, "the first run kept no compiled decoder"
  second = _ok(run_decode(dict(env, JAX_LOG_COMPILES="1"), *flags[:-1],  # (with its summary)
                          stdin=_text(LINES)))
  assert "Compiling" not in second.stderr_text, second.stderr_text
  assert sorted(p.name for p in cache.iterdir()) == entries  # every program was a hit
  assert sorted(p.name for p in (cache / "decoders").iterdir()) == decoders
  compiled = [name for name in decoders if name.endswith(".bin")]  # (and the params' shapes)
  assert f"{len(compiled)} compiled decoders loaded" in second.stderr_text  # none traced
  assert second.stdout_text == first.stdout_text

  off_cache = tmp_path / "off"
  _ok(run_decode(dict(env, TRANSFORMER_COMPILATION_CACHE=str(off_cache)), *flags,
                 "--compilation_cache=off", stdin=_text(LINES)))
  assert not off_cache.exists()


_SMALL_PROBE = """
import json, os, runpy, sys
from transformer.decoding import translator as translation
made = []
init = translation.Translator.__init__
def recording_init(self, *args, **kwargs):
  init(self, *args, **kwargs)
  made.append(self)
translation.Translator.__init__ = recording_init
real_exit = os._exit
def report_then_exit(code):
  print(json.dumps([[getattr(shape, name) for name in ("max_len", "search_len", "small")]
                    for t in made for shape in t.decoders.executables]), file=sys.stderr,
        flush=True)
  real_exit(code)
os._exit = report_then_exit
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_decoders_with_few_rows_are_built_small_by_the_command(workdir, env):
  """decode.py, which loads its decoders for one file, turns the Translator's
  `small_decoders_for_few_rows` on on a CPU, so the first search of its few
  lines is a small decoder there (the API's default is off: test_api.py);
  a search again in full is never small."""
  import jax
  on_cpu = jax.devices()[0].platform == "cpu"
  result = subprocess.run(
      [sys.executable, "-c", _SMALL_PROBE, DECODE, f"--workdir={workdir}", "--method=greedy",
       "--quiet"], input=_text(LINES).encode(), cwd=ROOT, env=env,
      capture_output=True, timeout=600)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  decoders = json.loads(result.stderr.decode().strip().splitlines()[-1])
  first = [small for max_len, search_len, small in decoders if max_len < search_len]
  again = [small for max_len, search_len, small in decoders if max_len == search_len]
  assert first and all(small is on_cpu for small in first) and not any(again), decoders


_GC_PROBE = """
import gc, json, os, runpy, sys
states = {}
real_exit = os._exit
def report_then_exit(code):
  import jax
  states.update(at_exit=gc.isenabled(), frozen=gc.get_freeze_count(),
                async_dispatch=jax.config.read("jax_cpu_enable_async_dispatch"))
  print(json.dumps(states), file=sys.stderr, flush=True)
  real_exit(code)
os._exit = report_then_exit
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_garbage_collection_off_while_the_command_starts_then_frozen_and_back_on(
    workdir, env):
  """decode.py as a command turns Python's collector off before importing jax
  and, once the model is loaded, freezes what exists and turns it back on;
  imported as a module (as these tests do) it leaves the collector alone."""
  result = subprocess.run(
      [sys.executable, "-c", _GC_PROBE, DECODE, f"--workdir={workdir}", "--method=greedy",
       "--max_len=24", "--quiet"], input=_text(LINES).encode(), cwd=ROOT, env=env,
      capture_output=True, timeout=600)
  assert result.returncode == 0, result.stderr.decode()[-3000:]
  states = json.loads(result.stderr.decode().strip().splitlines()[-1])
  assert states["at_exit"], states
  assert states["frozen"] > 10_000, states  # jax's and the model's objects
  imported = subprocess.run(
      [sys.executable, "-c", "import gc; bare = gc.get_freeze_count(); import decode; "
       "print(gc.isenabled(), gc.get_freeze_count() - bare)"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  # (Python 3.12 starts with a few hundred objects frozen of its own: counted from there)
  assert imported.stdout.split() == ["True", "0"], imported.stderr[-2000:]


def test_large_batches_run_computations_on_the_threads_that_call_them(workdir, env):
  """decode.py on a CPU (glibc) with batches of CALLING_THREAD_MIN_ROWS rows
  or more turns JAX's asynchronous dispatch off, so that the main thread,
  which decodes a lane of batches, allocates their temporaries from its heap
  (host_memory.py); smaller batches keep it, and so does decode.py imported
  as a module."""
  from transformer.decoding import command
  from transformer.runtime import host_memory
  assert command.CALLING_THREAD_MIN_ROWS == 512

  def async_dispatch(*flags, lines=LINES) -> bool:
    result = subprocess.run(
        [sys.executable, "-c", _GC_PROBE, DECODE, f"--workdir={workdir}", "--max_len=24",
         "--quiet", *flags], input=_text(lines).encode(), cwd=ROOT, env=env,
        capture_output=True, timeout=600)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return json.loads(result.stderr.decode().strip().splitlines()[-1])["async_dispatch"]
  # (The runs that turn it off decode their lines that way; the others decide
  # it before reading a line, so an empty line, which compiles nothing, will do.)
  assert async_dispatch("--beam_size=4", "--batch_size=128") is not host_memory._applies()
  assert async_dispatch("--beam_size=4", "--batch_size=127", lines=[""])
  assert async_dispatch("--method=sample", "--n_best=2", "--batch_size=256") is not (
      host_memory._applies())
  assert async_dispatch("--method=greedy", "--batch_size=511", lines=[""])
  imported = subprocess.run(
      [sys.executable, "-c",
       "import decode, jax; print(jax.config.read('jax_cpu_enable_async_dispatch'))"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert imported.stdout.split() == ["True"], imported.stderr[-2000:]


# ----------------------------------------------------------------------------
# --score: given translations scored, through the same streaming path
# ----------------------------------------------------------------------------

SCORED = ["nine hundred eighty-seven old lamps\tneunhundertsiebenundachtzig alte Lampen",
          "one red cat\teine rote Katze",
          "\t",                                     # a blank pair: the EOS alone
          "eight hundred nineteen old trees\tachthundertneunzehn alte Bäume",
          "two small cats\tzwei\tkleine Katzen"]   # (the target is all after the first tab)


def test_score_writes_one_line_per_pair_as_the_api_scores_it(workdir, decode_py, tmp_path):
  from transformer.decoding import loader
  infile, out, jsonl = tmp_path / "pairs.tsv", tmp_path / "scores.txt", tmp_path / "s.jsonl"
  infile.write_text(_text(SCORED))
  ok = decode_in_process(decode_py, f"--workdir={workdir}", f"--input={infile}",
                         f"--output={out}", "--score", "--batch_size=2")
  assert ok.returncode == 0, ok.stderr.decode()
  assert "scored 5 pairs" in ok.stderr.decode()
  ok = decode_in_process(decode_py, f"--workdir={workdir}", f"--input={infile}",
                         f"--output={jsonl}", "--score", "--alignment", "--output_format=jsonl")
  assert ok.returncode == 0, ok.stderr.decode()
  pairs = [line.split("\t", 1) for line in SCORED]
  expected = loader.load_translator(workdir).score([s for s, _ in pairs], [t for _, t in pairs],
                                                   alignment=True)
  lines = out.read_text().splitlines()
  records = [json.loads(line) for line in jsonl.read_text().splitlines()]
  assert len(lines) == len(records) == len(SCORED)  # N lines in, N out
  for line, record, (source, target), score in zip(lines, records, pairs, expected):
    total, tokens, each = line.split("\t")
    assert int(tokens) == score.tokens == record["tokens"] == len(each.split())
    assert float(total) == pytest.approx(score.log_prob, abs=1e-5)
    assert [float(x) for x in each.split()] == pytest.approx(score.token_log_probs, abs=1e-5)
    assert (record["source"], record["target"]) == (source, target)
    assert record["logprob"] == pytest.approx(score.log_prob, abs=1e-5)
    assert record["alignment"] == score.alignment
  assert [r["line"] for r in records] == [1, 2, 3, 4, 5]
  assert lines[2].split("\t")[1] == "1"  # (the blank pair: its EOS)


def test_score_names_a_line_without_a_tab_after_writing_the_lines_before_it(
    workdir, decode_py, tmp_path):
  infile, out = tmp_path / "pairs.tsv", tmp_path / "scores.txt"
  infile.write_text(_text([SCORED[0], SCORED[1], "a line without a tab", SCORED[3]]))
  result = decode_in_process(decode_py, f"--workdir={workdir}", f"--input={infile}",
                             f"--output={out}", "--score")
  _error(result, f"{infile}:3: line 3 has no tab: --score reads source<TAB>target lines "
         "(the scores of the lines before it are written)", code=2)
  assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("flags, needle", [
    (["--alignment"], "--alignment: the alignment of a scored target; add --score"),
    (["--score", "--n_best=2"], "--n_best=2: --score scores the one target"),
    (["--score", "--plot_attention=plots"], "--plot_attention draws translations"),
])
def test_score_option_errors(workdir, decode_py, flags, needle):
  _error(decode_in_process(decode_py, f"--workdir={workdir}", *flags), needle, code=2)


def test_an_interrupted_score_resumes_to_the_same_bytes(workdir, decode_py, tmp_path,
                                                        monkeypatch):
  from transformer.decoding.translator import Translator
  infile = tmp_path / "pairs.tsv"
  infile.write_text(_text(SCORED * 3))
  whole, part = tmp_path / "whole.txt", tmp_path / "part.txt"
  flags = [f"--workdir={workdir}", f"--input={infile}", "--score", "--window_lines=4"]
  assert decode_in_process(decode_py, *flags, f"--output={whole}").returncode == 0
  real, calls = Translator.score, []

  def stopped_at_the_third_window(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
      raise KeyboardInterrupt  # (Ctrl-C: the two windows before it are on disk)
    return real(self, *args, **kwargs)

  monkeypatch.setattr(Translator, "score", stopped_at_the_third_window)
  assert decode_in_process(decode_py, *flags, f"--output={part}").returncode == 130
  assert len(part.read_text().splitlines()) == 8
  assert (tmp_path / "part.txt.progress.json").exists()
  monkeypatch.setattr(Translator, "score", real)
  resumed = decode_in_process(decode_py, *flags, f"--output={part}")
  assert resumed.returncode == 0 and "resumed after line 8" in resumed.stderr.decode()
  assert part.read_bytes() == whole.read_bytes()
