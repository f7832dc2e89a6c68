"""Whether this machine can hold a model, checked before anything of it is
allocated: its parameters' bytes (`model.param_size`, from the config alone)
against the machine's memory.

A workdir, an `init_from` or an imported model is a file from a stranger
(docs/security.md): a model_config.json (or a Marian model's options) whose
every field is in range may still ask for terabytes (d_model 65,536, d_ff
262,144, 512 + 512 layers: 224 TiB of float32). Without this check decoding it
traced every layer (~40 s, 2-core CPU), then orbax refused the checkpoint in
a message megabytes long; now it is one sentence within two seconds
(`ModelTooLarge`, a ValueError).

The rule: how many copies of the parameters a use holds at once, and where.

  decoding     1  the parameters (restored, or the serving copy)
  fine-tuning  4  the parameters, their gradients and Adam's two moments
  importing    2  the imported file's arrays and this project's copy (host)

On a CPU every copy is in the host's memory: once per device when each
device holds them whole (replicated; --xla_force_host_platform_device_count
makes several), divided when they are sharded (fsdp). On an accelerator the
copies live in its memory (`memory_stats()["bytes_limit"]`): whole on each
device, or each device its share; the host still reads the parameters once
(its share of them where they are sharded over several hosts). The host's
memory is its RAM, or its container's limit (cgroup) where that is lower.

These are floors: activations, the decoding cache and XLA's buffers come on
top, so a model that passes may still not fit; one that fails never can, and
is refused before anything of it is allocated.
"""

from __future__ import annotations

import dataclasses
import os

from transformer.model.config import TransformerConfig
from transformer.model.param_size import ParameterSize, parameter_size


@dataclasses.dataclass(frozen=True)
class Use:
  """What a use of a model holds: `copies` of the parameters, on the
  accelerator (`on_device`) or in the host's memory."""

  copies: int
  on_device: bool
  holds: str   # what the copies are, in words
  verb: str    # "decode": "needs ... to decode"


USES = {
    "decoding": Use(1, True, "its parameters, held once", "decode"),
    "fine-tuning": Use(4, True, "its parameters, their gradients and Adam's two moments",
                       "fine-tune"),
    "importing": Use(2, False, "the file's arrays and this project's copy of them", "import"),
}

_ADVICE = {
    "decoding": "decode it on a machine with more memory",
    "fine-tuning": "fine-tune it on a machine with more memory (or with "
                   "--config.state_sharding=fsdp over more accelerators)",
    "importing": "import it on a machine with more memory",
}

# A container's memory limit (cgroup v2, then v1): "max" or a huge number
# where there is none.
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclasses.dataclass(frozen=True)
class Memory:
  """The memory a model may use on this machine (None: unknown, not checked)."""

  host_bytes: int | None         # RAM, or the container's limit
  host_name: str                 # "this machine's memory", "this container's memory limit"
  accelerator: bool = False      # the parameters live on an accelerator, not the host
  device_bytes: int | None = None  # one accelerator's (bytes_limit)
  device_name: str = ""          # e.g. "one NVIDIA H200's memory"
  local_devices: int = 1         # the devices of this process (CPU devices share the host's)


class ModelTooLarge(ValueError):
  """A model whose parameters cannot fit this machine's memory (one sentence
  naming the file, the sizes and what to do)."""


def host_memory() -> tuple[int | None, str]:
  """(bytes, its name): the host's RAM (sysconf), or the container's limit
  where that is lower; None where neither can be read (the check then passes)."""
  try:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, ValueError, OSError):  # (not a POSIX system)
    ram = None
  limit = container_limit()
  if limit is not None and (ram is None or limit < ram):
    return limit, "this container's memory limit"
  return ram, "this machine's memory"


def container_limit() -> int | None:
  """The memory limit of this process's cgroup, None where there is none."""
  for path in CGROUP_LIMITS:
    try:
      with open(path, encoding="ascii") as f:
        text = f.read(64).strip()
    except (OSError, ValueError):
      continue
    return int(text) if text.isdigit() else None
  return None


def this_machine(devices: bool = True) -> Memory:
  """This machine's `Memory`: the host's, and with `devices` (which starts
  JAX's backend) the first local accelerator's, if there is one."""
  host, host_name = host_memory()
  if not devices:
    return Memory(host, host_name)
  import jax  # (only here: the rest of this module is pure arithmetic)
  local = jax.local_devices()
  if local[0].platform == "cpu":
    return Memory(host, host_name, local_devices=len(local))
  try:
    limit = (local[0].memory_stats() or {}).get("bytes_limit")
  except Exception:  # (a backend without memory statistics: the device is not checked)
    limit = None
  return Memory(host, host_name, accelerator=True, device_bytes=int(limit) if limit else None,
                device_name=f"one {local[0].device_kind}'s memory", local_devices=len(local))


def needs(param_bytes: int, use: Use, machine: Memory, sharded_over: int = 1
          ) -> list[tuple[int, int | None, str]]:
  """[(bytes needed, bytes there are, the memory's name)] of `use` (module
  docstring), the parameters whole on each device (`sharded_over` 1) or
  divided over `sharded_over` devices (fsdp)."""
  copies = param_bytes * use.copies
  if not use.on_device:
    return [(copies, machine.host_bytes, machine.host_name)]
  if not machine.accelerator:  # the CPU's devices: all on the host
    return [(-(-copies * machine.local_devices // sharded_over), machine.host_bytes,
             machine.host_name)]
  host_share = -(-param_bytes * min(machine.local_devices, sharded_over) // sharded_over)
  return [(host_share, machine.host_bytes, machine.host_name),
          (-(-copies // sharded_over), machine.device_bytes, machine.device_name)]


def check_fits(config: TransformerConfig, source: str, purpose: str, *,
               sharded_over: int = 1, size: ParameterSize | None = None,
               machine: Memory | None = None) -> ParameterSize:
  """The size of `config`'s parameters (`size`, else `parameter_size`: three
  shallow traces, under a second), once known to fit this machine
  (`machine`, else `this_machine`) for `purpose` (a key of USES);
  ModelTooLarge otherwise, one sentence naming `source` (the file the config
  came from). `sharded_over`: as `needs`'."""
  use = USES[purpose]
  size = size if size is not None else parameter_size(config)
  if machine is None:
    machine = this_machine(devices=use.on_device)
  for need, have, name in needs(size.bytes, use, machine, sharded_over):
    if have is not None and need > have:
      raise ModelTooLarge(
          f"{source}: this model needs {format_bytes(need)} to {use.verb} ({_times(use, size)}"
          f"{use.holds}; {size.count:,} {config.param_dtype} parameters: "
          f"{describe(config)}), more than the {format_bytes(have)} of {name}; "
          f"{_ADVICE[purpose]}, or check that {os.path.basename(str(source))} describes the "
          "model you meant.")
  return size


def describe(config: TransformerConfig) -> str:
  """The sizes that make a model large, in the paper's names."""
  return (f"d_model {config.d_model:,}, d_ff {config.d_ff:,}, "
          f"{config.num_encoder_layers} + {config.num_decoder_layers} layers, "
          f"vocab_size {config.vocab_size:,}")


def _times(use: Use, size: ParameterSize) -> str:
  return f"{use.copies} x {format_bytes(size.bytes)}: " if use.copies > 1 else ""


def format_bytes(count: int) -> str:
  """1536 -> "1.5 KiB": binary units, one decimal."""
  if count < 1024:
    return f"{count} B"
  value = count / 1024
  for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
    if value < 1024:
      return f"{value:.1f} {unit}"
    value /= 1024
  return f"{value:.1f} EiB"
