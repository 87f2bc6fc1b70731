"""Text for the tools: files read, tokenised into one stream and packed into equal sequences."""
from __future__ import annotations

import glob
import os
from typing import Any, Iterable, Sequence

import torch

_TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")


# -- data -----------------------------------------------------------------------------------------------------
def read_text_files(patterns: Sequence[str]) -> list[str]:
    """Contents of the files named by ``patterns`` (paths, globs with ``**``, or folders: their .txt/.md/.rst/.py
    files), in sorted path order, each file once."""
    paths: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            matches = [p for p in glob.glob(os.path.join(pattern, "**", "*"), recursive=True)
                       if p.endswith(_TEXT_SUFFIXES) and os.path.isfile(p)]
        else:
            matches = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
        if not matches:
            raise FileNotFoundError(f"no files match {pattern!r}")
        paths.extend(sorted(matches))
    texts, seen = [], set()
    for path in paths:
        if path in seen:
            continue
        seen.add(path)
        with open(path, encoding="utf-8", errors="replace") as handle:
            texts.append(handle.read())
    return texts


def token_stream(texts: Iterable[str], tokenizer: Any, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of ``texts`` joined by the tokenizer's EOS token (1-D int64), stopping after ``max_tokens``."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        ids.extend(separator)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens] if max_tokens is not None else ids, dtype=torch.long)


def pack_sequences(tokens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """Cut a 1-D token stream into ``[num_sequences, seq_length]`` (the incomplete tail is dropped)."""
    count = tokens.numel() // seq_length
    if count == 0:
        raise ValueError(f"{tokens.numel()} tokens are fewer than one sequence of {seq_length}")
    return tokens[: count * seq_length].view(count, seq_length).clone()
