"""Device mesh, shardings and multi-host start-up for data parallelism.

Data parallelism here is `jax.jit` over a one-axis `jax.sharding.Mesh` named
``"data"`` that spans every device of every process: the batch is sharded on
its leading axis (`data_sharding`), the train state is replicated
(`replicated`), and the gradients are all-reduced once per update. This is
what `pmap` used to do; `pmap` is not used anywhere.

For models whose parameters and Adam state do not fit on every device, the
state can instead be sharded over the same axis (`state_shardings(...,
"fsdp")`: FSDP / ZeRO-3): each device keeps 1/n of every large array, the
trainer gathers the parameters for the forward and backward passes and
reduce-scatters the gradients, each once per update.

Typical use (the trainer)::

    parallel.maybe_initialize_distributed()        # before any other JAX call
    mesh = parallel.make_mesh()
    state = parallel.replicate(state, mesh)
    step = jax.jit(train_step,
                   in_shardings=(parallel.replicated(mesh), parallel.data_sharding(mesh)),
                   out_shardings=(parallel.replicated(mesh), parallel.replicated(mesh)),
                   donate_argnums=0)
    for local_batch in loader:                     # this process's rows only
        state, metrics = step(state, parallel.shard_batch(local_batch, mesh))

(The trainer itself passes `mesh=` to `train_step`, which then computes the
gradients per device in `shard_map` and reduces them once per update, and lays
the state out with `state_shardings`: `training.init_train_state` /
`training.jit_train_step`.)

Multi-host: every process runs the same program, calls
`maybe_initialize_distributed` first, and feeds its own shard of the data
(`process_info()` tells the loader which one); `shard_batch` assembles the
process-local rows into one global `jax.Array`
(`jax.make_array_from_process_local_data`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

DATA_AXIS = "data"

# Environment variables read by `maybe_initialize_distributed` (explicit
# arguments win over them). JAX itself also reads JAX_COORDINATOR_ADDRESS and
# JAX_LOCAL_DEVICE_IDS; JAX_NUM_PROCESSES / JAX_PROCESS_ID are our convention.
ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

_initialized_by_us = False


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None or value.strip() == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(
        f"Environment variable {name}={value!r} is not an integer; set it to"
        " the number of processes / this process's id, or unset it."
    ) from None


def maybe_initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    num_cpu_devices: int | None = None,
    initialization_timeout: int = 300,
    auto_detect: bool = False,
) -> bool:
  """Calls `jax.distributed.initialize` when asked to; otherwise does nothing.

  Long because it resolves each setting from an argument or the environment
  and names whatever is missing, all before JAX creates a backend.

  Must run before any other JAX call that touches devices (jax.devices(),
  jnp arrays, jit, ...): JAX refuses to initialise the distributed runtime
  once a backend exists.

  Each of the three settings comes from its argument or, when that is None,
  from the environment:

    coordinator_address  <- JAX_COORDINATOR_ADDRESS  ("host:port" of process 0)
    num_processes        <- JAX_NUM_PROCESSES
    process_id           <- JAX_PROCESS_ID            (0 .. num_processes-1)

  If none of them is set (and `auto_detect` is False) this is a no-op: a single
  process on its local devices. If `num_processes` is 1 it is also a no-op. If
  only some are set, a ValueError names the missing ones. With
  `auto_detect=True`, whatever is not set is left to JAX's cluster detection
  (Cloud TPU, Slurm, Open MPI): `jax.distributed.initialize()` is called even
  with nothing set.

  On CPU the cross-process collectives are gloo
  (`jax_cpu_collectives_implementation="gloo"`, JAX 0.10's default; set here
  explicitly unless the user chose another one, e.g. "mpi").

  Args:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: total number of processes.
    process_id: this process's index.
    num_cpu_devices: if given, the number of CPU devices this process exposes
      (`jax_num_cpu_devices`; the modern form of
      XLA_FLAGS=--xla_force_host_platform_device_count). Applied also in the
      single-process case.
    initialization_timeout: seconds to wait for all processes to connect.
    auto_detect: leave unset settings to JAX's cluster auto-detection.

  Returns:
    True if the distributed runtime is initialised (now or before), else False.
  """
  global _initialized_by_us
  if num_cpu_devices is not None:
    _set_num_cpu_devices(num_cpu_devices)
  if jax.distributed.is_initialized():
    return True

  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR_ADDRESS) or None
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)

  given = {
      f"coordinator_address (or ${ENV_COORDINATOR_ADDRESS})": coordinator_address,
      f"num_processes (or ${ENV_NUM_PROCESSES})": num_processes,
      f"process_id (or ${ENV_PROCESS_ID})": process_id,
  }
  if all(v is None for v in given.values()):
    if not auto_detect:
      return False
    _use_gloo_on_cpu()
    _call_initialize(initialization_timeout=initialization_timeout)
    _initialized_by_us = True
    return True
  if num_processes == 1 and process_id in (None, 0):
    logger.info("num_processes=1: not starting the JAX distributed runtime.")
    return False
  missing = [name for name, v in given.items() if v is None]
  if missing and not auto_detect:
    raise ValueError(
        "Multi-process JAX needs a coordinator address, the number of processes"
        " and this process's id; missing: " + ", ".join(missing) + "."
    )
  _use_gloo_on_cpu()
  _call_initialize(  # with auto_detect, JAX's cluster detection fills in the rest
      coordinator_address=coordinator_address,
      num_processes=None if num_processes is None else int(num_processes),
      process_id=None if process_id is None else int(process_id),
      initialization_timeout=initialization_timeout,
  )
  _initialized_by_us = True
  logger.info(
      "JAX distributed: process %s of %s, coordinator %s",
      process_id, num_processes, coordinator_address,
  )
  return True


def _set_num_cpu_devices(n: int) -> None:
  if jax.config.jax_num_cpu_devices == n:
    return
  try:
    jax.config.update("jax_num_cpu_devices", int(n))
  except RuntimeError as e:  # the CPU backend already exists
    raise RuntimeError(
        f"Cannot set num_cpu_devices={n}: the JAX backend is already"
        " initialised. Call maybe_initialize_distributed() before any other"
        " JAX call."
    ) from e


def _use_gloo_on_cpu() -> None:
  if jax.config.jax_cpu_collectives_implementation is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _call_initialize(**kwargs: Any) -> None:
  try:
    jax.distributed.initialize(**kwargs)
  except RuntimeError as e:
    if "before any JAX" in str(e) or "must be called before" in str(e):
      raise RuntimeError(
          "maybe_initialize_distributed() must run before any JAX call that"
          " touches devices (jax.devices(), creating arrays, jit); move it to"
          " the very start of the program."
      ) from e
    raise


def shutdown_distributed() -> None:
  """Shuts the distributed runtime down if this module started it."""
  global _initialized_by_us
  if _initialized_by_us and jax.distributed.is_initialized():
    jax.distributed.shutdown()
  _initialized_by_us = False


def process_info() -> tuple[int, int]:
  """(process_index, process_count), for the data loader's sharding."""
  return jax.process_index(), jax.process_count()


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A one-axis mesh named "data" over `devices` (default: every device of
  every process).

  The axis type is Auto (jit propagates shardings), not JAX 0.10's
  `jax.make_mesh` default Explicit, so model code needs no sharding annotations.
  """
  if devices is None:
    devices = jax.devices()
  devices = list(devices)
  if not devices:
    raise ValueError("make_mesh: no devices given.")
  return jax.make_mesh(
      (len(devices),), (DATA_AXIS,),
      axis_types=(jax.sharding.AxisType.Auto,),
      devices=devices,
  )


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole array (for params, optimizer state, RNG)."""
  return NamedSharding(mesh, PartitionSpec())


def data_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over the "data" axis, other axes whole."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


STATE_SHARDINGS = ("replicated", "fsdp")


def fsdp_spec(shape: Sequence[int], num_shards: int) -> PartitionSpec:
  """FSDP layout of one array of `shape` over `num_shards` devices: its largest
  axis that `num_shards` divides is split over "data" (the first such axis on
  a tie); arrays with no such axis (scalars, small or odd sizes: a small
  fraction of the bytes) stay whole on every device."""
  axes = [axis for axis, size in enumerate(shape) if size >= num_shards and size % num_shards == 0]
  if num_shards == 1 or not axes:
    return PartitionSpec()
  axis = max(axes, key=lambda a: (shape[a], -a))
  return PartitionSpec(*[DATA_AXIS if a == axis else None for a in range(len(shape))])


def state_shardings(tree: Any, mesh: Mesh, mode: str = "replicated") -> Any:
  """A NamedSharding for each leaf of `tree` (arrays or `jax.eval_shape`
  output): every leaf `replicated`, or with mode "fsdp" split by `fsdp_spec`.

  Raises:
    ValueError: naming `state_sharding` if `mode` is not one of STATE_SHARDINGS.
  """
  if mode not in STATE_SHARDINGS:
    raise ValueError(f"state_sharding={mode!r} must be one of {STATE_SHARDINGS}.")
  num_shards = mesh.shape[DATA_AXIS]

  def leaf(x):
    if mode == "replicated" or not getattr(x, "shape", ()):
      return replicated(mesh)
    return NamedSharding(mesh, fsdp_spec(x.shape, num_shards))

  return jax.tree.map(leaf, tree)


def bytes_per_device(tree: Any) -> int:
  """Bytes of `tree`'s arrays held by one device (the first of this process),
  read from the arrays' addressable shards."""
  device = jax.local_devices()[0]
  total = 0
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
  return total


def _key_name(path) -> str:
  return jax.tree_util.keystr(path) if path else "<batch>"


def shard_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each process's local rows into global batch-sharded arrays.

  Every process passes its own local shard (same keys, same shapes in every
  process); the global batch has `local_rows * num_processes` rows, split
  evenly over the devices of the mesh (each device gets
  `local_rows / local_device_count` rows, in order). Works for any pytree of
  numpy arrays (a dict of them is the usual case).

  Raises:
    ValueError: naming the key, if an entry is a scalar or its local number of
      rows is not divisible by this process's number of devices in the mesh.
  """
  sharding = data_sharding(mesh)
  n_local = len(mesh.local_devices)

  def put(path, x):
    x = np.asarray(x)
    name = _key_name(path)
    if x.ndim == 0:
      raise ValueError(f"shard_batch: entry {name} is a scalar; every entry needs a batch axis.")
    if x.shape[0] % n_local:
      raise ValueError(
          f"shard_batch: entry {name} has {x.shape[0]} rows in this process,"
          f" not divisible by the {n_local} local devices of the mesh; make the"
          f" per-process batch size a multiple of {n_local}."
      )
    return jax.make_array_from_process_local_data(sharding, x)

  return jax.tree_util.tree_map_with_path(put, batch)


def replicate(tree: Any, mesh: Mesh) -> Any:
  """Places a pytree replicated on every device of the mesh.

  In a multi-process run every process must pass the same values (e.g. the
  same init RNG seed); the result is one global array per leaf.
  """
  return jax.device_put(tree, replicated(mesh))


def to_host(tree: Any) -> Any:
  """Fetches a pytree of (replicated or sharded) jax.Arrays as numpy arrays,
  in every process (sharded global arrays are all-gathered across processes)."""
  from jax.experimental import multihost_utils  # local import: rarely needed

  def get(x):
    if not isinstance(x, jax.Array) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return x  # typed PRNG keys stay as they are
    if x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(get, tree)
