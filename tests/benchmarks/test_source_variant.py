"""benchmarks/source_variant.py: a variant copy gets exactly the edits asked for, and text that is not there
exactly once stops it before anything is written."""

import pytest

from benchmarks.source_variant import source_variant


def test_a_variant_has_its_edits_and_the_source_is_untouched(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "kernel.cu").write_text("int ahead = 2;\nint rows = 8;\n")
    (src / "pkg" / "other.py").write_text("x = 1\n")
    dest = source_variant(src, tmp_path / "v" / "src", "pkg/kernel.cu", [("ahead = 2", "ahead = 3")])
    assert (dest / "pkg" / "kernel.cu").read_text() == "int ahead = 3;\nint rows = 8;\n"
    assert (dest / "pkg" / "other.py").read_text() == "x = 1\n"
    assert (src / "pkg" / "kernel.cu").read_text() == "int ahead = 2;\nint rows = 8;\n"


@pytest.mark.parametrize("old", ["ahead = 4", "int"])  # absent, and twice
def test_text_not_there_exactly_once_stops_the_variant(tmp_path, old):
    src = tmp_path / "src"
    src.mkdir()
    (src / "kernel.cu").write_text("int ahead = 2;\nint rows = 8;\n")
    with pytest.raises(ValueError, match="kernel.cu"):
        source_variant(src, tmp_path / "v", "kernel.cu", [(old, "new")])
    assert not (tmp_path / "v").exists()
