"""Checkpoints outlive code changes: parameter trees keep their names and shapes,
and a checkpoint written before a change restores and translates identically.

The fixtures were written by main at commit d26a6fb, before `model.py` was split
into `model.py`, `layers.py` and `kv_cache.py`, and are never regenerated:
  tests/fixtures/workdir_d26a6fb/   a tiny model (d_model 32, 2 + 2 layers) trained
      on the demo task by train.py: its averaged parameters, model_config.json,
      vocab.model, and expected.json, what that code translated it to (greedy,
      beam, n-best with scores, sampling, the cross-attention weights).
  tests/fixtures/param_trees_d26a6fb.json   the parameter names and shapes of
      every layout a config can choose (scan_layers, untied embeddings, learned
      positions, pre-LN, remat).
"""

import json
import os

import jax
import numpy as np
import pytest

import transformer
from transformer.model import transformer as M

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
WORKDIR = os.path.join(FIXTURES, "workdir_d26a6fb")


def _flat_shapes(params) -> dict[str, list[int]]:
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {"/".join(p.key for p in path): list(x.shape) for path, x in flat}


def test_parameter_trees_keep_their_names_and_shapes():
  with open(os.path.join(FIXTURES, "param_trees_d26a6fb.json")) as f:
    stored = json.load(f)
  for name, variant in stored["variants"].items():
    config = M.TransformerConfig(**stored["base"], **variant["config"])
    shapes = jax.eval_shape(lambda k: M.init_params(config, k), jax.random.key(0))
    assert _flat_shapes(shapes) == variant["params"], name


@pytest.fixture(scope="module")
def translator_and_expected():
  with open(os.path.join(WORKDIR, "expected.json")) as f:
    expected = json.load(f)
  with jax.default_matmul_precision("highest"):
    yield transformer.load_translator(WORKDIR), expected


def test_an_old_checkpoint_translates_as_it_did(translator_and_expected):
  translator, expected = translator_and_expected
  inputs = expected["inputs"]
  assert translator.translate(inputs, method="greedy") == expected["greedy"]
  assert translator.translate(inputs, method="beam", beam_size=4) == expected["beam"]
  nbest = translator.translate(inputs, method="beam", beam_size=4, n_best=2)
  want = expected["beam_nbest"]
  assert [[h for h, _ in hyps] for hyps in nbest] == [[h for h, _ in hyps] for hyps in want]
  np.testing.assert_allclose([[s for _, s in hyps] for hyps in nbest],
                             [[s for _, s in hyps] for hyps in want], rtol=0, atol=1e-5)
  # Sampling draws each line from its own key since the streaming decoder
  # (a line's sample depends on the seed and its line number only), so the
  # fixture's samples, drawn from one key per batch, are not reproduced; the
  # sampler on the old checkpoint is checked through top_k=1, which is greedy.
  assert translator.translate(inputs, method="sample", top_k=1, seed=3) == expected["greedy"]


def test_an_old_checkpoint_attends_as_it_did(translator_and_expected):
  translator, expected = translator_and_expected
  want = expected["cross_attention"]
  source, target, weights = translator.cross_attention(expected["inputs"][0])
  assert (source, target, list(weights.shape)) == (want["source"], want["target"],
                                                   want["shape"])
  np.testing.assert_allclose(weights.sum(), want["sum"], rtol=1e-6)
  np.testing.assert_allclose(weights[0, 0, 0], want["first_row"], rtol=0, atol=1e-6)
