"""rljob: train tool-using LLM agents with GRPO, on Kubernetes or on one machine.

Importing the package is cheap: heavy dependencies (torch, transformers) load only in the
modules that need them.
"""

__version__ = "0.1.0"
