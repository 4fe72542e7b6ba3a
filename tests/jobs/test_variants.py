"""The variant grammar: one regex, a parser and its inverse."""

import itertools
import re

import pytest

from aqflow.jobs.variants import VARIANT_REGEX, geometry_name, parse_variant, variant_name


def test_every_name_parses_back_to_the_settings_it_was_made_from():
    for beam, epochs, seed, geometry in itertools.product((1, 8, 16), (None, 5), (None, 43), (None, "g6m2k64")):
        name = variant_name(beam, epochs, seed, geometry, default_seed=42, default_geometry="g8m2k256")
        assert re.fullmatch(VARIANT_REGEX, name), name
        parsed = parse_variant(name)
        assert parsed["beam_size"] == beam and parsed.get("max_epochs") == epochs and parsed.get("seed") == seed
        if geometry:
            assert geometry_name(parsed["group_size"], parsed["num_codebooks"], parsed["nbits"]) == geometry
        else:
            assert "group_size" not in parsed


def test_the_defaults_stay_out_of_the_path():
    """A grid cell with the configured seed and the bit rate's own geometry is the default target's run."""
    assert variant_name(8, None, 42, "g8m2k256", default_seed=42, default_geometry="g8m2k256") == "b8"
    assert variant_name(8, 5, 43, "g4m1k256", default_seed=42, default_geometry="g8m2k256") == "g4m1k256-b8e5s43"


@pytest.mark.parametrize("bad", ["8", "b", "b8x", "e5b8", "g6m2-b8", "b8s", "B8", "b8e5s43/"])
def test_what_the_regex_refuses_the_parser_refuses_by_name(bad):
    assert re.fullmatch(VARIANT_REGEX, bad) is None
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_variant(bad)


def test_codewords_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="k63 codewords must be a power of two"):
        parse_variant("g6m2k63-b8")
    assert parse_variant("g6m2k64-b8")["nbits"] == 6
