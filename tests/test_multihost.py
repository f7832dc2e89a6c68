"""Tests for transformer/runtime/multihost.py: multi-host training without a shared
disk (issue 16, point 5).

  * paths: a local workdir made absolute, gs://bucket/run left as it is, and
    a gs:// workdir's vocabulary, configs, lock and log going through epath
    (a fake bucket: `etils.epath.testing.mock_epath` maps gs:// to tmp_path);
  * the work split (contiguous shares) and the cluster auto-detection
    decision of train.py (environments of Slurm / Open MPI, faked);
  * two `python train.py` processes on localhost, each with its own workdir
    root (--workdir=<tmp>/disk_a/run and <tmp>/disk_b/run), train, checkpoint,
    resume (from the step both have) and evaluate, each decoding its share:
    every workdir alone can resume and decode, and the translations and
    scores are those of one process decoding everything;
  * a Slurm job step of two tasks: `python train.py` with no multi-host flags
    starts JAX's distributed runtime by itself (to the end of its steps: slow;
    stopped by a SIGTERM to one task, which both obey at one saved step: the
    default suite's run of two train.py processes, 13 s on an idle 2-core
    machine).

The other runs of two train.py processes are marked slow (`python -m pytest -m
slow`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from etils.epath import testing as epath_testing

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import train_worker  # noqa: E402  (no JAX import)
from helpers import (free_port, run_together, sigterm_one_once_training,  # noqa: E402
                     subprocess_env)

from transformer.data import sources as data_sources
from transformer.training import metrics
from transformer.runtime import multihost
from transformer.training import run_setup
from transformer.runtime import workdir as workdir_lib  # noqa: E402
from transformer.data import tokenizer as tokenizer_lib  # noqa: E402
from transformer.runtime import checkpoint_names, run_lock, run_log
from transformer.decoding import loader

TIMEOUT_S = 240
# Compiling is most of a short run: XLA's -O0 compiles several times faster.


# ----------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------


def test_resolve_makes_local_paths_absolute_and_leaves_addresses_alone(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(workdir_lib.resolve("runs/a")) == str(tmp_path / "runs" / "a")
  assert str(workdir_lib.resolve(tmp_path / "b")) == str(tmp_path / "b")
  for address in ("gs://bucket/run", "s3://bucket/a/b", "gs://bucket"):
    assert str(workdir_lib.resolve(address)) == address   # not /cwd/gs:/bucket/run
    assert not workdir_lib.is_local(address)
  assert str(workdir_lib.resolve("gs://bucket/run") / "vocab.model") == "gs://bucket/run/vocab.model"
  assert workdir_lib.is_local("runs/a") and workdir_lib.is_local(tmp_path)
  assert workdir_lib.is_local("weird:name/x")  # a colon alone is a local name


@pytest.fixture
def fake_bucket(tmp_path, monkeypatch):
  """gs://... paths, through epath, land in <tmp_path>/bucket_root/...; the
  current directory is <tmp_path>/cwd (where a mangled path would land)."""
  root = tmp_path / "bucket_root"
  root.mkdir()
  (tmp_path / "cwd").mkdir()
  monkeypatch.chdir(tmp_path / "cwd")

  def local(path):
    path = os.fspath(path)
    assert path.startswith("gs://"), path
    return str(root / path[len("gs://"):])

  def redirect(original, path, *args, **kwargs):
    return original(local(path), *args, **kwargs)

  names = ("exists", "isdir", "listdir", "makedirs", "mkdir", "open", "remove", "rmtree",
           "stat", "walk")
  with epath_testing.mock_epath(**{name: redirect for name in names}):
    yield root


class _FakeSummaryWriter:
  """tensorboardX's writer (it writes gs:// itself, with google-cloud-storage)."""

  def __init__(self, logdir):
    self.logdir = logdir

  def add_scalar(self, *args):
    pass

  def flush(self):
    pass

  def close(self):
    pass


def test_a_gs_workdir_goes_through_epath(fake_bucket, tmp_path, caplog, monkeypatch):
  """The vocabulary, configs, metrics, lock and log of a gs:// workdir:
  written to and read from the bucket, nothing under the current directory."""
  config = train_worker.tiny_config()
  train_pairs = data_sources.load_split(config.data, "train")
  workdir = str(workdir_lib.resolve("gs://bucket/run"))
  with caplog.at_level(logging.INFO, logger="transformer"):
    with run_lock.hold(workdir), run_log.run_log(workdir) as log:
      tokenizer = run_setup.get_tokenizer(config, workdir, train_pairs)
  assert log is None
  assert "cannot be locked" in caplog.text and "logging to the console only" in caplog.text
  stored = fake_bucket / "bucket" / "run" / workdir_lib.VOCAB_FILE
  assert stored.read_bytes() == tokenizer.serialized_model()
  assert not (fake_bucket / "bucket" / "run" / workdir_lib.LOCK_FILE).exists()
  assert list((tmp_path / "cwd").iterdir()) == []   # (os.path: cwd/gs:/bucket/run/...)

  model_config = run_setup.model_config_from(config, tokenizer.vocab_size)
  workdir_lib.save_configs(workdir, config.to_dict(), model_config)
  assert workdir_lib.check_config(workdir, config.to_dict()) == []
  assert workdir_lib.load_model_config(workdir) == model_config
  assert workdir_lib.vocab_path(workdir) == "gs://bucket/run/vocab.model"
  workdir_lib.check_files(workdir)
  again = run_setup.get_tokenizer(config, workdir, [])   # read back, not trained
  assert again.serialized_model() == tokenizer.serialized_model()
  assert (tokenizer_lib.load_tokenizer(workdir_lib.vocab_path(workdir)).serialized_model()
          == tokenizer.serialized_model())

  import tensorboardX
  monkeypatch.setattr(tensorboardX, "SummaryWriter", _FakeSummaryWriter)
  for steps in ([1, 2], [3]):  # (a resumed run appends)
    writer = metrics.MetricsWriter(workdir)
    for step in steps:
      writer.write(step, {"loss": 1.0 / step}, prefix="train")
    writer.close()
  lines = (fake_bucket / "bucket" / "run" / metrics.METRICS_FILE).read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
  assert list((tmp_path / "cwd").iterdir()) == []


def test_write_file_is_atomic_locally(tmp_path):
  path = tmp_path / "sub" / "f.txt"
  workdir_lib.write_file(path, "one\n")
  workdir_lib.write_file(path, b"two\n")
  assert path.read_text() == "two\n"
  assert sorted(p.name for p in path.parent.iterdir()) == ["f.txt"]


# ----------------------------------------------------------------------------
# Splitting work; one process
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_process_shares_are_contiguous_and_cover_every_item(count):
  for n in range(12):
    shares = [multihost.process_share(n, index, count) for index in range(count)]
    assert [i for share in shares for i in range(n)[share]] == list(range(n))
    sizes = [len(range(n)[share]) for share in shares]
    assert max(sizes) - min(sizes) <= 1


def test_one_process_does_everything_itself(tmp_path):
  assert jax.process_count() == 1
  shares = []
  assert multihost.split_across_processes(
      lambda xs, share: shares.append(share) or [x.upper() for x in xs], ["a", "b"]) == ["A", "B"]
  assert shares == [(0, 1)]
  assert multihost.allgather_strings(["é", ""]) == ["é", ""]
  assert multihost.broadcast_bytes(b"\x00vocab") == b"\x00vocab"
  assert multihost.common_steps([4, 2]) == [2, 4]
  assert multihost.all_processes(True) and not multihost.all_processes(False)
  assert multihost.workdirs_shared(tmp_path)
  assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------
# Cluster auto-detection (train.py with no multi-host flags)
# ----------------------------------------------------------------------------


SLURM_STEP = {"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": "node[01-02]",
              "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "2"}


@pytest.mark.parametrize("env, expected", [
    ({}, None),                                           # a plain machine
    (dict(SLURM_STEP, SLURM_NTASKS="2"), ("slurm", 2)),   # srun -n 2 python train.py
    (dict(SLURM_STEP, SLURM_NTASKS="1"), None),           # one task: run alone
    ({"SLURM_JOB_ID": "1234", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, None),  # sbatch script
    ({"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911",
      "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, ("ompi", 4)),   # mpirun -n 4
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),       # not one of ours
    (dict(SLURM_STEP, SLURM_NTASKS="two"), None),         # half-set: not ours to start
    ({"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911"}, None),  # no size
    ({"TPU_WORKER_HOSTNAMES": "t0,t1"}, None),            # no TPU here
])
def test_cluster_detected(env, expected, monkeypatch):
  for name in list(os.environ):
    if name.startswith(("SLURM_", "OMPI_", "KUBERNETES_", "TPU_", "MEGASCALE_")):
      monkeypatch.delenv(name)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(multihost, "_on_a_tpu_vm", lambda: False)
  assert multihost.cluster_detected() == expected


@pytest.mark.parametrize("env, expected", [
    ({}, ("tpuvm", None)),                                   # a TPU VM: JAX reads its metadata
    ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, ("gketpu", 4)),  # a v5e-16 slice on GKE
    ({"TPU_WORKER_HOSTNAMES": "t0,t1", "MEGASCALE_NUM_SLICES": "2"}, ("gketpu", 4)),
    ({"TPU_PROCESS_ADDRESSES": "10.0.0.1:8476", "TPU_WORKER_HOSTNAMES": "t0"}, None),  # one host
    (dict(SLURM_STEP, SLURM_NTASKS="2"), ("slurm", 2)),      # Slurm first, as JAX
])
def test_cluster_detected_on_a_tpu_machine(env, expected, monkeypatch):
  """On a machine with TPU chips (faked: `_on_a_tpu_vm`), read from GKE's
  variables, else left to JAX (the hosts are in the VM's metadata)."""
  for name in list(os.environ):
    if name.startswith(("SLURM_", "OMPI_", "KUBERNETES_", "TPU_", "MEGASCALE_")):
      monkeypatch.delenv(name)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(multihost, "_on_a_tpu_vm", lambda: True)
  assert multihost.cluster_detected() == expected


def test_no_private_jax_module_is_imported_by_the_library():
  """The library reads clusters itself: nothing of jax._src is imported by
  name (JAX may move or drop it in any release)."""
  import ast
  offenders = []
  for path in (REPO / "transformer").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if "._src" in n]
  assert not offenders, offenders


# ----------------------------------------------------------------------------
# Shared disk or not: the marker, NFS's late view, config.shared_workdir
# ----------------------------------------------------------------------------

# One of three JAX processes on localhost: workdirs_shared in each case, the
# answers (or MixedWorkdirs' message) printed as JSON on the last line.
SHARED_DISK_CASES = """
import json, os, sys
from transformer.runtime import multihost, parallel
pid, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
parallel.maybe_initialize_distributed(f"127.0.0.1:{port}", 3, pid, initialization_timeout=60)
shared, own = f"{root}/shared", f"{root}/own_{pid}"
os.makedirs(shared, exist_ok=True)
os.makedirs(own, exist_ok=True)
looks, sees = [], multihost._sees
def stale_for_process_1(path):   # NFS's cache: process 1 misses the first marker
  looks.append(path)
  return sees(path) and not (pid == 1 and len(looks) == 1)
results = {}
for case, workdir, kwargs in [
    ("shared", shared, {}), ("separate", own, {}), ("stale", shared, {}),
    ("mixed", shared if pid < 2 else own, {}),
    ("declared_no", shared, {"declared": "no"}), ("declared_yes", own, {"declared": "yes"})]:
  multihost._sees = stale_for_process_1 if case == "stale" else sees
  try:
    results[case] = multihost.workdirs_shared(workdir, pause_seconds=0.05, **kwargs)
  except multihost.MixedWorkdirs as e:
    results[case] = str(e)
results["stale_looks"] = len(looks)
print(json.dumps(results))
parallel.shutdown_distributed()
"""


def test_shared_disk_detection_retries_and_can_be_declared(tmp_path):
  """Three processes on localhost: one workdir is shared at the first look;
  a workdir each is separate; a process whose first look misses the marker
  (NFS attribute caching, faked) still finds the disk shared, at its second
  look (before: "separate", and the processes would have written the same
  checkpoint files each on its own); two processes sharing a workdir and a
  third with its own is refused, naming config.shared_workdir; declared
  "no" / "yes", the answer is taken as it is."""
  port = free_port()
  env = subprocess_env(JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")
  outputs = run_together([[sys.executable, "-c", SHARED_DISK_CASES, str(pid), str(port),
                           str(tmp_path)] for pid in range(3)], env, TIMEOUT_S)
  results = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
  for pid, result in enumerate(results):
    mixed = result.pop("mixed")
    assert result == {"shared": True, "separate": False, "stale": True,
                      "declared_no": False, "declared_yes": True,
                      "stale_looks": 2}, (pid, result)
    assert mixed.startswith("Processes [0, 1] saw process 0's marker file in the workdir "
                            "and the others did not, in 3 tries"), mixed
    assert "--config.shared_workdir=yes (or =no for a workdir each)" in mixed
  assert not list((tmp_path / "shared").iterdir())       # every marker removed


# ----------------------------------------------------------------------------
# Two processes, two disks: python train.py
# ----------------------------------------------------------------------------


SEPARATE = dict(num_train_steps=30, checkpoint_every=10, keep_checkpoints=3, average_last=2,
                num_bleu_examples=5, test_report=True, test_decode_method="greedy",
                **{"data.demo_num_test": 6})


def tiny_flags(overrides: dict) -> list[str]:
  values = dict(train_worker.TINY_OVERRIDES)
  values.update(overrides)
  return [f"--config.{k}={v}" for k, v in values.items()]


def train_py_processes(workdirs, overrides, cache_dir, *, flags=True, env=None,
                       check=True) -> list:
  """Runs one `python train.py` per workdir at once (process i in
  workdirs[i]) as one multi-process run on localhost; their outputs
  (`helpers.run_together`)."""
  port = free_port()
  env = subprocess_env(cache_dir, JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}",
                       **(env or {}))
  commands = []
  for pid, workdir in enumerate(workdirs):
    multihost_flags = ([f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                        f"--process_id={pid}"] if flags else [])
    commands.append([sys.executable, "train.py", "--config=configs/default.py", "--quiet",
                     f"--workdir={workdir}", *multihost_flags, *tiny_flags(overrides)])
  if not flags:  # (a Slurm job step: each process its own SLURM_PROCID)
    env = [dict(env, SLURM_PROCID=str(pid), SLURM_LOCALID=str(pid),
                JAX_COORDINATOR_PORT=str(port)) for pid in range(len(workdirs))]
  return run_together(commands, env, TIMEOUT_S, check=check)


def read_log(workdir: Path, pid: int) -> str:
  name = "train.log" if pid == 0 else f"train.process_{pid}.log"
  return (workdir / name).read_text()


@pytest.mark.slow  # (20-40 s on 2 cores: `python -m pytest -m slow`)
def test_two_processes_with_separate_workdirs_train_resume_and_evaluate(tmp_path,
                                                                        tmp_path_factory):
  cache = tmp_path_factory.getbasetemp() / "jax_compilation_cache"
  disks = [tmp_path / "disk_a" / "run", tmp_path / "disk_b" / "run"]

  # (The first run decodes nothing: evaluation is the second's.)
  outputs = train_py_processes(disks, dict(SEPARATE, num_bleu_examples=0, test_report=False),
                               cache)
  for pid, (disk, output) in enumerate(zip(disks, outputs)):
    assert f"Trained 30 steps into {disk}" in output
    # Each workdir alone holds what decoding and resuming need (today process 1
    # looked for process 0's vocab.model in its own workdir and stopped).
    for name in ("vocab.model", "config.json", "model_config.json"):
      assert (disk / name).exists(), (disk, name)
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["10", "20", "30"]
    assert [p.name for p in (disk / "checkpoints" / "30" / "data_state").glob("*.json")] == [
        f"process_{pid}-of-2.json"]
  assert (disks[0] / "vocab.model").read_bytes() == (disks[1] / "vocab.model").read_bytes()
  assert (disks[0] / "metrics.jsonl").exists() and not (disks[1] / "metrics.jsonl").exists()

  # A process killed after one of them finished step 30: disk_b lacks it.
  # Both resume from step 20 (disk_a's 30 is removed), then train to 40.
  (disks[1] / "checkpoints" / "30").rename(tmp_path / "step_30_of_b")
  outputs = train_py_processes(disks, dict(SEPARATE, num_train_steps=40), cache)
  done = {"validation": [], "test": []}  # (per process: how many each did, per evaluation)
  for pid, (disk, output) in enumerate(zip(disks, outputs)):
    assert f"Trained 40 steps into {disk}" in output
    log = read_log(disk, pid)
    assert f"Resumed from step 20 in {disk}" in log
    assert ("Removing checkpoint step 30" in log) == (pid == 0)
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["20", "30", "40"]
    assert [p.name for p in (disk / "checkpoints_averaged").iterdir()] == ["40"]
    # Evaluation split: each process decodes every second batch of the same
    # batches (`multihost.split_across_processes`): 5 validation sentences,
    # 6 test sentences, each decoded by exactly one process.
    for what, total in (("validation", 5), ("test", 6)):
      counts = re.findall(rf"Process {pid} of 2: (\d+) of the {total} {what} sentences done here",
                          log)
      assert counts, (what, log)
      done[what].append([int(n) for n in counts])
  for what, total in (("validation", 5), ("test", 6)):
    assert len(done[what][0]) == len(done[what][1]), (what, done[what])
    per_evaluation = zip(*done[what])  # (process 0's count, process 1's) at each one
    assert all(sum(counts) == total for counts in per_evaluation), (what, done[what])

  # Each disk alone decodes: the same (averaged) parameters in both ...
  translators = [loader.load_translator(str(disk)) for disk in disks]
  for a, b in zip(jax.tree.leaves(translators[0].params), jax.tree.leaves(translators[1].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # ... and the split evaluation is that of one process decoding everything.
  config = train_worker.tiny_config(dict(SEPARATE, num_train_steps=40))
  test_pairs = data_sources.load_split(config.data, "test")
  expected = translators[1].translate([s for s, _ in test_pairs], method="greedy")
  assert len(set(expected)) > 1   # (distinct translations: the order is checked)
  for disk in disks:
    assert (disk / "test_translations.txt").read_text() == "".join(h + "\n" for h in expected)
  bleu_pairs = data_sources.load_split(config.data, "eval")[:5]
  hypotheses = translators[1].translate([s for s, _ in bleu_pairs], method="greedy")
  scores = metrics.translation_scores(hypotheses, [t for _, t in bleu_pairs])
  records = [json.loads(line) for line in (disks[0] / "metrics.jsonl").read_text().splitlines()]
  final = [r for r in records if r["split"] == "eval_averaged" and r["step"] == 40]
  assert len(final) == 1
  for name in ("bleu", "chrf", "exact_match", "length_ratio"):
    assert final[0][name] == pytest.approx(scores[name], abs=1e-9), name
  test_scores = metrics.translation_scores(expected, [t for _, t in test_pairs])
  test_record = [r for r in records if r["split"] == "test" and r["step"] == 40]
  assert test_record[0]["chrf"] == pytest.approx(test_scores["chrf"], abs=1e-9)

  # FSDP state on separate disks would leave each with its own slices only:
  # refused at the start, by both processes, naming the option.
  results = train_py_processes(disks, dict(SEPARATE, num_train_steps=50, state_sharding="fsdp"),
                               cache, check=False)
  for (status, output), disk in zip(results, disks):
    assert status != 0 and "state_sharding='fsdp' needs one workdir" in output, output[-3000:]
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["20", "30", "40"]


SLURM_ON_LOCALHOST = {"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": "localhost",
                      "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "1"}


@pytest.mark.slow  # (20-25 s on 2 cores; the default suite's two-process train.py run is
# test_a_slurm_job_step_sigterm_to_one_task_stops_both_at_one_saved_step below)
def test_a_slurm_job_step_starts_without_multihost_flags(tmp_path, tmp_path_factory):
  """`srun -n 2 python train.py --workdir=...` on one node: no multi-host
  flags; JAX's Slurm detection (the port from $JAX_COORDINATOR_PORT) finds
  the other process. One shared workdir: orbax writes one checkpoint."""
  cache = tmp_path_factory.getbasetemp() / "jax_compilation_cache"
  workdir = tmp_path / "run"
  outputs = train_py_processes([workdir, workdir], dict(num_train_steps=2, checkpoint_every=2),
                               cache, flags=False, env=SLURM_ON_LOCALHOST)
  for output in outputs:
    assert "A slurm job of 2 processes: starting JAX's distributed runtime" in output
    assert f"Trained 2 steps into {workdir}" in output
  assert sorted(p.name for p in (workdir / "checkpoints" / "2" / "data_state").glob("*.json")) == [
      "process_0-of-2.json", "process_1-of-2.json"]
  meta = json.loads((workdir / "checkpoints" / "2" / "meta" / "metadata").read_text())
  assert meta["process_count"] == 2
  assert "Every process has a workdir of its own" not in read_log(workdir, 0)


def test_a_slurm_job_step_sigterm_to_one_task_stops_both_at_one_saved_step(tmp_path):
  """The default suite's one run of two `python train.py` processes (what
  the slow test above and tests/test_training.py's
  test_sigterm_to_one_of_two_processes_stops_both_at_one_saved_step check,
  read off one run): a Slurm job step of two tasks, no multi-host flags,
  starts JAX's distributed runtime by itself; a SIGTERM sent to task 1 alone
  (Slurm's notice before it ends a job) reaches both through JAX's
  preemption service: they save the same step together into the one shared
  workdir (a data position per process) and exit with 143."""
  workdir, port = tmp_path / "run", free_port()
  env = subprocess_env(tmp_path / "cache", JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")
  commands = [[sys.executable, "train.py", "--config=configs/default.py", "--quiet",
               f"--workdir={workdir}", *tiny_flags(dict(num_train_steps=100_000, log_every=1))]
              for _ in range(2)]
  envs = [dict(env, **SLURM_ON_LOCALHOST, SLURM_PROCID=str(pid), SLURM_LOCALID=str(pid),
               JAX_COORDINATOR_PORT=str(port)) for pid in range(2)]
  statuses, outputs = sigterm_one_once_training(commands, envs, workdir, 1, TIMEOUT_S)
  assert statuses == [143, 143], [out[-3000:] for out in outputs]
  (saved,) = checkpoint_names.checkpoint_steps(workdir)
  for output in outputs:
    assert "A slurm job of 2 processes: starting JAX's distributed runtime" in output, output
    assert (f"preempted (a preemption notice) at step {saved}: saved checkpoint {saved} in "
            in output), output[-3000:]
  assert sorted(p.name for p in (workdir / "checkpoints" / str(saved) / "data_state").glob(
      "*.json")) == ["process_0-of-2.json", "process_1-of-2.json"]
  meta = json.loads((workdir / "checkpoints" / str(saved) / "meta" / "metadata").read_text())
  assert meta["process_count"] == 2
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, saved + 1))
  assert "Every process has a workdir of its own" not in read_log(workdir, 0)
