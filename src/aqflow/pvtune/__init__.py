"""PV-tuning (Malinovskii et al. 2024): end-to-end fine-tuning of an AQLM checkpoint against its
full-precision teacher. The P-step trains the continuous parameters (codebooks, scales, and
optionally the non-quantized weights) with Adam; the V-step moves the integer codes by a
straight-through Adam step on a float copy of each quantized weight followed by a weight-space
beam search toward it.

Modules, one concern each: `student` (the trainable view of a checkpoint, and writing it back),
`loss` (chunked token-level KL and NLL), `distill` (teacher and student as the modules a step
runs), `vstep` (choosing and re-encoding groups), `vstep_adam` (the V-step's Adam), `offload`
(the V-step's state in host memory), `distributed` (what each of several processes holds: FSDP2
and the V-step's rows), `memory` (the state's size per process, before loading), `resume` (the
state on disk), `data` (training and held-out windows from calibration documents), `train` (the
loop, held-out selection, early stop).
"""
