"""The batch plan: which sentences are decoded together, by which decoder.

Pure Python (no JAX): given the token ids of the inputs, the options of one
`Translator.translate_hypotheses` call and the platform's `Policy`, `plan`
says which inputs share a batch, each batch's decoder (a `DecoderShape`: its
rows, padded source length, steps and everything else compiled into it),
how many tokens each input may generate, and in which order the batches go.
`decoders.py` builds and compiles a decoder per shape; `runner.py` runs the
plan. The length buckets themselves are `batching.py`'s.

Every policy that depends on the platform lives in `Policy`, each with its
measured gain beside it (2-core CPUs, the small-corpus model, gettext lines;
docs/benchmarks.md has the tables). On a GPU or TPU
padding is cheap and each extra program is seconds of compiling, so they
are off there: whole batches, one decoder per bucket.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

from transformer.decoding import batching
from transformer.decoding import options
from transformer.decoding.options import rows_per_input

# A batch goes on with a quarter of its rows once they hold all its unfinished
# inputs, down to 8 rows: CPU 1.6-3x greedy and 1.2-2x beam throughput
# (halving to 4 rows saved a little more for twice the compiling). Rows, not
# inputs: a beam search of 4 goes down to 2 inputs (it stopped at 8 inputs, 32
# rows, before; whole warm commands 1.03-1.05x, 15% less memory, the same lines).
SHRINK_FACTOR, SHRINK_MIN_ROWS = 4, 8
# ... by halves instead (128 -> 64 -> 32 -> 16 -> 8) for a beam search decoder
# with at least FINE_SHRINK_MIN_ROWS rows to decode in one call (its inputs
# times their beams): 20,000 lines, beam 4, whole commands 1.03-1.05x faster
# for 1.6x the program to load (docs/benchmarks.md "Wasted rows"; greedy
# search's gain does not pay for its load even there).
FINE_SHRINK_FACTOR, FINE_SHRINK_MIN_ROWS = 2, 8192
# A greedy or sampling decoder's first search with at most this many rows to
# decode in one call is built small where the policy allows it (decode.py on a
# CPU): its steps read the whole self-attention cache (one copy of the
# attention per layer instead of four) and its batch shrinks once (128 -> 32):
# whole greedy commands 1.04-1.05x on 1,000 gettext lines, 1.035x on 5,000;
# break-even near 900 rows at batch 128 (docs/benchmarks.md).
SMALL_DECODER_MAX_ROWS = 1023
# Decode the longest batches first: lanes that take the next batch as they free
# up then end together, instead of one lane decoding the longest batch alone
# at the end (docs/benchmarks.md "Wasted rows"). False: for measuring
# (benchmarks/bench_batching.py).
LONGEST_FIRST = True


class DecoderShape(NamedTuple):
  """Everything compiled into one decoder (`decoders.Decoders.program`); the
  key of the compiled decoders. A tuple, so that it hashes and is written into
  the executable cache's key as it always was."""
  method: str  # "greedy", "beam" or "sample"
  batch: int  # rows (inputs x beams or samples), a multiple of the devices
  src_len: int  # padded source length (a bucket)
  max_len: int  # steps this decoder runs (its cache that long)
  beam_size: int
  top_k: int
  early_exit: bool = True  # stop once the results cannot change
  temperature_on: bool = True  # False: temperature 1, left out of the program
  top_p_on: bool = True  # False: top_p 1, no sort of the vocabulary
  n_best: int = 0  # beam search stops an input once its n_best are final (0: all)
  beam_stop: str = "exact"  # `beam_search.beam_search`'s bound
  shrink: bool = True  # the batch drops finished inputs (`Policy.shrink_batches`)
  log_probs: bool = True  # False: greedy/sampling give zero scores (no log-sum-exp)
  packed: bool = False  # the encoder reads the sources packed several to a row
  search_len: int = 0  # the search these max_len steps begin (0: max_len)
  shrink_factor: int | None = None  # None: SHRINK_FACTOR
  small: bool = False  # the whole cache read at every step, one shrink

  @property
  def first_search(self) -> bool:
    """Whether this decoder runs a first search: its cache sized to the
    translations (`batching.first_search_length`), shorter than the search."""
    return self.max_len < self.search_len


class Shrinking(NamedTuple):
  """How a decoder's batch drops its finished inputs (`loops.Shrink`'s numbers)."""
  factor: int
  min_rows: int
  multiple_of: int
  cuts: int | None


@dataclasses.dataclass
class Policy:
  """The batching policies of one Translator: on by default on a CPU, where
  each was measured to pay; off on a GPU or TPU (`for_platform`). Attributes
  that callers may set (training's evaluation, decode.py, the tests)."""
  devices: int = 1  # this process's devices, over which each batch is split
  # A batch goes on with fewer rows once most of its inputs are done. CPU:
  # 1.6-3x greedy, 1.2-2x beam throughput; an H200: no gain greedy, 1.1x beam 4,
  # for twice the compiling (43.5 against 27.6 s greedy, 53.9 against 26.7 s
  # beam for 1,000 lines at batch 128; docs/benchmarks.md).
  shrink_batches: bool = True
  # The encoder reads a batch's sentences packed several to a row
  # (`source_packing`), not each padded to the batch's length: a CPU with
  # one device.
  pack_sources: bool = True
  # Each batch first decodes `batching.first_search_length` steps (its cache
  # that long) and searches again in full only the inputs left unfinished.
  # False: the whole search at once (training's evaluation: an undertrained
  # model's translations run to the end and each would be searched twice).
  first_search: bool = True
  # The inputs of a length bucket too few to pay for a decoder of their own
  # go to the next longer bucket (`batching.shared_buckets`), each still
  # searched to its own bucket's length: 1,000 gettext lines, greedy, 2
  # decoders instead of 4 (a warm decode.py 0.3 s faster, a first one
  # compiling half as long).
  share_buckets: bool = True
  # Greedy search's and sampling's batches are cut where they pad the least
  # (`batching.length_batches`): 7-12% faster where a batch would pad 105
  # inputs from 16 to 64 tokens.
  cut_least_padding: bool = True
  # Greedy and sampling first searches with at most SMALL_DECODER_MAX_ROWS
  # rows built small: right for a command that loads its decoders for one
  # file (decode.py on a CPU), not for a Translator that keeps them.
  small_decoders_for_few_rows: bool = False

  @classmethod
  def for_platform(cls, platform: str, devices: int) -> Policy:
    """The default policy for `devices` devices of `platform` ("cpu", "gpu", "tpu")."""
    on_cpu = platform == "cpu"
    return cls(devices=devices, shrink_batches=on_cpu, pack_sources=on_cpu and devices == 1,
               share_buckets=on_cpu, cut_least_padding=on_cpu)

  @classmethod
  def for_command(cls, platform: str, devices: int) -> Policy:
    """decode.py's policy: `for_platform`'s, with the small decoders of a
    command that loads its decoders for one file on a CPU. Training's test
    translation plans with it too (`report.test_report`), so that the
    decoders it compiles are those the first decode.py of the same lines
    asks for."""
    policy = cls.for_platform(platform, devices)
    policy.small_decoders_for_few_rows = platform == "cpu"
    return policy

  def batch_rows(self, batch_size: int, copies: int, batch_tokens: int = 0,
                 src_len: int = 0) -> int:
    """Rows of every decoding batch of inputs padded to `src_len`:
    `batch_size`, or `batch_tokens // src_len` (at least one input's `copies`
    sample rows), rounded up to a multiple of the devices."""
    wanted = max(1, batch_tokens // src_len) if batch_tokens else batch_size
    return batching.round_up(max(wanted, copies), self.devices)

  def shrink_factor(self, method: str, rows: int, early_exit: bool) -> int:
    """The shrink factor of a decoder of `method` with `rows` rows to decode
    in this call (its inputs times their beams or samples): for beam search
    that shrinks, FINE_SHRINK_FACTOR from FINE_SHRINK_MIN_ROWS on (more
    compiled sizes, fewer wasted row-steps); otherwise SHRINK_FACTOR (a
    smaller program to load; and for a batch that never shrinks, one decoder
    whatever its rows)."""
    fine = (method == "beam" and early_exit and self.shrink_batches
            and rows >= FINE_SHRINK_MIN_ROWS)
    return FINE_SHRINK_FACTOR if fine else SHRINK_FACTOR

  def small_decoder(self, method: str, rows: int, first_search: bool) -> bool:
    """Whether a decoder of `method` with `rows` rows to decode in this call,
    in a first search or not, is built small (`DecoderShape.small`): greedy
    search and sampling with at most SMALL_DECODER_MAX_ROWS rows, whose load
    and first call that makes cheaper than their decoding slower. Beam search
    already reads its whole cache, and its few rows decode long enough to
    pay for every shrink (one only: 4.5% slower on 1,000 lines at 128)."""
    return bool(self.small_decoders_for_few_rows and first_search and method != "beam"
                and rows <= SMALL_DECODER_MAX_ROWS)


class Request(NamedTuple):
  """What one call asks for (`Translator.translate_hypotheses`' options)."""
  method: str = "beam"
  beam_size: int = 4
  beam_stop: str = "exact"
  n_best: int = 1
  top_k: int = 0
  temperature: float = 1.0
  top_p: float = 1.0
  min_len: int = 0
  max_len: int | None = None
  extra_len: int = 50
  batch_size: int = 32
  batch_tokens: int = 0
  early_exit: bool = True
  scores: bool = True

  @property
  def log_probs(self) -> bool:
    """Whether the decoder computes log-probabilities (a log-sum-exp over the
    vocabulary per step): beam search and ranked samples need them."""
    return self.scores or self.method == "beam" or self.n_best > 1

  @property
  def copies(self) -> int:
    """Rows one input takes in `pack_batch`: one per sample, else one."""
    return self.n_best if self.method == "sample" else 1


class Plan(NamedTuple):
  """What `runner.py` decodes: `batches` [(shape, indices of its inputs)] in
  the order to decode them (this share's only), `limits` {input: most
  tokens it generates, its own bucket's}."""
  batches: list[tuple[DecoderShape, list[int]]]
  limits: dict[int, int]


def output_length(src_len: int, max_len: int | None, extra_len: int,
                  position_limit: int | None) -> int:
  """Most tokens generated for a bucket of inputs padded to `src_len`:
  `max_len`, else src_len + extra_len rounded up to whole early-exit chunks
  (one compilation, not two); at most `position_limit` (learned positions:
  no embedding past the model's max_len)."""
  out_len = max_len
  if out_len is None:
    out_len = batching.round_up(src_len + extra_len, options.EARLY_EXIT_CHUNK)
  if position_limit is not None:
    out_len = min(out_len, position_limit)
  return out_len


def plan(encoded: Sequence[list[int]], request: Request, policy: Policy, *,
         max_source_len: int, position_limit: int | None = None,
         share: tuple[int, int] = (0, 1)) -> Plan:
  """The batches that decode `encoded` (token ids with EOS per input; [] for a
  blank one, which no batch holds).

  The non-empty inputs are cut into batches of consecutive lengths
  (`batching.length_batches`), each padded to its bucket; buckets too small
  to pay for a decoder go to a longer one (`Policy.share_buckets`), each
  input still searched to its own bucket's length (`limits`). A batch first
  searches `first_search_length` steps where early exit and the policy allow.
  Each decoder's shrink factor and size follow the rows it decodes in this
  call, counted over every share, so that all processes make the same
  decoders. `share` (index, count): this process decodes batches index,
  index + count, ... of them."""
  method, copies = request.method, request.copies
  switches = ((request.temperature != 1.0, request.top_p < 1.0) if method == "sample"
              else (False, False))
  beam_options = (request.n_best, request.beam_stop) if method == "beam" else (0, "exact")
  rows_for = lambda src_len: policy.batch_rows(request.batch_size, copies,
                                               request.batch_tokens, src_len)
  out_len_for = lambda src_len: output_length(src_len, request.max_len, request.extra_len,
                                              position_limit)
  decoder_rows = rows_per_input(method, request.beam_size, request.n_best)
  shared = (batching.shared_buckets(encoded, max_source_len, decoder_rows)
            if policy.share_buckets else {})
  batches, limits = [], {}
  for src_len, members in batching.length_batches(
      encoded, max_source_len, lambda src_len: max(1, rows_for(src_len) // copies), shared,
      least_padding=policy.cut_least_padding and method != "beam"):
    out_len = out_len_for(src_len)
    for i in members:
      limits[i] = out_len_for(batching.bucket_length(len(encoded[i]), max_source_len))
    first_len = (batching.first_search_length(src_len, out_len, request.min_len)
                 if request.early_exit and policy.first_search else out_len)
    shape = DecoderShape(method, rows_for(src_len), src_len, first_len, request.beam_size,
                         request.top_k, request.early_exit, *switches, *beam_options,
                         policy.shrink_batches, request.log_probs, policy.pack_sources, out_len)
    batches.append((shape, members))
  rows_per_decoder: dict[DecoderShape, int] = {}
  for shape, members in batches:
    rows_per_decoder[shape] = rows_per_decoder.get(shape, 0) + len(members) * decoder_rows
  built = {shape: shape._replace(
               shrink_factor=policy.shrink_factor(method, rows, request.early_exit),
               small=policy.small_decoder(method, rows, shape.first_search))
           for shape, rows in rows_per_decoder.items()}
  share_index, share_count = share
  mine = [(built[shape], members) for shape, members in batches][share_index::share_count]
  return Plan(mine[::-1] if LONGEST_FIRST else mine, limits)


def search_again_shape(shape: DecoderShape, copies: int, devices: int) -> DecoderShape:
  """The decoder that searches again in full (max_len = search_len) the
  inputs that first searches of `shape` left unfinished, `copies` rows an
  input: SHRINK_MIN_ROWS rows (at least one input's, a multiple of the
  devices, at most the batch's), which never shrink. One such decoder per
  first search's, however many inputs are left (they go in as many batches
  as they fill): a first run compiles at most one more per bucket, the
  smallest, and training's test translation compiles the ones decode.py
  asks for (`report.test_report`)."""
  rows = batching.round_up(max(SHRINK_MIN_ROWS, copies), devices)
  return shape._replace(batch=min(shape.batch, rows), max_len=shape.search_len,
                        shrink_factor=SHRINK_FACTOR, small=False)


def shrinking(shape: DecoderShape, devices: int) -> Shrinking | None:
  """How a decoder of `shape` drops its finished inputs: to 1 / its factor
  of its rows once they hold the unfinished, down to SHRINK_MIN_ROWS (a
  multiple of the devices), once only for a small decoder. None without
  early exit (every step on every row, for benchmarks) or `shape.shrink`."""
  if not (shape.early_exit and shape.shrink):
    return None
  # (the loop counts inputs: a beam search's hold beam_size rows each)
  per_input = shape.beam_size if shape.method == "beam" else 1
  return Shrinking(factor=shape.shrink_factor or SHRINK_FACTOR,
                   min_rows=max(SHRINK_MIN_ROWS // per_input, 1, devices), multiple_of=devices,
                   cuts=1 if shape.small else None)
