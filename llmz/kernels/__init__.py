"""One file per layer: its @cuda.jit kernels, their launchers and the NumPy reference of the same math.

Every public layer function takes the Device first and then its arrays, llm.c style (outputs first):
    gelu_forward(dev, out, inp)
On `dev.kernels` it launches the Numba kernel; otherwise it runs the NumPy reference `*_ref`.
Backward functions accumulate (+=) into parameter and input gradients, as llm.c's do; each says so.
"""
