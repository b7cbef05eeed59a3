"""Version of the pipeline code, recorded in every output file's attributes."""

CODE_VERSION = "0.1.0"
