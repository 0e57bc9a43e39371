"""The fast kernel set: GPU kernels that replace a teaching kernel (llmz.kernels), each tested against it."""
