"""Models from the Hugging Face hub, through its ordinary cache.

`snapshot_download` resolves a revision (branch, tag or commit) to a commit hash and returns the
cache's snapshot folder `$HF_HOME/hub/models--ORG--NAME/snapshots/<commit>`; with
`HF_HUB_OFFLINE=1` it resolves from the cache alone (`refs/<branch>` holds the commit). Every
hub failure becomes one `HubModelError` line naming the id and what to do.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# What a plain model folder needs: config, weights, tokenizer. Llama repos also carry the original
# Meta checkpoint under original/ (another full copy of the weights), which is never read here.
SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
IGNORED_PATTERNS = ["original/*", "*.pth", "*.bin", "*.gguf", "*.onnx", "*.h5", "*.msgpack"]


class HubModelError(RuntimeError):
    """A hub model that cannot be fetched; the message says why and what to do, in one line."""


def _access_advice(hub_id: str) -> str:
    return (f"log in with `hf auth login` (`huggingface-cli login` in older huggingface_hub) or set HF_TOKEN, "
            f"accept the license on "
            f"https://huggingface.co/{hub_id} if it is gated; check the id and revision")


def snapshot_model(hub_id: str, revision: str | None = None,
                   patterns: list[str] | None = None) -> tuple[Path, str]:
    """(snapshot folder, commit hash) of `hub_id` at `revision` (default: the main branch), holding
    the files matching `patterns` (default: a model folder's config, weights and tokenizer).

    Downloads what is missing into the hub cache (`HF_HOME`), or, offline, finds it there.
    Raises HubModelError for a gated, private, missing or uncached model.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{hub_id}" + (f" (revision {revision})" if revision else "")
    try:
        folder = Path(snapshot_download(hub_id, revision=revision, allow_patterns=patterns or SNAPSHOT_PATTERNS,
                                        ignore_patterns=IGNORED_PATTERNS))
    except GatedRepoError:
        raise HubModelError(f"hub model {where} is gated and this account may not read it: "
                            f"{_access_advice(hub_id)}") from None
    except RevisionNotFoundError:
        raise HubModelError(f"hub model {hub_id} has no revision {revision!r}: check `revision:` in config.yaml") from None
    except RepositoryNotFoundError:
        raise HubModelError(f"hub model {where} was not found (or is private and no token was sent): "
                            f"{_access_advice(hub_id)}") from None
    except HFValidationError as error:
        raise HubModelError(f"{hub_id!r} is not a valid hub id (ORG/NAME): {error}") from None
    except IncompleteSnapshotError:
        raise HubModelError(f"the hub cache holds an incomplete download of {where} and the hub cannot be reached "
                            "(HF_HUB_OFFLINE=1 or no network): rerun once with a network to complete it") from None
    except LocalEntryNotFoundError:
        raise HubModelError(f"hub model {where} is not in the hub cache and the hub cannot be reached "
                            "(HF_HUB_OFFLINE=1 or no network): run once with a network, or unset HF_HUB_OFFLINE; "
                            f"{_access_advice(hub_id)}") from None
    except HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubModelError(f"hub model {where}: access refused (HTTP {status}): {_access_advice(hub_id)}") from None
        raise HubModelError(f"hub model {where}: the hub answered {error.__class__.__name__} "
                            f"(HTTP {status}); try again later") from None
    return folder, folder.name


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub uses: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def cached_config(hub_id: str, revision: str | None = None) -> dict | None:
    """config.json of `hub_id` at `revision` if the hub cache already holds it, else None.

    Pure Python (no huggingface_hub, no network), for Snakemake's DAG build: the revision is a
    commit hash or a ref (branch/tag, default main) resolved through `refs/`.
    """
    if hub_id.count("/") != 1:
        return None
    repo_dir = hub_cache_dir() / ("models--" + hub_id.replace("/", "--"))
    revision = revision or "main"
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        commit = revision
    else:
        ref = repo_dir / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    config = repo_dir / "snapshots" / commit / "config.json"
    return json.loads(config.read_text()) if config.is_file() else None
