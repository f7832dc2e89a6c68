"""How one `load_translator` call walks a workdir (issue 52's measure): the
project's modules whose functions receive the workdir (its path, or the
`workdir.Workdir` value made of it), the calls to `workdir.resolve` with it,
the separate entries into runtime/workdir.py, and the climbs back up the
layers (a call into a higher layer than the one the path was in last), and
the stays (runs of calls in one module, in the order they happen).

    python benchmarks/workdir_walk.py --workdir=tests/fixtures/workdir_d26a6fb

Counted with `sys.setprofile` over one load (nothing timed); prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transformer  # noqa: E402
from transformer.decoding import loader  # noqa: E402

LAYERS = {"model": 0, "data": 0, "runtime": 1, "plotting": 1, "decoding": 2, "interop": 2,
          "training": 3}


def walk(workdir: str) -> dict:
  """The counts for one `loader.load_translator(workdir)`."""
  root = os.path.dirname(transformer.__file__)
  names = {workdir.rstrip("/"), os.path.abspath(workdir)}

  def module_of(code) -> str | None:
    if not code.co_filename.startswith(root):
      return None
    return os.path.relpath(code.co_filename, root)[:-3].replace(os.sep, ".")

  def carries_workdir(frame) -> bool:
    code = frame.f_code
    for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
      value = frame.f_locals.get(name)
      if type(value).__name__ == "Workdir":
        return True
      try:
        text = value if isinstance(value, str) else os.fspath(value)
      except TypeError:
        continue
      if isinstance(text, str) and text.rstrip("/") in names:
        return True
    return False

  seen = {"modules": set(), "resolves": 0, "workdir_entries": 0, "climbs": 0, "stays": 0}
  layers: list[int] = []
  route: list[str] = []  # the modules in the order the workdir stayed in them

  def profile(frame, event, arg):
    if event != "call" or (module := module_of(frame.f_code)) is None:
      return
    if not carries_workdir(frame):
      return
    caller = module_of(frame.f_back.f_code) if frame.f_back else None
    seen["modules"].add(module)
    seen["resolves"] += module == "runtime.workdir" and frame.f_code.co_name == "resolve"
    seen["workdir_entries"] += module == "runtime.workdir" and caller != "runtime.workdir"
    layer = LAYERS[module.split(".")[0]]
    if layers and layer > layers[-1]:
      seen["climbs"] += 1
    if not layers or layers[-1] != layer:
      layers.append(layer)
    if not route or route[-1] != module:
      route.append(module)

  sys.setprofile(profile)
  try:
    loader.load_translator(workdir)
  finally:
    sys.setprofile(None)
  return dict(seen, modules=sorted(seen["modules"]), stays=len(route), route=route)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  print(json.dumps(walk(parser.parse_args(argv).workdir)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
