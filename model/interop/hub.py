"""Downloading a release from the Hugging Face Hub (`python -m model.hf import --hf ORG/NAME`),
through huggingface_hub (the optional `hub` extra: `pip install 'stepjax[hub]'`).

Only what an import reads is fetched (`RELEASE_FILES`: config.json, the safetensors shards and
their index, the tokenizer and chat-template files), into huggingface_hub's cache (`HF_HOME`,
`HF_HUB_CACHE`), which resumes an interrupted download and is shared with other tools.
"""

from __future__ import annotations

import re
from pathlib import Path

from model.interop.hf_import import TOKENIZER_FILES
from model.interop.safetensors_io import INDEX

RELEASE_FILES = ("config.json", "*.safetensors", INDEX, *TOKENIZER_FILES)
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def check_repo_id(repo_id: str) -> None:
    """A Hub model id ORG/NAME, or a one-line ValueError naming --hf."""
    if not REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        raise ValueError(f"--hf: {repo_id!r} is not a Hugging Face model id; expected ORG/NAME, "
                         "e.g. stepfun-ai/Step-3.5-Flash")


def download_release(repo_id: str, revision: str | None = None) -> Path:
    """The local directory of release `repo_id` (RELEASE_FILES only) at `revision` (default:
    the main branch), downloaded or found in the cache."""
    check_repo_id(repo_id)
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError("--hf: downloading needs huggingface_hub: pip install 'stepjax[hub]' "
                         "(or download the release yourself and pass its directory)") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                      allow_patterns=list(RELEASE_FILES)))
    except OSError as err:  # every huggingface_hub error (HTTP, not found, offline) is one
        reason = " ".join(str(err).split())[:300]
        raise OSError(f"--hf {repo_id}: download failed ({type(err).__name__}: {reason})"
                      ) from None
