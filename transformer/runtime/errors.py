"""A bad value of a named option, raised from any layer (decoding options, the
checkpoint choice) so that a command line can name its flag."""


class OptionError(ValueError):
  """An option value that cannot be used. `str(e)` reads "option=value:
  problem"; `option`, `value` and `problem` are kept apart so that a command
  line can name its flag instead (decode.py: "--option=value: problem")."""

  def __init__(self, option: str, value, problem: str):
    super().__init__(f"{option}={value}: {problem}")
    self.option, self.value, self.problem = option, value, problem
