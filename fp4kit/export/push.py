"""Upload a checkpoint folder to the Hugging Face hub (only one that passes conformance)."""

from __future__ import annotations

from pathlib import Path


def push(folder: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
         check: bool = True, api=None) -> str:
    """Create `repo_id` if needed and upload `folder`; returns the commit URL."""
    from huggingface_hub import HfApi

    from .conformance import check_checkpoint

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint folder (no config.json)")
    if "/" not in repo_id or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"--repo {repo_id!r}: expected a hub id of the form owner/name")
    if check:
        report = check_checkpoint(folder)
        if not report.ok:
            first = report.errors[0]
            raise ValueError(
                f"{folder} fails {len(report.errors)} conformance check(s), e.g. [{first.code}] "
                f"{first.tensor_or_key}: {first.message}; run `fp4kit verify {folder}`"
            )
    api = api or HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
                             commit_message=f"Upload {folder.name} (fp4kit)")
    return str(getattr(info, "commit_url", info))
