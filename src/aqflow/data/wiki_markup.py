"""Turn MediaWiki markup into plain text, the way WikiText-style corpora present articles.

The Wikipedia stand-in ships raw wikitext. A language model's perplexity on it is only comparable
to WikiText-2 numbers when what it reads is prose, so templates, references, tables, file and
category links and HTML are removed, links keep their visible label, and headings stay as plain
lines. The rules are regular expressions plus a bracket matcher for the constructs that nest
(templates inside templates, tables inside tables, links inside image captions), which a regular
expression alone cannot remove correctly.
"""

from __future__ import annotations

import html
import re

# Tags whose content is not prose: drop the tag and everything inside it.
_DROP_CONTENT_TAGS = (
    "ref", "math", "chem", "ce", "gallery", "timeline", "syntaxhighlight", "source", "score",
    "imagemap", "hiero", "graph", "mapframe", "templatedata", "references",
)
_DROP_CONTENT_RE = re.compile(
    r"<(%s)\b[^>]*?(?<!/)>.*?</\1\s*>" % "|".join(_DROP_CONTENT_TAGS), re.IGNORECASE | re.DOTALL
)
_SELF_CLOSING_RE = re.compile(r"<(%s)\b[^>]*/>" % "|".join(_DROP_CONTENT_TAGS), re.IGNORECASE)
_COMMENT_RE = re.compile(r"<!--.*?(-->|\Z)", re.DOTALL)
_BR_RE = re.compile(r"<br\s*/?>", re.IGNORECASE)
_ANY_TAG_RE = re.compile(r"</?[A-Za-z][A-Za-z0-9]*\b[^<>]*?/?>")
_TEMPLATE_TOKEN_RE = re.compile(r"\{\{|\}\}")
_TABLE_TOKEN_RE = re.compile(r"^[ \t]*(\{\||\|\})", re.MULTILINE)
# Innermost link: no link inside, but balanced single brackets are allowed, as in captions like
# "Bicyclo[1.1.0]butane" or "Portrait [c. 1840]]]" (the last "]]" closes the link).
_INNERMOST_LINK_RE = re.compile(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\]")
_EXTERNAL_LINK_RE = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+[ \t]*([^\]]*)\]")
_BOLD_ITALIC_RE = re.compile(r"'{2,5}")
_HEADING_RE = re.compile(r"^[ \t]*(=+)[ \t]*(.*?)[ \t]*\1[ \t]*$", re.MULTILINE)
_LIST_MARKER_RE = re.compile(r"^[ \t]*[*#:;]+[ \t]*", re.MULTILINE)
_TABLE_LEFTOVER_RE = re.compile(r"^[ \t]*[|!].*$", re.MULTILINE)
_MAGIC_WORD_RE = re.compile(r"__[A-Z]+__")
_EMPTY_PARENS_RE = re.compile(r"\([\s,;:]*\)")
_SPACES_RE = re.compile(r"[ \t\u00a0]+")
_BLANK_LINES_RE = re.compile(r"\n{3,}")

# Link namespaces whose target is not part of the sentence (images, categories).
_DROP_LINK_NAMESPACES = {"file", "image", "category", "media"}
# Interlanguage links look like [[fr:Anarchisme]]: a short lowercase language code and no label.
_LANGUAGE_CODE_RE = re.compile(r"[a-z]{2,3}(-[a-z]+)*")


def remove_nested(text: str, token_re: re.Pattern, opener: str) -> str:
    """Remove every balanced span delimited by the tokens `token_re` matches.

    `token_re` matches both the opening and the closing token; a match equal to `opener` (after
    stripping surrounding blanks) opens a span. A closing token at depth 0 is stray markup and is
    kept as text; a span still open at the end of the text runs to the end and is removed (the
    stand-in's articles are sometimes cut in the middle of a template).
    """
    pieces: list[str] = []
    depth = 0
    keep_from = 0
    for match in token_re.finditer(text):
        is_open = match.group(match.lastindex or 0).strip() == opener
        if is_open:
            if depth == 0:
                pieces.append(text[keep_from:match.start()])
            depth += 1
        elif depth > 0:
            depth -= 1
            if depth == 0:
                keep_from = match.end()
    if depth == 0:
        pieces.append(text[keep_from:])
    return "".join(pieces)


def _replace_link(match: re.Match) -> str:
    inner = match.group(1)
    target, _, label = inner.partition("|")
    target = target.strip()
    if target.startswith(":"):  # [[:Category:X]] links to the page instead of categorising
        target = target[1:].strip()
    elif ":" in target:
        namespace = target.split(":", 1)[0].strip().lower()
        if namespace in _DROP_LINK_NAMESPACES:
            return ""
        if not label and _LANGUAGE_CODE_RE.fullmatch(namespace):
            return ""
    if label:
        # With several pipes only the last field is shown (captions of the rare piped forms).
        return label.rsplit("|", 1)[-1].strip()
    return target


def replace_links(text: str, max_rounds: int = 10) -> str:
    """Replace [[target|label]] by label and [[target]] by target; drop file/category/language links.

    Innermost links are resolved first, so a caption link inside [[File:...|...[[x]]...]] is
    flattened before the file link itself is dropped.
    """
    for _ in range(max_rounds):
        text, count = _INNERMOST_LINK_RE.subn(_replace_link, text)
        if count == 0:
            break
    return text


def strip_wiki_markup(wikitext: str) -> str:
    """Return the plain text of one article's wikitext.

    Paragraphs are separated by blank lines; headings become plain lines ("== History ==" ->
    "History"); list markers are dropped but the item text is kept; templates, tables,
    references, comments, math and file/category links are removed entirely.
    """
    text = _COMMENT_RE.sub("", wikitext)
    text = _SELF_CLOSING_RE.sub("", text)
    text = _DROP_CONTENT_RE.sub("", text)
    text = remove_nested(text, _TEMPLATE_TOKEN_RE, "{{")
    text = remove_nested(text, _TABLE_TOKEN_RE, "{|")
    text = replace_links(text)
    text = _EXTERNAL_LINK_RE.sub(lambda m: m.group(1), text)
    text = _BR_RE.sub(" ", text)
    text = _ANY_TAG_RE.sub("", text)
    text = _BOLD_ITALIC_RE.sub("", text)
    text = _MAGIC_WORD_RE.sub("", text)
    text = _HEADING_RE.sub(lambda m: m.group(2), text)
    text = _TABLE_LEFTOVER_RE.sub("", text)
    text = _LIST_MARKER_RE.sub("", text)
    # Entities are decoded last: decoding "&lt;ref&gt;" earlier would create tags the rules above
    # would then misread.
    text = html.unescape(text)
    text = _EMPTY_PARENS_RE.sub("", text)
    text = _SPACES_RE.sub(" ", text)
    text = re.sub(r" +([,.;:])", r"\1", text)
    lines = [line.strip() for line in text.split("\n")]
    text = "\n".join(lines)
    return _BLANK_LINES_RE.sub("\n\n", text).strip()
