"""Compiled decoders kept on disk, so that a second decode.py neither traces nor
compiles them.

JAX's persistent compilation cache (`runtime/compile_cache.py`) spares a new
process XLA's compile of a decoder it compiled before, but not the tracing and
lowering that come first: 1.3-1.6 s per batch shape for greedy search and
1.3-3.7 s for beam search, against 0.3-0.9 s for the cache hit itself (the
small-corpus model, 2-core CPU, 2026-11-25). A file of 1,000 lines needs 4
shapes (`batching.length_batches`). Here each compiled decoder is serialized
(`jax.experimental.serialize_executable`) into
`<compilation cache>/decoders/<key>.bin`, and a process that needs the same
decoder loads it back in milliseconds.

The key is a hash of everything the program depends on: this package's
source (every `.py` file under `transformer/`), the jax and jaxlib versions,
the backend and the devices (platform version, device kinds and ids, the
process; on a CPU the host's instruction-set flags, since XLA compiles for the
CPU it runs on), the jax settings that change a program (matmul precision,
x64) and $XLA_FLAGS, and what the caller names: the model config, the shapes,
dtypes and shardings of the arguments and the decoder's options. A change to
any of them is a new key, so a stale decoder is never run.

Only a decoder XLA compiled in this process is kept: one that JAX read back
from its persistent compilation cache serializes without its compiled
functions ("Function ... not found" when the loaded copy runs; jax 0.10.2,
CPU), so on such a cache hit the decoder is compiled once more, the
persistent cache bypassed, and that copy is kept (`_compile_fresh`).

Beside them, `load_or_eval_shape` keeps the abstract result of tracing a
function (`<key>.shapes`): a Translator's parameter shapes, which otherwise
cost a trace of the whole model at every start (0.26-0.47 s of a 2 s
`decode.py` of one line on 2 cores); and the Translator keeps its one other
program, the output projection's layout (`<key>.logits_kernel`). A start
that finds all of them traces nothing, so it never imports flax.

Every file is sealed (`runtime/signing.py`: an HMAC-SHA256 tag under a key
only this user on this machine holds) and nothing is deserialized unless its
tag verifies: a serialized executable is a pickle, and a workdir is data that
anyone may hand over (docs/security.md). A file that is not sealed here (a
planted pickle, random bytes, a truncated write, a copy from another machine)
is said once per directory, in one line, then compiled afresh (the shapes
traced) and stored sealed with this machine's key. The parameters' shapes are
plain data and kept as JSON. A sealed file that still does not load is
removed and made again. The directory is kept under MAX_BYTES (2 GiB): each
new file removes the least recently used ones beyond it (a load marks its
file used). The cache is off when the compilation cache is
(`--compilation_cache=off`), and by itself with $TRANSFORMER_DECODER_CACHE=off
(JAX's compilation cache still on: each decoder is then traced and lowered at
every start, and XLA's compile read back from JAX's cache as it is; the test
suite's setting, so that its decoders are compiled as a first start compiles
them while its programs are compiled once per machine).

The decoders travel with the model: a Translator loaded from a workdir
(`loader.load_translator`) also keeps them in `<workdir>/compiled/`
(`model_directory`), under the same keys, and looks there first; a decoder
found only in the machine's cache is copied there. A workdir copied to Drive,
a bucket or a serving host of the same kind (the key names the platform,
devices, CPU flags, versions and code) then starts warm on a machine whose
cache is empty, where that machine holds the same key (a copy of the key
file), or after `trust` (`decode.py --trust_compiled=KEY`) sealed anew with
its own key those whose tags verify under KEY, the other machine's. That
directory is kept under MAX_MODEL_BYTES (256 MiB, least recently used
first; the small-corpus model's decoders for 1,000 lines take 4-9 MB); it
is not used for a workdir that is not local, with several processes, with
the cache off, or with $TRANSFORMER_WORKDIR_DECODERS=off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib

from transformer.data import received
from transformer.data.text_io import write_atomically
from transformer.runtime import compile_cache, signing
from transformer.runtime import workdir as workdir_lib

logger = logging.getLogger(__name__)

_persistent_cache_hits = 0  # JAX's count of programs read from its compilation cache
_CACHE_OFF = threading.Lock()  # held while `_compile_fresh` turns that cache off


def _count_cache_hits(event: str, **kwargs) -> None:
  global _persistent_cache_hits
  if event == "/jax/compilation_cache/cache_hits":
    _persistent_cache_hits += 1


jax.monitoring.register_event_listener(_count_cache_hits)

SUBDIRECTORY = "decoders"
MODEL_SUBDIRECTORY = "compiled"  # in a workdir: its decoders (`model_directory`)
FORMAT = 3  # bump when what a file holds changes (3: sealed, shapes as JSON)
MAX_BYTES = 2 << 30  # the directory's files beyond this: the least recently used go
MAX_MODEL_BYTES = 256 << 20  # ... and a workdir's
# The names this cache writes (`key` + the suffix of what it holds): the only
# files its pruning removes, whatever else a directory holds.
FILE_NAMES = re.compile(r"[0-9a-f]{32}\.(bin|shapes|logits_kernel)")
MODEL_ENV = "TRANSFORMER_WORKDIR_DECODERS"  # "off": no decoders kept in workdirs
DECODER_CACHE_ENV = "TRANSFORMER_DECODER_CACHE"  # "off": JAX's cache only (`directory`)


def directory(subdirectory: str = SUBDIRECTORY) -> Path | None:
  """Where compiled decoders are kept: `decoders/` (or `subdirectory`) in the
  compilation cache's directory; None when that cache is off, or when only
  JAX's programs are cached ($TRANSFORMER_DECODER_CACHE=off: then neither
  decoders nor serving copies are kept, here or in workdirs)."""
  base = jax.config.jax_compilation_cache_dir
  if not base or os.environ.get(DECODER_CACHE_ENV, "").lower() == "off":
    return None
  return Path(base) / subdirectory


def model_directory(model) -> Path | None:
  """`<workdir>/compiled/` of `model` (a `workdir.Workdir`, a workdir's path,
  or None), where
  its decoders travel with it; None without one, with the cache off or
  $TRANSFORMER_WORKDIR_DECODERS=off (the tests' setting: they never write
  into the repository's fixtures), for a workdir that is not a local path, or
  with several processes."""
  path = None if model is None else os.fspath(getattr(model, "path", model))
  if (path is None or directory() is None or os.environ.get(MODEL_ENV, "") == "off"
      or jax.process_count() > 1 or not workdir_lib.is_local(path)):
    return None
  compiled = Path(path) / MODEL_SUBDIRECTORY
  try:  # (written into and pruned: a real folder of the workdir, never a link out)
    received.check_directory(compiled, root=path, what="the workdir's compiled decoders")
  except received.RefusedFile as e:
    if compiled not in _refused_in:  # (once per workdir and process)
      _refused_in.add(compiled)
      logger.warning("%s; no decoder is read or kept there (decoding goes on).", e)
    return None
  return compiled


def _hash_sources() -> str:
  """SHA-256 of every .py file of this package (names and bytes)."""
  root = Path(__file__).resolve().parents[1]
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    digest.update(str(path.relative_to(root)).encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()


# Read once, when the package is imported: the code this process runs, even
# if its files are replaced while it runs (a reinstall, an edit).
_SOURCE_HASH = _hash_sources()


def source_hash() -> str:
  return _SOURCE_HASH


@functools.lru_cache(maxsize=1)
def _cpu_flags_line() -> str:
  """/proc/cpuinfo's line of instruction-set flags ("" where Linux does not say)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      return next((line for line in f if line.startswith(("flags", "Features"))), "").strip()
  except OSError:
    return ""


def _host_cpu() -> str:
  """The CPU XLA compiles for: its instruction-set flags where Linux says them."""
  return f"{platform.machine()} {platform.processor()} {_cpu_flags_line()}"


def host_cpu_flags() -> set[str]:
  """This CPU's instruction-set flags as Linux names them (empty elsewhere)."""
  return set(_cpu_flags_line().partition(":")[2].split())


def key(parts: dict) -> str:
  """The file name of the decoder that `parts` (the caller's description)
  and this process's code, versions, devices and settings determine."""
  devices = jax.local_devices()
  backend = devices[0].client
  everything = {
      "format": FORMAT, "source": source_hash(), "jax": jax.__version__,
      "jaxlib": jaxlib.__version__, "platform": backend.platform,
      "platform_version": backend.platform_version,
      "devices": [(d.id, d.device_kind, d.process_index) for d in devices],
      "process": (jax.process_index(), jax.process_count()),
      "cpu": _host_cpu() if backend.platform == "cpu" else "",
      "settings": (str(jax.config.jax_default_matmul_precision),
                   bool(jax.config.jax_enable_x64), os.environ.get("XLA_FLAGS", "")),
      "parts": parts,
  }
  text = json.dumps(everything, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def describe(tree) -> str:
  """The shapes, dtypes and shardings of a pytree of arguments (for `key`)."""
  def leaf(x):
    return (getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__)),
            str(getattr(x, "sharding", "")))
  return str(jax.tree.map(leaf, tree))


def _compile_fresh(compile_fn: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
  """compile_fn(), compiled by XLA here rather than read from JAX's persistent
  compilation cache (which would not serialize whole: module docstring)."""
  from jax.experimental.compilation_cache import compilation_cache
  hits = _persistent_cache_hits
  compiled = compile_fn()
  if _persistent_cache_hits == hits:  # (another thread's hit only costs a compile)
    return compiled
  with _CACHE_OFF:  # (Translator compiles decoders in threads: one switches it at a time)
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # (JAX decides at a compile whether to use it)
    try:
      return compile_fn()
    finally:
      jax.config.update("jax_enable_compilation_cache", enabled)
      compilation_cache.reset_cache()


def _load_or_make(parts: dict, suffix: str, what: str, make: Callable[[], Any],
                  dump: Callable[[Any], bytes], load: Callable[[bytes], Any],
                  model_dir: Path | None = None) -> tuple[Any, bool]:
  """(value, whether it was loaded): `load` of the payload stored under
  `key(parts)` + `suffix` in `model_dir` (a workdir's: `model_directory`) or
  else in the cache, if there is one that this machine sealed
  (`signing.unseal`) and that loads, else `make()`, then stored as
  `dump(value)`, sealed, in both. `what` names the value in warnings.
  Nothing is read or stored when the compilation cache is off."""
  cache = directory()
  if cache is None:
    return make(), False
  name = f"{key(parts)}{suffix}"
  places = [where for where in (model_dir, cache) if where is not None]
  for where in places:
    path = where / name
    stored = _read_regular_file(path, MAX_MODEL_BYTES if where == model_dir else MAX_BYTES)
    if stored is None:
      continue
    try:
      payload = signing.unseal(name, stored)
    except signing.NotSealedHere as e:  # (never deserialized: compiled afresh, sealed)
      _say_refused(where, path, e, model=where == model_dir)
      continue
    try:
      value = load(payload)
    except Exception as e:  # (sealed here, yet it does not load: make it again)
      logger.warning("%s %s did not load (%s: %s); making it again.", what, path,
                     type(e).__name__, e)
      with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
      continue
    with contextlib.suppress(OSError):  # (a read-only cache: used as it is)
      os.utime(path)  # last used now: the pruning keeps what is used
    if model_dir is not None and where != model_dir:  # (so that the model carries it)
      _store(model_dir, name, stored, what, MAX_MODEL_BYTES, quiet=True)
    return value, True
  value = make()
  try:
    stored = signing.seal(name, dump(value))
  except Exception as e:  # (a value that does not serialize: used, not kept)
    logger.info("The %s is not kept (%s: %s).", what, type(e).__name__, e)
    stored = None
  if stored is not None:
    _store(cache, name, stored, what, MAX_BYTES)
    if model_dir is not None:
      _store(model_dir, name, stored, what, MAX_MODEL_BYTES, quiet=True)
  return value, False


def _store(where: Path, name: str, stored: bytes, what: str, max_bytes: int,
           quiet: bool = False) -> None:
  """Writes `stored` whole as `where/name`, then keeps `where` under
  `max_bytes` (least recently used first). A read-only or full disk is said
  (`quiet`: at INFO, for a workdir, which may well be read-only) and skipped."""
  path = where / name
  try:
    where.mkdir(parents=True, exist_ok=True)
    write_atomically(str(path), stored)
    # Every change of this package's code, of jax or of the devices makes new
    # keys: without this the directory only grows (900 MB after two days of
    # development on one machine).
    compile_cache.prune_least_recently_used(where, max_bytes, names=FILE_NAMES, keep=path)
  except Exception as e:  # (a read-only or full disk: go on, uncached)
    (logger.info if quiet else logger.warning)(
        "Could not keep the %s in %s (%s: %s).", what, where, type(e).__name__, e)


def _read_regular_file(path: Path, max_bytes: int) -> bytes | None:
  """The bytes of `path` if the one reader takes it (`received.read_bytes`:
  inside its folder, a regular file, not a link out, a FIFO or a device that
  a received workdir could plant) and it holds at most `max_bytes`; None
  where there is none such."""
  try:
    return received.read_bytes(path, root=path.parent, kind="compiled", limit=max_bytes)
  except (OSError, ValueError):  # (missing, or refused: compiled afresh)
    return None


_refused_in: set[Path] = set()  # the directories whose refusal was said


def _say_refused(where: Path, path: Path, why: Exception, *, model: bool) -> None:
  """One line per directory and process: files there that this machine
  cannot prove it wrote are not loaded."""
  if where in _refused_in:
    return
  _refused_in.add(where)
  if model:  # (what it costs, and how to keep one key: never "trust this workdir")
    logger.warning(
        "%s: compiled decoders that this machine cannot prove it wrote (%s: %s) are not "
        "loaded; they are compiled afresh here, once, and translate the same. To start warm "
        "on every machine of yours, give them one key (copy ~/.cache/transformer/signing.key "
        "to the others with mode 0600, or point $%s at the same key file on each); for a "
        "copy of your own workdir from another machine, --trust_compiled=<that machine's "
        "signing.key> (docs/security.md).", where.parent, path.name, why, signing.ENV)
  else:
    logger.warning("%s: files this machine cannot prove it wrote (%s: %s) are not loaded; "
                   "compiling afresh.", where, path.name, why)


def trust(model_dir: Path | None, trusted: Sequence[bytes]) -> int:
  """Seals anew, with this machine's key, the files in `model_dir` (a
  workdir's `compiled/`) whose tags verify under one of `trusted`: the keys
  of the user's other machines (`signing.trusted_keys`), named by the
  explicit act by which a user adopts a copy of their own workdir
  (`decode.py --trust_compiled=KEY`, `load_translator(..., trust_compiled=KEY)`)
  so that it starts warm here. Anything else (another key, a planted pickle,
  however it starts) is left as it is and compiled afresh when asked for.
  Returns how many files were sealed anew; a workdir that cannot be written
  is said."""
  if model_dir is None or not model_dir.is_dir() or not trusted:
    return 0
  count = 0
  for path in sorted(model_dir.iterdir()):
    stored = _read_regular_file(path, MAX_MODEL_BYTES)
    if stored is None or path.name.startswith("."):
      continue
    with contextlib.suppress(signing.NotSealedHere):
      signing.unseal(path.name, stored)
      continue  # (sealed here already)
    resealed = signing.reseal(path.name, stored, trusted)
    if resealed is None:
      continue
    try:
      write_atomically(str(path), resealed)
    except OSError as e:
      logger.warning("Cannot trust the compiled decoders of %s: it cannot be written (%s); "
                     "give your machines one key instead (docs/security.md).",
                     model_dir.parent, e.strerror or e)
      return count
    count += 1
  if count:
    logger.info("Trusted %d compiled file(s) of %s: their seals verified under the key "
                "given, sealed with this machine's key.", count, model_dir.parent)
  return count


def load_or_compile(parts: dict, compile_fn: Callable[[], jax.stages.Compiled], *,
                    suffix: str = ".bin", what: str = "compiled decoder",
                    model_dir: Path | None = None):
  """(compiled program, whether it was loaded): the one stored under
  `key(parts)` + `suffix` (".bin": a decoder) if there is one that loads,
  else `compile_fn()`, then stored. `compile_fn` must trace, lower and
  compile anew at each call, from a function made anew (a `jax.jit` of the
  same function object compiles to the program JAX keeps in memory, which
  may be the persistent cache's copy that does not serialize whole:
  `_compile_fresh`). `model_dir`: a workdir's `compiled/` that keeps it too
  (`model_directory`)."""
  from jax.experimental import serialize_executable
  if directory() is None:  # (nothing serialized: JAX's cache may serve it as it is)
    return compile_fn(), False
  return _load_or_make(
      parts, suffix, what,
      make=lambda: _compile_fresh(compile_fn),
      # (pickle, as JAX's own serialization is: read only once `unseal` proved
      # that this machine wrote it)
      dump=lambda compiled: pickle.dumps(serialize_executable.serialize(compiled)),
      load=lambda payload: serialize_executable.deserialize_and_load(*pickle.loads(payload)),
      model_dir=model_dir)


def load_or_eval_shape(parts: dict, fn: Callable, *args, model_dir: Path | None = None):
  """`jax.eval_shape(fn, *args)` (a pytree of `jax.ShapeDtypeStruct`), read from
  the file stored under `key(parts)` when there is one that loads, else traced
  and stored. `parts` must name everything the shapes depend on besides this
  package's code (which `key` includes): e.g. the model config. `model_dir`:
  as `load_or_compile`'s."""
  shapes, _ = _load_or_make(parts, ".shapes", "parameter shapes",
                            make=lambda: jax.eval_shape(fn, *args),
                            dump=_shapes_to_json, load=_shapes_from_json,
                            model_dir=model_dir)
  return shapes


def _shapes_to_json(tree) -> bytes:
  """A pytree of dicts, lists and tuples whose leaves have a shape and a dtype
  (`jax.ShapeDtypeStruct`s: the parameters') as JSON, each node tagged with
  its kind: {"dict": {"w": {"leaf": ["float32", [512, 64]]}}}. TypeError for
  any other kind of node (then the value is not kept)."""
  def encode(node):
    if isinstance(node, dict):
      return {"dict": {str(k): encode(v) for k, v in node.items()}}
    if isinstance(node, (list, tuple)):
      return {type(node).__name__: [encode(v) for v in node]}
    if hasattr(node, "shape") and hasattr(node, "dtype"):
      return {"leaf": [str(node.dtype), [int(n) for n in node.shape]]}
    raise TypeError(f"not a tree of shapes: {type(node).__name__}")
  return json.dumps(encode(tree)).encode()


def _shapes_from_json(payload: bytes):
  """`_shapes_to_json`'s tree back, as `jax.ShapeDtypeStruct`s."""
  def decode(node):
    (kind, value), = node.items()
    if kind == "dict":
      return {k: decode(v) for k, v in value.items()}
    if kind in ("list", "tuple"):
      return (list if kind == "list" else tuple)(decode(v) for v in value)
    dtype, shape = value
    return jax.ShapeDtypeStruct(tuple(int(n) for n in shape), jax.numpy.dtype(dtype))
  return decode(json.loads(payload))
