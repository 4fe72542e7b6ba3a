"""aqflow: additive quantization (AQLM format) with OA-EM initialisation, wired as a pipeline."""

__version__ = "0.1.0"
