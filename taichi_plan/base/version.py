"""The package's version (``taichi_plan.__version__``), where the CLI and the reports read it."""

__version__ = "0.1.0"
