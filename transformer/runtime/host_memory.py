"""Keep freed host memory in the process, so that a compiled step does not
fault its temporary buffers in afresh on every call (Linux with glibc).

XLA on CPU allocates one temporary buffer per call of a compiled computation
(about 1 GB for the base model's training step) and frees it when the call
ends. glibc serves an allocation that large with a fresh `mmap` and gives it
back with `munmap`, so every call touches new pages: about 230,000 page faults
and 0.5 s of system time per base-model step, 10-15% of the step.
`keep_freed_memory` has glibc serve every allocation from its heaps (no
`mmap`) and never trim them, so the next call reuses pages already mapped.
The price: the process keeps its peak memory until it exits.

`train.py` has every thread allocate from one heap (one arena), and calls it
first thing, before JAX's first computation: a thread's arena is chosen at
its first allocation, and XLA's worker threads start with the backend.
`decode.py` leaves each thread its own heap (`one_heap=False`): its threads
load the compiled decoders and decode batches side by side, and on one heap
they waited on its lock (a warm decode of 1,000 lines 3.4-3.7 s without the
settings, 4.0-4.4 s with one heap, 2-core CPU). A decode call is a whole
batch, so there the gain is per batch, not per step, and for blocks of up to
64 MB: a thread's own heap holds no larger one, and a block that does not fit
beside what the heap already holds comes from a second heap, which glibc
unmaps as soon as it is empty (arena.c's `heap_trim`, whatever the settings),
so it is mapped afresh every time. So a block of 32-64 MB stays only until
glibc cuts a small block from it once freed (as it may at any call: XLA's
worker threads take small blocks too), then is mapped afresh at every call
(`tests/test_host_memory.py`). Decoding 10,000 lines at batch 128 (the small-corpus
model) faults 0.54M pages instead of 1.38M and runs 1.05x faster.
Set TRANSFORMER_KEEP_FREED_MEMORY=0 in the environment to leave glibc's
defaults alone.

Larger blocks stay only in the main thread's heap (glibc's main heap grows
without that limit). So for large batches `decode.py` also has JAX run each
computation on the thread that calls it (`run_computations_on_calling_threads`:
no asynchronous dispatch on the CPU), and the main thread decodes one lane of
batches itself (`runner._decode_in_lanes`): beam 4 at batch 128, whose
temporaries are 100-400 MB a batch, faults 184k pages per later call of
1,000 gettext lines instead of 397k, and 20,000 lines decode 1.07x faster.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import pkgutil
import platform

# mallopt(3) parameters, from glibc's malloc.h.
_M_MXFAST = 1            # largest request served from the "fast bins" (0: none)
_M_TRIM_THRESHOLD = -1   # free memory at the heap's top kept before giving it back
_M_MMAP_MAX = -4         # how many allocations may be served by mmap (0: none)
_M_ARENA_MAX = -8        # how many heaps threads may spread over

_ONE_HEAP = ((_M_ARENA_MAX, 1),)  # (`keep_freed_memory(one_heap=True)`)
# (`one_heap=False`, decode.py) No fast bins: with no `mmap`, every free of a
# block of 64 KB or more makes glibc merge all its fast bins' small free
# blocks (`malloc_consolidate`), and loading a compiled decoder (XLA parsing
# its program: many small blocks, some large ones) did that often: 29% of
# the load's CPU time in malloc/free, 10% in the merging. Without them the
# 4 decoders of 1,000 lines at batch 32 loaded in 0.53-0.56 against
# 0.58-0.59 s (one thread, medians of 8). Not measured for train.py's one heap.
_NO_FAST_BINS = ((_M_MXFAST, 0),)
_SETTINGS = (
    (_M_MMAP_MAX, 0),
    # -1 turns trimming off (mallopt(3)): glibc reads the int as a size_t, so
    # no threshold is ever reached. 2**31 - 1 (2 GiB), the largest positive
    # int, was not enough: a step whose temporaries pass 2 GiB (shape S at
    # 32 x 128 tokens) had the top of the heap trimmed and re-faulted on every
    # call, 170,000 page faults per second and 38% of the CPU in the kernel.
    (_M_TRIM_THRESHOLD, -1),
)


def accelerator_plugins() -> list[str]:
  """The GPU/TPU backends JAX would load (found without starting JAX): its
  `jax_plugins` (CUDA, ROCm: entry points or the namespace package) and libtpu."""
  found = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
  try:
    import jax_plugins  # a namespace package: one module per installed plugin
    found += [module.name for module in pkgutil.iter_modules(jax_plugins.__path__)]
  except ImportError:
    pass
  if importlib.util.find_spec("libtpu") is not None:
    found.append("libtpu")
  return sorted(set(found))


def runs_on_cpu() -> bool:
  """Whether this process's JAX computations will run on the CPU backend:
  $JAX_PLATFORMS names cpu first, or names nothing and no GPU/TPU plugin is
  installed (JAX would take it)."""
  platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms:
    return platforms.split(",")[0] == "cpu"
  return not accelerator_plugins()


def _applies() -> bool:
  """Whether this module's settings apply: not asked off
  (TRANSFORMER_KEEP_FREED_MEMORY=0), JAX on the CPU, Linux with glibc."""
  return (os.environ.get("TRANSFORMER_KEEP_FREED_MEMORY", "1") != "0" and runs_on_cpu()
          and platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")


def keep_freed_memory(one_heap: bool = True) -> bool:
  """Applies the settings above through glibc's `mallopt`; with `one_heap`
  every thread allocates from one heap (train.py), without it each thread
  from its own as glibc chooses, with no fast bins (decode.py: module
  docstring, `_NO_FAST_BINS`). Returns
  whether they were applied: False off Linux/glibc, when
  TRANSFORMER_KEEP_FREED_MEMORY=0, and when JAX will run on a GPU or TPU
  (`runs_on_cpu`): there XLA's buffers live in device memory, and one arena
  would only make the host threads of the input pipeline and the runtime
  contend for one heap lock."""
  if not _applies():
    return False
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  settings = (_ONE_HEAP if one_heap else _NO_FAST_BINS) + _SETTINGS
  return all(libc.mallopt(option, value) == 1 for option, value in settings)


def run_computations_on_calling_threads() -> bool:
  """Has JAX run each computation on the CPU on the thread that calls it
  (`jax_cpu_enable_async_dispatch` off) instead of one of XLA's worker
  threads, so that its temporaries come from the calling thread's heap: the
  main thread's keeps blocks of any size (module docstring). To be called
  before JAX's first computation (the CPU backend reads it when it starts);
  the same conditions as `keep_freed_memory`, whose settings it needs.
  Returns whether it was applied. The price: a thread that calls a
  computation waits for it (no overlap of its own host work with it, no
  next batch queued meanwhile), which `decode.py`'s other lanes make up for
  only where batches are large (`decoding.command.CALLING_THREAD_MIN_ROWS`)."""
  if not _applies():
    return False
  import jax  # (here: the rest of this module is used before jax is imported)
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  return True
