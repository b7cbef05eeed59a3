"""Exceptions the pipeline raises for bad input; the CLI prints them as one sentence."""


class PipelineError(Exception):
    """A problem with the user's input or files, reported without a traceback.

    The message names the file, key or value at fault and what was expected.
    """


class ConfigError(PipelineError):
    """An invalid configuration: names the key, the value and what is allowed."""
