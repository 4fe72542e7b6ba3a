"""Using a compressed model: AQLM linears kept in their stored form (`layout`), decode kernels for
the GPU and the CPU, a decode loop, text generation and speed measurement."""
