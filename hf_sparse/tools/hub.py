"""Publishing PLAS gates on the Hugging Face Hub (loading them is the runtime's: :func:`hf_sparse.load_gates`)."""
from __future__ import annotations

import tempfile
from typing import Any

import torch
from huggingface_hub import HfApi

from ..distributed import tensor_parallel_rank_and_size
from ..gate_files import GATE_FILENAME, save_gates


def push_gates_to_hub(
    model: torch.nn.Module,
    repo_id: str,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    private: bool | None = None,
    commit_message: str | None = None,
    create_repo: bool = True,
    filename: str = GATE_FILENAME,
) -> Any:
    """Upload the attached gates as ``filename`` to Hub repo ``repo_id`` (created if missing, unless
    ``create_repo=False``); returns huggingface_hub's ``CommitInfo``."""

    _, tp_size = tensor_parallel_rank_and_size(model)
    if tp_size > 1:
        raise ValueError(f"push_gates_to_hub on a model split by tensor parallelism (tp_size {tp_size}): each rank "
                         f"holds some of the KV heads. Call hf_sparse.save_gates(model, folder) on every rank (it "
                         f"gathers them), then upload folder/{filename} from one process")
    api = HfApi(token=token)
    if create_repo:
        api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hf_sparse_gates-") as folder:
        path = save_gates(model, folder, filename)
        return api.upload_file(
            path_or_fileobj=str(path), path_in_repo=filename, repo_id=repo_id, revision=revision,
            commit_message=commit_message or "Upload PLAS gate weights",
        )
