"""Tests for transformer/translation.py's option check (the Translator itself
is exercised on a trained model in test_api.py and test_decode_cli.py)."""

from __future__ import annotations

import pytest

from transformer import translation


@pytest.mark.parametrize("options,option", [
    (dict(method="viterbi"), "method"),
    (dict(beam_size=0), "beam_size"),
    (dict(n_best=0), "n_best"),
    (dict(n_best=5), "n_best"),                        # > beam_size=4
    (dict(method="greedy", n_best=2), "n_best"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(temperature=-0.5), "temperature"),
    (dict(length_penalty=-1.0), "length_penalty"),
    (dict(max_len=0), "max_len"),
    (dict(min_len=-1), "min_len"),
    (dict(max_len=5, min_len=5), "min_len"),
    (dict(batch_size=0), "batch_size"),
])
def test_check_options_names_the_option_and_its_value(options, option):
  with pytest.raises(translation.OptionError) as info:
    translation.check_options(**options)
  error = info.value
  assert isinstance(error, ValueError)
  assert (error.option, error.value) == (option, options[option])
  assert str(error) == f"{option}={options[option]}: {error.problem}"


def test_check_options_accepts_every_usable_value():
  translation.check_options()                       # translate()'s defaults
  translation.check_options(method="beam", beam_size=4, n_best=4)
  translation.check_options(method="sample", n_best=3, top_p=1.0, top_k=0,
                            temperature=0.0, length_penalty=0.0, min_len=4, max_len=5)
  for method in translation.METHODS:
    translation.check_options(method=method)
