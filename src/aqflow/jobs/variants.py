"""The variant grammar: the path segment that names one quantization run of a model at a bit rate.

`[g<group>m<codebooks>k<codewords>-]b<beam>[e<epochs>][s<seed>]`, e.g. `b8`, `b8e5s43` or
`g6m2k64-b8`: a geometry prefix replaces the bit rate's codebook layout (a rho sweep at one bit
rate), `e` the configured epoch budget, `s` the configured seed. `VARIANT_REGEX` is the one
spelling of it: the Snakefile's wildcard constraint and `parse_variant` both use it.

Pure Python (no torch): the Snakefile imports it to plan the DAG.
"""

from __future__ import annotations

import re

# groups: group size, codebooks, codewords, beam, epochs, seed (unnamed: Snakemake wraps a
# constraint in a group named after its wildcard)
VARIANT_REGEX = r"(?:g(\d+)m(\d+)k(\d+)-)?b(\d+)(?:e(\d+))?(?:s(\d+))?"
VARIANT_FORM = "[g<group>m<codebooks>k<codewords>-]b<beam>[e<epochs>][s<seed>]"


def parse_variant(variant: str) -> dict[str, int]:
    """ "b8" -> {beam_size: 8}; "g6m2k64-b8e5s43" -> {group_size: 6, num_codebooks: 2, nbits: 6,
    beam_size: 8, max_epochs: 5, seed: 43}: the QuantizerSettings fields the path sets."""
    match = re.fullmatch(VARIANT_REGEX, variant)
    if match is None:
        raise ValueError(f"variant {variant!r} is not {VARIANT_FORM}")
    group, codebooks, codewords, beam, epochs, seed = match.groups()
    settings = {"beam_size": int(beam)}
    if group:
        codewords = int(codewords)
        if codewords < 2 or codewords & (codewords - 1):
            raise ValueError(f"variant {variant!r}: k{codewords} codewords must be a power of two")
        settings.update(group_size=int(group), num_codebooks=int(codebooks), nbits=codewords.bit_length() - 1)
    if epochs:
        settings["max_epochs"] = int(epochs)
    if seed:
        settings["seed"] = int(seed)
    return settings


def geometry_name(group_size: int, num_codebooks: int | None, nbits: int) -> str:
    """8, 2, 8 -> "g8m2k256" (as in variant paths)."""
    return f"g{group_size}m{num_codebooks}k{1 << nbits}"


def variant_name(beam: int, epochs: int | None = None, seed: int | None = None, geometry: str | None = None,
                 default_seed: int | None = None, default_geometry: str | None = None) -> str:
    """The inverse of parse_variant. A seed or geometry equal to the configuration's default
    (`default_seed`, `default_geometry`) stays implicit, so that a grid reuses the default targets'
    runs; epochs are written whenever given, as targets always have been."""
    name = f"b{beam}"
    if epochs is not None:
        name += f"e{epochs}"
    if seed is not None and seed != default_seed:
        name += f"s{seed}"
    return f"{geometry}-{name}" if geometry and geometry != default_geometry else name
