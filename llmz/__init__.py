"""llmz: GPT-2 training in Python the way llm.c writes it (Numba CUDA kernels, NCCL, ZeRO stages 0-3).

Importing llmz imports no numba: `llmz.device.resolve()` must be able to switch on the CUDA simulator first.
"""
import sys

__version__ = "0.1.0"

if sys.argv[:1] == ["-m"]:      # `python -m llmz.<command>` is starting: Ctrl-C during its imports is one line
    from .errors import one_line_interrupts
    one_line_interrupts()
    from .run.environment import explain_missing_modules  # so is a requirement missing from this Python
    explain_missing_modules()
