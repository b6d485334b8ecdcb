"""Models named by Hugging Face Hub id: tell an id from a path, and say why one cannot be loaded here.

Loading itself is `from_pretrained`'s (`models.loaders.load_hub_model`): online it downloads into the Hugging
Face cache like any HF tool, offline (`HF_HUB_OFFLINE=1`) it reads that cache. This module answers, without
importing torch, whether an id can load (`hub_problem`), so a command refuses a wrong one before it starts
anything, naming the id and saying which: offline and not cached, not on the Hub, no such revision, or the
Hub unreachable.
"""

from __future__ import annotations

import re
from pathlib import Path

# `name` or `org/name`, as the Hub spells repository ids (letters, digits, "-", "_", ".").
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# Seconds a refusal waits for the Hub's answer about an id that is not cached (the load itself has no bound).
HUB_QUERY_TIMEOUT_S = 15.0


def is_hub_id(spec: str) -> bool:
    """Whether `spec` reads as a Hub repository id (`org/name` or `name`), not a path that exists here."""
    return (bool(_HUB_ID.match(spec)) and ".." not in spec and not spec.endswith(".")
            and not Path(spec).exists())


def describe(repo_id: str, revision: str | None) -> str:
    """"'org/name'" or "'org/name' at revision 'v1'", for messages."""
    return repr(repo_id) + (f" at revision {revision!r}" if revision else "")


def cached_config(repo_id: str, revision: str | None = None) -> str | None:
    """The path of the id's config.json in the Hugging Face cache (`HF_HOME`/`HF_HUB_CACHE`), or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return found if isinstance(found, str) else None


def hub_problem(repo_id: str, revision: str | None = None) -> str | None:
    """Why the Hub model `repo_id` (at `revision`, default its main branch) cannot be loaded here, or None.

    Cached: None. Offline and not cached: says so, with the cache searched. Online: asks the Hub
    (`model_info`), which tells a missing repository or revision from an unreachable Hub.
    """
    if cached_config(repo_id, revision) is not None:
        return None
    from huggingface_hub import constants

    what = describe(repo_id, revision)
    if constants.HF_HUB_OFFLINE:
        return (f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is "
                f"set, so nothing is downloaded: download it first (`hf download {repo_id}"
                f"{f' --revision {revision}' if revision else ''}`) or unset HF_HUB_OFFLINE")
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        model_info(repo_id, revision=revision, timeout=HUB_QUERY_TIMEOUT_S)
    except GatedRepoError:
        return f"{what} is gated on the Hugging Face Hub: accept its terms on its page, then `hf auth login`"
    except RevisionNotFoundError:
        return f"the Hugging Face Hub has {repo_id!r} but no revision {revision!r} of it"
    except RepositoryNotFoundError:
        return (f"{what} is neither a directory here nor a model on the Hugging Face Hub (a private one "
                "needs `hf auth login`)")
    except Exception as error:  # noqa: BLE001 - no connection, a proxy, a timeout: the Hub cannot answer
        return (f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub cannot be "
                f"reached ({type(error).__name__}: {error}); download it where it can, or set HF_ENDPOINT")
    return None


def load_error(repo_id: str, revision: str | None, error: OSError) -> ValueError:
    """The one-line error for a `from_pretrained` of the Hub id `repo_id` that raised `error` (transformers'
    OSError for "not found", "offline and not cached" and "no such revision"): why, as `hub_problem` says."""
    return ValueError(hub_problem(repo_id, revision) or f"model {describe(repo_id, revision)}: {error}")
