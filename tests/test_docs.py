"""The manual stays true to the code: every flag the commands define is
documented, and every file, link and anchor the docs name exists.

Pure text: no JAX, no process started. The flags are read from the commands'
own `flags.DEFINE_*` calls (what `--help` lists, without absl's own flags)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_DEFINE = re.compile(r"DEFINE_\w+\(\s*\"(\w+)\"")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# A path a page names in backticks, under one of the checkout's folders (or a
# top-level script): `transformer/runtime/xla_flags.py`, `benchmarks/compare_jax.py`.
_PATH = re.compile(r"`((?:transformer|benchmarks|configs|tests|docs|notebooks|\.ci)/[\w./-]*\w"
                   r"|train\.py|decode\.py|pyproject\.toml)")


def defined_flags(script: str) -> list[str]:
  return _DEFINE.findall((REPO / script).read_text(encoding="utf-8"))


@pytest.mark.parametrize("script, page, at_least", [
    ("decode.py", "docs/decoding.md", 25), ("train.py", "docs/training.md", 6)])
def test_every_flag_a_command_defines_is_in_its_manual(script, page, at_least):
  flags = defined_flags(script)
  assert len(flags) >= at_least, flags  # (the pattern still finds the definitions)
  text = (REPO / page).read_text(encoding="utf-8")
  missing = [f"--{name}" for name in flags if not re.search(rf"--{name}(?![\w])", text)]
  assert not missing, f"{page} does not name {missing} ({script} defines them)"


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation but '-' and '_'
  dropped, spaces to '-'."""
  text = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
  found: set[str] = set()
  in_code = False
  for line in page.read_text(encoding="utf-8").splitlines():
    if line.startswith("```"):
      in_code = not in_code
    elif not in_code and line.startswith("#"):
      base = slug(line.lstrip("#"))
      name, n = base, 0
      while name in found:  # (GitHub numbers a repeated heading: name-1, name-2)
        n += 1
        name = f"{base}-{n}"
      found.add(name)
  return found


def _outside_code(text: str) -> str:
  return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_and_anchor_a_page_names_exists(page):
  broken = []
  for target in _LINK.findall(_outside_code(page.read_text(encoding="utf-8"))):
    if re.match(r"[a-z]+:", target):  # (https:, mailto:: not checked offline)
      continue
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
      broken.append(f"{target} (no such file)")
    elif anchor and file.suffix == ".md" and anchor not in anchors(file):
      broken.append(f"{target} (no heading #{anchor} in {file.name})")
  assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_file_a_page_names_exists(page):
  names = set(_PATH.findall(page.read_text(encoding="utf-8")))
  missing = sorted(name for name in names
                   if not any(c in name for c in "*<>{}") and not (REPO / name).exists())
  assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_the_checks_find_what_they_look_for(tmp_path):
  """The patterns above do find a broken link, a missing anchor, a missing
  file and an undocumented flag (each test above could fail)."""
  page = tmp_path / "page.md"
  page.write_text("# A title: with `code`\n\nsee [there](#a-title-with-code), "
                  "[gone](#nowhere), [missing](no_such.md) and `transformer/no_such.py`\n")
  assert anchors(page) == {"a-title-with-code"}
  targets = _LINK.findall(page.read_text())
  assert targets == ["#a-title-with-code", "#nowhere", "no_such.md"]
  assert _PATH.findall(page.read_text()) == ["transformer/no_such.py"]
  assert "trust_compiled" in defined_flags("decode.py")
