"""PV-tuning (Malinovskii et al. 2024): end-to-end fine-tuning of an AQLM checkpoint against its
full-precision teacher. The P-step trains the continuous parameters (codebooks, scales, and
optionally the non-quantized weights) with Adam; the V-step moves the integer codes by a
straight-through Adam step on a float copy of each quantized weight followed by a weight-space
beam search toward it.

Modules, one concern each: `student` (the trainable view of a checkpoint, and writing it back),
`loss` (chunked token-level KL and NLL), `vstep` (choosing and re-encoding groups), `data`
(training and held-out windows from calibration documents), `train` (the loop, held-out
selection, torch.distributed).
"""
