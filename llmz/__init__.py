"""llmz: GPT-2 training in Python the way llm.c writes it (Numba CUDA kernels, NCCL, ZeRO stages 0-2).

Importing llmz imports no numba: `llmz.device.resolve()` must be able to switch on the CUDA simulator first.
"""
__version__ = "0.1.0"
