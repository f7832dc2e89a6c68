"""How much of the work a decoding batch does is for a sentence, and what the
batching costs: rows that decode nothing, steps run past a translation's end,
source padding. On real text, for a trained model.

    python benchmarks/bench_batching.py --workdir=<model> \
        --input=../shared/corpora/gettext-en-fr/test.tsv --lines=1000

1. **Accounting.** The model translates the lines once (greedy); from each
   translation's length, and the batches and early-exit checks each
   batching makes, it counts the decoder row-steps run (rows x steps,
   shrinking included) and the source tokens the encoder reads, against
   the tokens generated and the source tokens: the share that is work for
   a sentence (the source read padded, and packed: `source_packing`, what a
   CPU with one device does now). Exact arithmetic of
   `loops._shrinking_loop`'s rule, no timing.
   Then the same share under continuous batching: with one endless queue
   (the ceiling) and as it was built and measured (`pool_row_steps`: queues
   of one length bucket whose pools drain at their end).
2. **Timing.** `Translator.translate` of the same lines (every shape
   compiled first, then `--repeats` alternating rounds, medians) as it is:
   `batching.length_batches` (consecutive lengths), early-exit checks
   every 2 steps (`options.EARLY_EXIT_CHUNK`), the longest batches decoded
   first (`batch_plan.LONGEST_FIRST`); the same with checks every 4 steps;
   and as before 2026-11-26 (`per_bucket_batches`: one length bucket per
   batch, checks every 8 steps, shortest first). `--shrink_factors=4,2`
   adds the batches shrinking by other factors than `batch_plan.SHRINK_FACTOR`
   (smaller steps, fewer wasted row-steps, one more compiled step size per
   halving: the table gives each variant's compile seconds and compiled
   instructions, what a warm `decode.py` pays again to load them), both
   to the accounting and to the timing.

3. **Counting** (`--count_steps`): the input-steps the decoders really run
   (every step of every batch, shrinking included: each step reports its
   batch's inputs to the host), for each method and shrink factor, against
   the tokens of the translations kept: what part 1 computes for greedy,
   measured, and for beam search, whose inputs end by its stopping rule
   rather than at their EOS.

Timing alternates the variants in one process, each with its own decoders
compiled first: process-to-process swings on a 2-core machine (5-15% in
a run of the same code) are larger than the effects measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_vs_ctranslate2 import add_model_and_input_arguments, read_input
import jax

from transformer.decoding import batch_plan, batching as batching_lib, loader, loops, search
from transformer.decoding import beam_search as beam_lib
from transformer.decoding import options as decoding_options, source_packing
from transformer.decoding import translator as translator_lib
from transformer.decoding.options import BEAM_STOPS

BATCHINGS = ("consecutive", "per bucket")


def per_bucket_batches(encoded, max_length, inputs_per_batch, shared=None, least_padding=True):
  """The batching before 2026-11-26 (for comparison): inputs grouped by
  length bucket, each bucket cut into batches, so each bucket's last batch
  has empty rows. Same signature as `batching.length_batches` (whose
  `least_padding` it has no use for)."""
  todo = sorted((i for i, ids in enumerate(encoded) if ids), key=lambda i: len(encoded[i]))
  buckets: dict[int, list[int]] = {}
  for i in todo:
    length = batching_lib.bucket_length(len(encoded[i]), max_length)
    buckets.setdefault((shared or {}).get(length, length), []).append(i)
  batches = []
  for src_len, members in sorted(buckets.items()):
    per_batch = inputs_per_batch(src_len)
    batches += [(src_len, members[b:b + per_batch]) for b in range(0, len(members), per_batch)]
  return batches


def make_batches(batching: str, encoded, max_length: int, batch: int, shared=None):
  """The batches of `batch` inputs that `batching` makes; `shared`: the
  buckets sent to longer ones (`greedy_shared`)."""
  form = batching_lib.length_batches if batching == "consecutive" else per_bucket_batches
  return form(encoded, max_length, lambda src_len: batch, shared)


def greedy_shared(translator, encoded) -> dict[int, int]:
  """The buckets `translator` shares when it decodes `encoded` greedily
  (`batching.shared_buckets`; {} with `share_buckets` off): greedy batches
  depend on them (`batching.length_batches` cuts where they pad the least)."""
  if not translator.policy.share_buckets:
    return {}
  return batching_lib.shared_buckets(encoded, translator.config.max_len, rows_per_input=1)


def row_steps(steps_needed: list[int], batch: int, chunk: int, sizes: list[int]) -> int:
  """Rows x steps a batch runs under `loops._shrinking_loop`: checks every
  `chunk` steps; it goes on in the next of `sizes` once that many rows hold
  its unfinished inputs. `steps_needed`: per input, its tokens with the EOS
  (the rows past the inputs need none)."""
  needed = steps_needed + [0] * (batch - len(steps_needed))
  done_steps, total = 0, 0
  for size, next_size in zip(sizes, sizes[1:] + [0]):
    while sum(n > done_steps for n in needed) > next_size:
      done_steps += chunk
      total += size * chunk
  return total


def batches_row_steps(generated: list[int], batches, batch: int, chunk: int,
                      sizes: list[int]) -> int:
  """`row_steps` summed over `batches` [(src_len, member indices)] of `batch`
  rows, `generated[i]` the steps input i needs."""
  return sum(row_steps([generated[i] for i in members], batch, chunk, sizes)
             for _, members in batches)


def continuous_row_steps(steps_needed: list[int], chunk: int) -> int:
  """Rows x steps if every row were refilled with the next sentence at the
  first check after its sentence ends (continuous batching, not built: the
  ceiling it could reach), the last pool's idle rows left out."""
  return sum(-(-n // chunk) * chunk for n in steps_needed)


def pool_row_steps(steps_needed: list[int], pool: int, chunk: int, sizes: list[int]) -> int:
  """Rows x steps of continuous batching as it was built and measured on
  2026-11-26 (not kept, docs/benchmarks.md "Continuous batching"): `pool`
  rows decode the queue `steps_needed` in order, a row taking the next input
  at the first check after its own ends, every `chunk` steps; once the queue
  is empty the pool drains as a shrinking batch does (`sizes`, from `pool`)."""
  queue, rows, total = list(steps_needed), [], 0

  def run_chunk(size):
    nonlocal total
    total += size * chunk
    rows[:] = [n - chunk for n in rows]

  def refill():
    rows[:] = [n for n in rows if n > 0]
    while queue and len(rows) < pool:
      rows.append(queue.pop(0))

  refill()
  while queue:
    run_chunk(pool)
    refill()
  for size, next_size in zip(sizes, sizes[1:] + [0]):
    while sum(n > 0 for n in rows) > next_size:
      run_chunk(size)
  return total


def packed_read(members: list[list[int]], rows: int, length: int) -> int:
  """Source tokens the encoder reads for one batch with packed sources
  (`source_packing`): the packed rows in use, rounded up to whole chunks."""
  packed = source_packing.pack(members, rows, length)
  in_use = int((packed.segments > 0).any(axis=1).sum())
  chunk = min(source_packing.CHUNK, rows)
  return -(-in_use // chunk) * chunk * length


def shrink_sizes(translator, batch: int, factor: int, shrink: bool | None = None) -> list[int]:
  """The batch sizes a decoding batch of `batch` rows goes through when it
  shrinks by `factor` (`batch_plan.shrinking`'s ladder with that factor), if
  it shrinks (`shrink`; None: as the translator's policy says)."""
  shrink = translator.policy.shrink_batches if shrink is None else shrink
  shape = batch_plan.DecoderShape("greedy", batch, 8, 24, 1, 0, shrink=shrink,
                                  shrink_factor=factor)
  steps = batch_plan.shrinking(shape, translator.policy.devices)
  return loops.Shrink(None, *steps).sizes(batch) if steps is not None else [batch]


def accounting(translator, encoded, generated, batch_sizes, chunks):
  """Rows of the accounting table (part 1)."""
  max_length, rows = translator.config.max_len, []
  source = sum(map(len, encoded))
  for batch in batch_sizes:
    sizes = shrink_sizes(translator, batch, batch_plan.SHRINK_FACTOR)
    for batching in BATCHINGS:
      batches = make_batches(batching, encoded, max_length, batch,
                             greedy_shared(translator, encoded))
      read = sum(batch * src_len for src_len, _ in batches)
      packed = sum(packed_read([encoded[i] for i in members], batch, src_len)
                   for src_len, members in batches)
      filled = sum(len(members) for _, members in batches) / (len(batches) * batch)
      for chunk in chunks:
        run = batches_row_steps(generated, batches, batch, chunk, sizes)
        rows.append((batch, batching, chunk, len(batches), filled, sum(generated) / run,
                     source / read, source / packed))
  return rows


# (batching, early-exit check every, decoded longest batches first, shrink
# factor): the settings of `batching.length_batches`, `options.EARLY_EXIT_CHUNK`,
# `batch_plan.LONGEST_FIRST` and `batch_plan.SHRINK_FACTOR` each timed variant
# runs with. The first: now.
NOW = batch_plan.SHRINK_FACTOR
VARIANTS = {("consecutive", 2, True, NOW): (batching_lib.length_batches, 2, True, NOW),
            ("consecutive", 4, True, NOW): (batching_lib.length_batches, 4, True, NOW),
            ("per bucket", 8, False, NOW): (per_bucket_batches, 8, False, NOW)}
BASELINE = ("per bucket", 8, False, NOW)  # before 2026-11-26


def variants(shrink_factors: list[int]) -> dict:
  """VARIANTS and, for each other shrink factor, today's batching with it."""
  more = {("consecutive", 2, True, f): (batching_lib.length_batches, 2, True, f)
          for f in shrink_factors if f != NOW}
  return {**VARIANTS, **more}


def _set(form, chunk, longest_first, shrink_factor) -> None:
  """The module settings a variant runs with; `shrink_factor` for every
  decoder (the Translator's halves for beam decoders of many rows set aside)."""
  batching_lib.length_batches = form
  decoding_options.EARLY_EXIT_CHUNK = chunk  # (read when tracing and planning)
  batch_plan.LONGEST_FIRST, batch_plan.SHRINK_FACTOR = longest_first, shrink_factor
  batch_plan.FINE_SHRINK_FACTOR = shrink_factor


def compiled_instructions(translator) -> int:
  """HLO instructions in the decoders a Translator compiled (what loading
  them again costs: docs/benchmarks.md, "Side by side")."""
  return sum(sum(" = " in line for line in executable.as_text().splitlines())
             for executable in translator.decoders.executables.values())


def _fresh_translator(translator):
  """A Translator of the same model with no decoders yet: they compile
  under the module settings of the moment."""
  return translator_lib.Translator(translator.config, translator.params, translator.tokenizer)


def _decode_options(method: str, batch: int, beam_stop: str) -> dict:
  return dict(method=method, batch_size=batch,
              **({"beam_stop": beam_stop} if method == "beam" else {}))


def _label(method: str, beam_stop: str) -> str:
  return method + (f" ({beam_stop})" if method == "beam" else "")


def timing(translator, lines, method, batch, repeats, beam_stop="exact",
           shrink_factors=(NOW,)):
  """{variant: (median seconds, translations, compile seconds, compiled
  instructions)} (part 2)."""
  defaults = (batching_lib.length_batches, decoding_options.EARLY_EXIT_CHUNK,
              batch_plan.LONGEST_FIRST, batch_plan.SHRINK_FACTOR)
  fine_default = batch_plan.FINE_SHRINK_FACTOR
  options = _decode_options(method, batch, beam_stop)
  timed = variants(list(shrink_factors))
  translators, seconds, outputs, compiling = {}, {}, {}, {}
  try:
    for variant, settings in timed.items():
      _set(*settings)
      fresh = _fresh_translator(translator)
      fresh.translate(lines, **options)  # compiles every shape
      compiling[variant] = (fresh.last_stats["compile_seconds"], compiled_instructions(fresh))
      translators[variant], seconds[variant] = fresh, []
    for _ in range(repeats):
      for variant, fresh in translators.items():
        _set(*timed[variant])
        start = time.perf_counter()
        outputs[variant] = fresh.translate(lines, **options)
        seconds[variant].append(time.perf_counter() - start)
  finally:
    _set(*defaults)
    batch_plan.FINE_SHRINK_FACTOR = fine_default
  return {key: (statistics.median(s), outputs[key], *compiling[key])
          for key, s in seconds.items()}


def counted_input_steps(translator, lines, method, batch, beam_stop="exact",
                        shrink_factor=NOW) -> tuple[int, int]:
  """(input-steps run, tokens of the translations kept) of translating
  `lines`: decoders compiled afresh with a step that tells the host how
  many inputs its batch holds (a `jax.debug.callback`, so the counting
  slows them down: not for timing). Beam search's steps are per input (each
  runs its beams' rows)."""
  counts = []  # (appended to, not added up: lanes' callbacks run in threads side by side)

  def count(inputs):
    counts.append(int(inputs))

  def counting_loop(step_fn, *args, **kwargs):
    def counted(state):  # state.last_tokens: [inputs] (greedy) or [inputs, beams]
      jax.debug.callback(count, state.last_tokens.shape[0])
      return step_fn(state)
    return original_loop(counted, *args, **kwargs)

  original_loop = search._shrinking_loop  # (greedy's and sampling's; beam search's its own)
  factors = batch_plan.SHRINK_FACTOR, batch_plan.FINE_SHRINK_FACTOR
  search._shrinking_loop = beam_lib._shrinking_loop = counting_loop
  batch_plan.SHRINK_FACTOR = batch_plan.FINE_SHRINK_FACTOR = shrink_factor
  try:
    hypotheses = _fresh_translator(translator).translate_hypotheses(
        lines, **_decode_options(method, batch, beam_stop))
  finally:
    search._shrinking_loop = beam_lib._shrinking_loop = original_loop
    batch_plan.SHRINK_FACTOR, batch_plan.FINE_SHRINK_FACTOR = factors
  return sum(counts), sum(h[0].length for h in hypotheses if h)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_model_and_input_arguments(parser)
  parser.add_argument("--repeats", type=int, default=3, help="timed rounds (0: accounting only)")
  parser.add_argument("--shrink_factors", default=str(NOW),
                      help="comma-separated: the shrink factors to account for and time "
                           f"(batch_plan.SHRINK_FACTOR, now {NOW}, always)")
  parser.add_argument("--count_steps", action="store_true",
                      help="also count the input-steps the decoders run (part 3)")
  parser.add_argument("--beam_stop", default="exact", choices=BEAM_STOPS,
                      help="beam search's early-exit bound (decode.py --beam_stop)")
  args = parser.parse_args(argv)
  shrink_factors = sorted({NOW, *(int(f) for f in args.shrink_factors.split(","))},
                          key=lambda f: f != NOW)
  lines, _ = read_input(Path(args.input), args.lines)
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  translator = loader.load_translator(args.workdir)
  encoded, _ = translator.encode(lines)
  greedy = translator.translate_hypotheses(lines, method="greedy")
  generated = [h[0].length for h in greedy]

  print(f"{len(lines)} lines: {sum(map(len, encoded))} source tokens (EOS included), "
        f"{sum(generated)} generated by greedy search (EOS included)\n")
  print("| batch | batches | early-exit check every | batches made | rows holding a sentence "
        "| decoder row-steps that generate a token | source tokens read that are not padding "
        "| the same, sources packed |")
  print("|---|---|---|---|---|---|---|---|")
  now = {}  # (batch, batching, check every) -> decoder row-steps that generate a token
  for batch, batching, chunk, count, filled, steps, read, packed in accounting(
      translator, encoded, generated, batch_sizes, (8, 4, 2)):
    now[batch, batching, chunk] = steps
    print(f"| {batch} | {batching} | {chunk} steps | {count} | {filled:.1%} | {steps:.1%} "
          f"| {read:.1%} | {packed:.1%} |", flush=True)
  for chunk in (4, 2):
    ceiling = sum(generated) / continuous_row_steps(generated, chunk)
    print(f"\nContinuous batching, refilling freed rows at checks every {chunk} "
          f"steps: at most {ceiling:.1%} of the decoder row-steps generate a token "
          "(one endless queue, no pool ever draining).")
  print("\nContinuous batching as built and measured (not kept): a pool of `batch` rows per "
        "queue of one length bucket's sentences, checks every 2 steps, draining as a "
        "shrinking batch")
  print("| batch | queue | row-steps that generate a token | now |")
  print("|---|---|---|---|")
  for batch in batch_sizes:
    sizes = shrink_sizes(translator, batch, NOW, shrink=True)  # (a pool drains as a batch shrinks)
    for queue, label in ((4 * batch, f"{4 * batch} sentences"), (len(lines), "a whole bucket")):
      queues = per_bucket_batches(encoded, translator.config.max_len, lambda _: queue)
      run = sum(pool_row_steps([generated[i] for i in members], batch, 2, sizes)
                for _, members in queues)
      print(f"| {batch} | {label} | {sum(generated) / run:.1%} "
            f"| {now[batch, 'consecutive', 2]:.1%} |", flush=True)
  if len(shrink_factors) > 1:
    print("\nShrinking by other factors (consecutive batches, checks every 2 steps)")
    print("| batch | shrink by | step sizes compiled | decoder row-steps that generate a token |")
    print("|---|---|---|---|")
    for batch in batch_sizes:
      batches = make_batches("consecutive", encoded, translator.config.max_len, batch,
                             greedy_shared(translator, encoded))
      for factor in shrink_factors:
        sizes = shrink_sizes(translator, batch, factor)
        run = batches_row_steps(generated, batches, batch, 2, sizes)
        print(f"| {batch} | {factor} | {', '.join(map(str, sizes))} "
              f"| {sum(generated) / run:.1%} |", flush=True)
  if args.count_steps:
    print("\nCounted: input-steps the decoders run / tokens of the translations kept "
          "(EOS included; beam: per input, its beams' rows each)")
    print("| method | batch | shrink by | input-steps | tokens | input-steps per token |")
    print("|---|---|---|---|---|---|")
    for method in args.methods.split(","):
      label = _label(method, args.beam_stop)
      for batch in batch_sizes:
        for factor in shrink_factors:
          steps, tokens = counted_input_steps(translator, lines, method, batch,
                                              args.beam_stop, factor)
          print(f"| {label} | {batch} | {factor} | {steps} | {tokens} | {steps / tokens:.2f} |",
                flush=True)
  if not args.repeats:
    return 0
  print(f"\n| method | batch | batching, check every, order, shrink by | seconds (median of "
        f"{args.repeats}) | sentences/s | vs per bucket, 8, shortest first "
        "| translations the same | compiling (s) | compiled instructions |")
  print("|---|---|---|---|---|---|---|---|---|")
  for method in args.methods.split(","):
    for batch in batch_sizes:
      results = timing(translator, lines, method, batch, args.repeats, args.beam_stop,
                       shrink_factors)
      base_seconds, base_out, _, _ = results[BASELINE]
      for (batching, chunk, longest, factor), (s, out, compiling, instructions) in sorted(
          results.items(), key=lambda kv: -kv[1][0]):
        same = sum(a == b for a, b in zip(out, base_out))
        order = "longest first" if longest else "shortest first"
        print(f"| {_label(method, args.beam_stop)} | {batch} | {batching}, {chunk}, {order}, {factor} | {s:.2f} "
              f"| {len(lines) / s:.1f} | {base_seconds / s:.2f}x | {same} of {len(lines)} "
              f"| {compiling:.1f} | {instructions} |", flush=True)
  return 0


if __name__ == "__main__":
  from transformer.runtime import host_memory
  host_memory.keep_freed_memory(one_heap=False)  # as decode.py has it
  sys.exit(main())
