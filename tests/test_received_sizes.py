"""What a received model will cost is known before it is allocated
(docs/security.md, `runtime/model_memory.py`): a model_config.json whose
fields are each in range but together ask for hundreds of terabytes is one
sentence, before anything is allocated, from decode.py, `transformer.load_translator` and
train.py --config.init_from, and a Marian archive whose members inflate past
the model its options describe (a zip bomb) is refused before one is inflated.
The parameters' size is exact: the paper's count by hand, the fixture
checkpoint's arrays, and the full trace of modest models.

Fast: no training, nothing compiled; the workdir is a copy of
tests/fixtures/workdir_d26a6fb, the Marian release test_marian.py's."""

from __future__ import annotations

import io
import json
import shutil
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from helpers import subprocess_env
from transformer.model.config import TransformerConfig
from transformer.model.param_size import ParameterSize, parameter_size, traced_size
from transformer.runtime import model_memory
from transformer.runtime.model_memory import Memory

REPO = Path(__file__).resolve().parents[1]
FIXTURE_WORKDIR = REPO / "tests" / "fixtures" / "workdir_d26a6fb"
# Legal field by field (model/config.py's MAX_SIZES), 224 TiB together.
HOSTILE_SIZES = {"d_model": 65536, "num_heads": 512, "d_ff": 262144,
                 "num_encoder_layers": 512, "num_decoder_layers": 512}
GiB = 1 << 30


def one_sentence(message: str, names) -> str:
  """`message`, checked to be one line without a traceback that names `names`."""
  assert "\n" not in message.strip() and "Traceback" not in message, message
  assert str(names) in message, message
  assert len(message) < 1000, message
  return message


def papers_count(c: TransformerConfig) -> int:
  """The parameters of a post-LN model with one shared, tied embedding and
  sinusoidal positions, counted as the paper's Section 3 builds it: each
  attention's four d x d projections and their biases, each feed-forward
  network's two matrices and biases, a LayerNorm's scale and bias around
  every sub-layer (2 sub-layers an encoder layer, 3 a decoder layer)."""
  d, f = c.d_model, c.d_ff
  attention = 4 * d * d + 4 * d
  feed_forward = d * f + f + f * d + d
  norm = 2 * d
  encoder_layer = attention + feed_forward + 2 * norm
  decoder_layer = 2 * attention + feed_forward + 3 * norm
  return (c.vocab_size * d + c.num_encoder_layers * encoder_layer
          + c.num_decoder_layers * decoder_layer)


def hostile_workdir(tmp_path, sizes=HOSTILE_SIZES) -> Path:
  """A copy of the fixture workdir whose model_config.json has `sizes`."""
  copy = tmp_path / "received_workdir"
  shutil.copytree(FIXTURE_WORKDIR, copy)
  stored = json.loads((copy / "model_config.json").read_text())
  (copy / "model_config.json").write_text(json.dumps({**stored, **sizes}))
  return copy


@pytest.fixture()
def terabyte_workdir(tmp_path):
  """A copy of the fixture workdir whose model_config.json asks for 224 TiB."""
  return hostile_workdir(tmp_path)


# ----------------------------------------------------------------------------
# The size, exactly
# ----------------------------------------------------------------------------


def test_the_size_is_the_papers_count_and_the_checkpoints_arrays():
  import orbax.checkpoint as ocp
  import jax
  from transformer.runtime import workdir as workdir_lib
  config = workdir_lib.load_model_config(str(FIXTURE_WORKDIR))
  size = parameter_size(config)
  assert size.count == papers_count(config) == 55_552
  assert size.bytes == 4 * 55_552  # (float32)
  stored = ocp.StandardCheckpointer().metadata(
      FIXTURE_WORKDIR / "checkpoints_averaged" / "600" / "params")
  arrays = jax.tree.leaves(getattr(stored, "item_metadata", stored))
  assert len(arrays) == 85
  assert size.count == sum(int(np.prod(a.shape)) for a in arrays)
  assert size.bytes == sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays)


@pytest.mark.parametrize("changes", [
    {},
    {"num_encoder_layers": 3, "num_decoder_layers": 5, "normalization": "pre"},
    {"share_embeddings": False, "logits_via_embedding": False, "logits_bias": True,
     "positional": "learned", "num_encoder_layers": 4, "num_decoder_layers": 1},
    {"scan_layers": True, "param_dtype": "bfloat16", "num_encoder_layers": 1,
     "num_decoder_layers": 6, "activation": "swish"},
])
def test_three_shallow_traces_give_the_full_traces_size(changes):
  """Extrapolated from 1 + 1, 2 + 1 and 1 + 2 layers: exact, as the full trace."""
  config = TransformerConfig(vocab_size=400, d_model=32, num_heads=4, d_ff=64, max_len=64,
                             num_encoder_layers=2, num_decoder_layers=2).replace(**changes)
  assert parameter_size(config) == traced_size(config)


def test_a_legal_terabyte_config_is_sized_exactly_from_shallow_traces():
  config = TransformerConfig(vocab_size=400, **HOSTILE_SIZES)
  parameter_size(config.replace(num_encoder_layers=2))  # (flax imported, traced once)
  size = parameter_size(config)
  assert size.count == papers_count(config) == 61_573_751_111_680
  assert size.bytes == 4 * size.count  # 224 TiB


# ----------------------------------------------------------------------------
# The rule: what fits where (runtime/model_memory.py's docstring)
# ----------------------------------------------------------------------------


def test_what_each_use_needs_on_a_cpu_and_on_accelerators():
  uses = model_memory.USES
  cpu = Memory(100, "this machine's memory", local_devices=1)
  cpus = Memory(100, "this machine's memory", local_devices=8)
  gpus = Memory(100, "this machine's memory", accelerator=True, device_bytes=40,
                device_name="one GPU's memory", local_devices=8)
  need = model_memory.needs
  assert need(10, uses["decoding"], cpu) == [(10, 100, "this machine's memory")]
  assert need(10, uses["fine-tuning"], cpu)[0][0] == 40
  assert need(10, uses["importing"], cpu)[0][0] == 20
  # CPU devices share the host's memory: a replicated copy each, or one in all.
  assert need(10, uses["decoding"], cpus)[0][0] == 80
  assert need(10, uses["fine-tuning"], cpus, sharded_over=8)[0][0] == 40
  # Accelerators: the host reads the parameters once; each device holds its copies
  # whole, or its share of them; over two hosts, each host reads its half.
  assert need(10, uses["decoding"], gpus) == [(10, 100, "this machine's memory"),
                                              (10, 40, "one GPU's memory")]
  assert need(10, uses["fine-tuning"], gpus, sharded_over=8) == [
      (10, 100, "this machine's memory"), (5, 40, "one GPU's memory")]
  assert need(10, uses["fine-tuning"], gpus, sharded_over=16)[0][0] == 5
  assert need(10, uses["importing"], gpus) == [(20, 100, "this machine's memory")]


def test_a_model_one_byte_too_large_is_one_sentence_with_the_numbers():
  config = TransformerConfig(vocab_size=400, d_model=32, num_heads=4, d_ff=64)
  size = ParameterSize(count=10 * GiB, bytes=40 * GiB)

  def gpu(device_bytes):
    return Memory(64 * GiB, "this machine's memory", accelerator=True,
                  device_bytes=device_bytes, device_name="one H200's memory")

  for use, fits in (("decoding", 40 * GiB), ("fine-tuning", 160 * GiB)):
    assert model_memory.check_fits(config, "m.json", use, size=size, machine=gpu(fits)) == size
    with pytest.raises(model_memory.ModelTooLarge):
      model_memory.check_fits(config, "m.json", use, size=size, machine=gpu(fits - 1))
  with pytest.raises(ValueError) as e:
    model_memory.check_fits(config, "/a/model_config.json", "fine-tuning", size=size,
                            machine=gpu(141 * GiB))
  assert one_sentence(str(e.value), "/a/model_config.json") == (
      "/a/model_config.json: this model needs 160.0 GiB to fine-tune (4 x 40.0 GiB: its "
      "parameters, their gradients and Adam's two moments; 10,737,418,240 float32 "
      "parameters: d_model 32, d_ff 64, 6 + 6 layers, vocab_size 400), more than the "
      "141.0 GiB of one H200's memory; fine-tune it on a machine with more memory (or with "
      "--config.state_sharding=fsdp over more accelerators), or check that "
      "model_config.json describes the model you meant.")
  assert model_memory.check_fits(config, "/a/model_config.json", "fine-tuning", size=size,
                                 machine=gpu(141 * GiB), sharded_over=2) == size
  with pytest.raises(model_memory.ModelTooLarge, match="than the 40.0 GiB of this container"):
    model_memory.check_fits(config, "m.npz", "importing", size=size,
                            machine=Memory(40 * GiB, "this container's memory limit"))


# ----------------------------------------------------------------------------
# A terabyte model_config.json: decode.py, load_translator, init_from
# ----------------------------------------------------------------------------


def _check_refusal(message: str, workdir: Path, verb: str, sizes=HOSTILE_SIZES) -> None:
  config = TransformerConfig(vocab_size=400, **sizes)
  one_sentence(message, workdir / "model_config.json")
  assert "this model needs" in message and f"to {verb}" in message, message
  assert f"{papers_count(config):,} float32 parameters" in message, message
  assert (f"d_model 65,536, d_ff 262,144, {config.num_encoder_layers} + "
          f"{config.num_decoder_layers} layers") in message, message
  assert "TiB" in message and "GiB of this" in message, message


def test_decode_py_refuses_a_terabyte_model_in_one_line(terabyte_workdir):
  proc = subprocess.run([sys.executable, "decode.py", f"--workdir={terabyte_workdir}"],
                        input="hello\n", cwd=REPO, env=subprocess_env(), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr
  assert proc.stdout == ""
  message = proc.stderr.strip()
  assert message.startswith("error: "), message
  _check_refusal(message, terabyte_workdir, "decode")


@pytest.mark.parametrize("layers", [512, 12])
def test_load_translator_refuses_a_terabyte_model(tmp_path, layers):
  """512 + 512 layers are sized from three shallow traces before the whole
  model would be (40 s); 12 + 12 from the whole model's trace (0.5 s)."""
  import transformer
  sizes = dict(HOSTILE_SIZES, num_encoder_layers=layers, num_decoder_layers=layers)
  workdir = hostile_workdir(tmp_path, sizes)
  with pytest.raises(ValueError) as e:
    transformer.load_translator(str(workdir))
  assert isinstance(e.value, model_memory.ModelTooLarge)
  _check_refusal(str(e.value), workdir, "decode", sizes)


def test_init_from_a_terabyte_model_is_refused_before_anything_is_allocated(
    terabyte_workdir, tmp_path):
  import ml_collections
  from transformer.training import run_setup
  config = ml_collections.ConfigDict({"init_from": str(terabyte_workdir)})
  with pytest.raises(ValueError) as e:
    run_setup.load_init_from_config(config)
  message = str(e.value)
  assert message.startswith(f"config.init_from={terabyte_workdir}: ")
  _check_refusal(message, terabyte_workdir, "fine-tune")
  # train.py: one line and status 1, before its vocabulary or its model.
  workdir = tmp_path / "tuned"
  proc = subprocess.run(
      [sys.executable, "train.py", f"--workdir={workdir}", "--quiet",
       f"--config.init_from={terabyte_workdir}", "--config.data.demo_num_train=200",
       "--config.data.demo_num_eval=8"],
      cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr
  message = proc.stderr.strip()
  assert message.startswith(f"error: config.init_from={terabyte_workdir}: "), message
  _check_refusal(message, terabyte_workdir, "fine-tune")
  assert not (workdir / "vocab.model").exists() and not (workdir / "checkpoints").exists()


# ----------------------------------------------------------------------------
# Marian / OPUS-MT: a model that does not fit, an archive that is a zip bomb
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def marian_release(tmp_path_factory):
  pytest.importorskip("safetensors.numpy")
  from test_marian import write_release
  return write_release(tmp_path_factory.mktemp("marian") / "release")


def _npy(array: np.ndarray) -> bytes:
  buffer = io.BytesIO()
  np.lib.format.write_array(buffer, array, allow_pickle=False)
  return buffer.getvalue()


def _npy_header(shape: tuple, descr: str = "<f4") -> bytes:
  buffer = io.BytesIO()
  np.lib.format.write_array_header_1_0(
      buffer, {"descr": descr, "fortran_order": False, "shape": shape})
  return buffer.getvalue()


def _stored(data: bytes) -> tuple:
  """A member's (method, crc, size, parts) as stored (no compression)."""
  return 0, zlib.crc32(data), len(data), [data]


def _deflated_zeros(header: bytes, zero_bytes: int, chunk: int = 64 << 20) -> tuple:
  """A member's (method, crc, size, parts): `header` then `zero_bytes` zeros,
  deflated. The zeros are one `chunk` deflated once and repeated (a full flush
  ends it byte-aligned and refers back no further), so a 10 GiB member takes
  10 MiB and the crc32 pass over the zeros (2 s), not deflating 10 GiB (17 s)."""
  assert zero_bytes % chunk == 0
  head = zlib.compressobj(9, zlib.DEFLATED, -15)
  first = head.compress(header) + head.flush(zlib.Z_FULL_FLUSH)
  zeros = zlib.compressobj(9, zlib.DEFLATED, -15)
  block = zeros.compress(bytes(chunk)) + zeros.flush(zlib.Z_FULL_FLUSH)
  last = zlib.compressobj(9, zlib.DEFLATED, -15).flush()  # (the final, empty block)
  crc, zero_chunk = zlib.crc32(header), bytes(chunk)
  for _ in range(zero_bytes // chunk):
    crc = zlib.crc32(zero_chunk, crc)
  return 8, crc, len(header) + zero_bytes, [first] + [block] * (zero_bytes // chunk) + [last]


def _write_zip(path: Path, members: dict[str, tuple]) -> None:
  """A zip of `members` (name: (method, crc, size, compressed parts)), each
  with its sizes in a ZIP64 extra field (a member may pass 4 GiB)."""
  directory = []
  with open(path, "wb") as f:
    for name, (method, crc, size, parts) in members.items():
      raw = name.encode()
      extra = struct.pack("<HHQQ", 1, 16, size, sum(len(p) for p in parts))
      offset = f.tell()
      f.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, method, 0, 0x21, crc,
                          0xFFFFFFFF, 0xFFFFFFFF, len(raw), len(extra)) + raw + extra)
      for part in parts:
        f.write(part)
      directory.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, method, 0,
                                   0x21, crc, 0xFFFFFFFF, 0xFFFFFFFF, len(raw), len(extra),
                                   0, 0, 0, 0, offset) + raw + extra)
    start, listing = f.tell(), b"".join(directory)
    f.write(listing + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(directory),
                                  len(directory), len(listing), start, 0))


def _bombed_release(marian_release, tmp_path, member: str, zero_bytes: int) -> Path:
  """A copy of the release whose model.npz has `member` replaced by one that
  inflates to a float32 .npy array of `zero_bytes` zeros."""
  release = tmp_path / "release"
  shutil.copytree(marian_release[0], release)
  with np.load(release / "model.npz") as npz:
    arrays = {name: npz[name] for name in npz.files}
  members = {f"{name}.npy": _stored(_npy(array)) for name, array in arrays.items()}
  members[f"{member}.npy"] = _deflated_zeros(_npy_header((zero_bytes // 4,)), zero_bytes)
  _write_zip(release / "model.npz", members)
  return release


def test_the_zip_bomb_is_a_sound_archive_that_inflates_as_it_says(marian_release, tmp_path):
  """(The test's bomb is what it claims: np.load reads its other members, and
  Python's zipfile inflates the bomb member, 4 repeated chunks here, to the
  header and zeros it declares, its crc32 checked at the end.)"""
  zero_bytes = 256 << 20
  release = _bombed_release(marian_release, tmp_path, "Wemb", zero_bytes)
  assert (release / "model.npz").stat().st_size < 1 << 20
  with np.load(release / "model.npz") as npz:
    assert np.array_equal(npz["encoder_l1_ffn_W1"], marian_release[1]["encoder_l1_ffn_W1"])
    info = npz.zip.getinfo("Wemb.npy")
    assert info.file_size == len(_npy_header((zero_bytes // 4,))) + zero_bytes
    with npz.zip.open(info) as member:
      assert np.lib.format.read_magic(member) == (1, 0)
      assert np.lib.format.read_array_header_1_0(member)[0] == (zero_bytes // 4,)
      inflated = 0
      while chunk := member.read(16 << 20):  # (zipfile checks the crc32 at the end)
        assert chunk == bytes(len(chunk))
        inflated += len(chunk)
  assert inflated == zero_bytes


@pytest.mark.parametrize("member", ["Wemb", "special:model.yml"])
def test_a_zip_bomb_is_refused_before_it_is_inflated(marian_release, tmp_path, member):
  from transformer.interop import marian, marian_formats
  release = _bombed_release(marian_release, tmp_path, member, 1 * GiB)
  tracemalloc.start()
  try:
    with pytest.raises(marian_formats.MarianImportError) as e:
      marian.import_model(str(release), str(tmp_path / "imported"))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  message = one_sentence(str(e.value), release / "model.npz")
  assert f"{member} inflates to 1.0 GiB" in message or f"{member}, to 1.0 GiB" in message, \
      message
  assert peak < 32 << 20, peak  # (the arrays are 49 KiB; the bomb 1 GiB)
  assert not (tmp_path / "imported").exists()


def test_an_npy_header_that_claims_more_than_its_member_holds_is_refused(marian_release,
                                                                       tmp_path):
  """numpy allocates what an .npy header declares before it reads a byte."""
  from transformer.interop import marian, marian_formats
  release = tmp_path / "release"
  shutil.copytree(marian_release[0], release)
  with np.load(release / "model.npz") as npz:
    arrays = {name: npz[name] for name in npz.files}
  members = {f"{name}.npy": _stored(_npy(array)) for name, array in arrays.items()}
  members["Wemb.npy"] = _stored(_npy_header((1 << 40,)) + arrays["Wemb"].astype("<f4").tobytes())
  _write_zip(release / "model.npz", members)
  with pytest.raises(marian_formats.MarianImportError) as e:
    marian.import_model(str(release), str(tmp_path / "imported"))
  assert "member Wemb declares a float32 array of shape (1099511627776,)" in one_sentence(
      str(e.value), release / "model.npz")


def _run_limited(args: list[str], data_limit: int, timeout: float,
                 peak_file: Path) -> tuple[int, str, int]:
  """(exit status, output, peak resident bytes) of `python -m <args>` with its
  data segment limited to `data_limit` (RLIMIT_DATA, set in the child's own
  Python: an allocation past it fails there at once, so a regression fails
  the test rather than the machine). The peak is the child's own VmHWM,
  written to `peak_file` as it exits (`ru_maxrss` would count the pages of
  this process, which it shares until it execs: a pytest worker's GBs)."""
  code = ("import atexit, resource, runpy, sys; "
          f"resource.setrlimit(resource.RLIMIT_DATA, ({data_limit}, {data_limit})); "
          "atexit.register(lambda: open(" f"{str(peak_file)!r}" ", 'w').write(next("
          "l for l in open('/proc/self/status') if l.startswith('VmHWM:')))); "
          f"sys.argv = {['-m', *args[1:]]!r}; runpy.run_module({args[0]!r}, run_name='__main__')")
  try:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"still running after {timeout} s: {args}\n{e.output!r}")
  output = proc.stdout.decode(errors="replace")
  peak_kib = int(peak_file.read_text().split()[1])  # ("VmHWM:  123456 kB")
  return proc.returncode, output, peak_kib * 1024


def test_the_import_command_refuses_a_10_gib_zip_bomb_uninflated(marian_release, tmp_path):
  release = _bombed_release(marian_release, tmp_path, "Wemb", 10 * GiB)
  assert (release / "model.npz").stat().st_size < 16 << 20
  status, output, peak = _run_limited(
      ["transformer.interop.marian", f"--model={release}", f"--workdir={tmp_path / 'out'}"],
      data_limit=4 * GiB, timeout=120, peak_file=tmp_path / "peak")
  assert status == 2, output
  message = output.strip()
  assert message.startswith("error: "), message
  one_sentence(message, release / "model.npz")
  assert "Wemb, to 10.0 GiB from" in message, message
  assert peak < 1 * GiB, (peak, output)
  assert not (tmp_path / "out").exists()


def test_a_hugging_face_config_of_a_terabyte_model_is_refused_unread(marian_release, tmp_path):
  from test_marian import write_hf
  from transformer.interop import marian
  directory, weights, pieces = marian_release
  hf = write_hf(tmp_path / "hf", weights, pieces, directory)
  config = json.loads((hf / "config.json").read_text())
  config.update(d_model=65536, encoder_attention_heads=512, decoder_attention_heads=512,
                encoder_ffn_dim=262144, decoder_ffn_dim=262144, encoder_layers=512,
                decoder_layers=512)
  (hf / "config.json").write_text(json.dumps(config))
  (hf / "model.safetensors").write_bytes(b"never read")
  with pytest.raises(model_memory.ModelTooLarge) as e:
    marian.import_model(str(hf), str(tmp_path / "imported"))
  message = one_sentence(str(e.value), hf / "config.json")
  assert "to import (2 x " in message and "d_model 65,536" in message, message
