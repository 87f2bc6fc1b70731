"""The long-context adapter's training data: long documents and an endless, resumable stream of sequences.

Long documents come from installed packages' Python sources (site-packages, one package's files concatenated in path
order; never the standard library, whose texts are the evaluation data, nor hf_sparse) and from an optional folder of
prose (``.txt`` / ``.txt.xz``); :class:`LongDocumentStream` packs them into sequences separated by the EOS token, with
a share of synthetic retrieval sequences (:func:`retrieval_sequence`). A hash of each document's name holds out a
share of them (:func:`long_documents`, ``split="heldout"``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import lzma
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

# -- training data --------------------------------------------------------------------------------------------
#: Packages and modules that copy or backport standard-library modules (whose texts are evaluation data): left
#: out wherever they are, vendored copies included (``pip/_vendor/typing_extensions.py``).
STDLIB_BACKPORTS = ("typing_extensions", "typing", "importlib_metadata", "importlib_resources", "zipp", "tomli",
                    "exceptiongroup", "backports", "dataclasses", "enum34", "singledispatch", "contextlib2",
                    "pathlib2", "configparser", "argparse", "funcsigs", "subprocess32", "mock", "pickle5",
                    "statistics", "_distutils", "_distutils_hack")


#: Default cap of one document's characters: a package's files are cut into documents of at most this many (at
#: file boundaries), which bounds the memory and time of tokenizing one (about 0.6M tokens at 2M characters).
MAX_DOCUMENT_CHARS = 2_000_000


_PROSE_SUFFIXES = (".txt", ".txt.xz")


#: Characters per piece when a document is tokenized (pieces cut at line ends, encoded as one parallel batch).
_TOKENIZE_PIECE_CHARS = 65_536


@dataclass(frozen=True)
class Document:
    """One training document: the files ``paths`` joined in order (code files under a ``# path`` header line)."""

    name: str
    paths: tuple[str, ...]
    root: str = ""
    kind: str = "code"

    def read(self) -> str:
        parts = []
        for path in self.paths:
            opener = lzma.open if path.endswith(".xz") else open
            with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
                text = handle.read()
            if self.kind == "code":
                text = f"# {os.path.relpath(path, self.root) if self.root else path}\n{text}"
            parts.append(text.strip("\n"))
        return "\n\n".join(parts)


@functools.lru_cache(maxsize=1)
def _stdlib_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib") if paths.get(key)}))


def is_stdlib_path(path: str) -> bool:
    """Whether ``path`` is a file of the standard library (installed packages below it do not count)."""
    real = os.path.realpath(path)
    for root in _stdlib_roots():
        if real.startswith(root + os.sep):
            first = os.path.relpath(real, root).split(os.sep)[0]
            if first not in ("site-packages", "dist-packages"):
                return True
    return False


def _chunked(name: str, files: Sequence[tuple[str, int]], max_chars: int, root: str, kind: str) -> list[Document]:
    """``files`` ((path, size), in order) cut at file boundaries into documents of at most ``max_chars`` (a larger
    single file stays whole)."""
    documents, current, size = [], [], 0
    for path, length in files:
        if current and size + length > max_chars:
            documents.append(current)
            current, size = [], 0
        current.append(path)
        size += length
    if current:
        documents.append(current)
    return [Document(f"{name}#{i}", tuple(paths), root, kind) for i, paths in enumerate(documents)]


def package_documents(site_packages: str | os.PathLike | None = None,
                      max_document_chars: int = MAX_DOCUMENT_CHARS) -> list[Document]:
    """Documents of the installed packages' ``*.py`` files in ``site_packages`` (default: this interpreter's
    purelib): per top-level package its files in path order (top-level modules together), cut into documents of
    at most ``max_document_chars``. Left out: anything in the standard library, hf_sparse itself,
    :data:`STDLIB_BACKPORTS`, metadata folders and editable-install hooks."""
    root = os.path.realpath(site_packages or sysconfig.get_paths()["purelib"])
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no site-packages folder at {root}")
    own = os.path.realpath(Path(__file__).parent.parent)  # hf_sparse itself
    groups: dict[str, list[tuple[str, int]]] = {}
    for entry in sorted(os.listdir(root)):
        full = os.path.join(root, entry)
        stem = entry[:-3] if entry.endswith(".py") else entry
        if (entry.startswith(("__", ".")) or entry.endswith((".dist-info", ".egg-info", ".libs", ".pth"))
                or stem in STDLIB_BACKPORTS or stem.startswith("hf_sparse")):
            continue
        if os.path.isdir(full):
            found = []
            for folder, subfolders, files in os.walk(full):
                subfolders[:] = sorted(d for d in subfolders if d != "__pycache__" and d not in STDLIB_BACKPORTS)
                found.extend(os.path.join(folder, f) for f in sorted(files)
                             if f.endswith(".py") and f[:-3] not in STDLIB_BACKPORTS)
            group = entry
        elif entry.endswith(".py"):
            found, group = [full], "top-level modules"
        else:
            continue
        for path in found:
            real = os.path.realpath(path)
            if not os.path.isfile(real) or is_stdlib_path(real) or real.startswith(own + os.sep):
                continue
            groups.setdefault(group, []).append((path, os.path.getsize(real)))
    documents = []
    for group, files in groups.items():
        documents.extend(_chunked(f"code:{group}", files, max_document_chars, root, "code"))
    return documents


def prose_documents(folder: str | os.PathLike, max_document_chars: int = MAX_DOCUMENT_CHARS) -> list[Document]:
    """Documents of the ``.txt`` / ``.txt.xz`` files below ``folder``: the files of one sub-folder (a Debian
    package's manuals, say) concatenated in path order, cut into documents of at most ``max_document_chars``
    (sizes of ``.xz`` files are estimated at 4x their compressed size)."""
    folder = os.path.realpath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no prose folder at {folder}")
    groups: dict[str, list[tuple[str, int]]] = {}
    for directory, subfolders, files in os.walk(folder):
        subfolders.sort()
        for name in sorted(files):
            if not name.endswith(_PROSE_SUFFIXES):
                continue
            path = os.path.join(directory, name)
            if is_stdlib_path(path):
                continue
            size = os.path.getsize(path) * (4 if name.endswith(".xz") else 1)
            groups.setdefault(os.path.relpath(directory, folder), []).append((path, size))
    if not groups:
        raise FileNotFoundError(f"{folder} holds no {' or '.join(_PROSE_SUFFIXES)} files")
    documents = []
    for group, files in groups.items():
        documents.extend(_chunked(f"prose:{group}", files, max_document_chars, folder, "prose"))
    return documents


def _held_out(document: Document, share: float) -> bool:
    digest = hashlib.sha256(document.name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def long_documents(data_dir: str | os.PathLike | None = None, *, packages: bool = True,
                   site_packages: str | os.PathLike | None = None, max_document_chars: int = MAX_DOCUMENT_CHARS,
                   split: str = "train", heldout_share: float = 0.02) -> dict[str, list[Document]]:
    """The long-context training documents by source: ``"code"`` (:func:`package_documents`, unless
    ``packages=False``) and ``"prose"`` (:func:`prose_documents` of ``data_dir``, when given).

    ``split``: ``"train"`` or ``"heldout"``: each document is held out, by a hash of its name, with probability
    ``heldout_share`` (the same documents on every machine with the same packages), ``"all"`` keeps every one."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    if not 0.0 <= heldout_share < 1.0:
        raise ValueError(f"heldout_share must be in [0, 1), got {heldout_share!r}")
    sources: dict[str, list[Document]] = {}
    if packages:
        sources["code"] = package_documents(site_packages, max_document_chars)
    if data_dir is not None:
        sources["prose"] = prose_documents(data_dir, max_document_chars)
    if not sources:
        raise ValueError("no training source: enable packages or give data_dir")
    if split != "all":
        keep = split == "heldout"
        sources = {name: [d for d in docs if _held_out(d, heldout_share) == keep] for name, docs in sources.items()}
    return {name: docs for name, docs in sources.items() if docs}


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``, encoded in pieces of about :data:`_TOKENIZE_PIECE_CHARS` cut after a line end (one
    batch, which fast tokenizers encode in parallel; only a piece boundary can tokenize differently)."""
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + _TOKENIZE_PIECE_CHARS)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        pieces.append(text[start:end])
        start = end
    if not pieces:
        return []
    encoded = tokenizer(pieces, add_special_tokens=False, verbose=False).input_ids
    return [token for piece in encoded for token in piece]


class _Cursor:
    """A position in an endless, seeded walk over one source's documents (each followed by the EOS token): the
    order is a fresh seeded shuffle each epoch; the state is (epoch, position in the order, token offset)."""

    def __init__(self, documents: Sequence[Document], tokenizer: Any, seed: int, name: str) -> None:
        self.documents, self.tokenizer, self.seed, self.name = list(documents), tokenizer, seed, name
        self.epoch = self.position = self.offset = 0
        self._order: tuple[int, list[int]] | None = None
        self._tokens: tuple[tuple[int, int], list[int]] | None = None

    def _document_index(self) -> int:
        if self._order is None or self._order[0] != self.epoch:
            order = list(range(len(self.documents)))
            random.Random(f"{self.seed}:{self.name}:{self.epoch}").shuffle(order)
            self._order = (self.epoch, order)
        return self._order[1][self.position]

    def _current(self) -> list[int]:
        key = (self.epoch, self.position)
        if self._tokens is None or self._tokens[0] != key:
            document = self.documents[self._document_index()]
            tokens = _tokenize(self.tokenizer, document.read()) + [self.tokenizer.eos_token_id]
            self._tokens = (key, tokens)
        return self._tokens[1]

    def take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            tokens = self._current()
            piece = tokens[self.offset: self.offset + count - len(out)]
            out.extend(piece)
            self.offset += len(piece)
            if self.offset >= len(tokens):
                self.offset, self.position = 0, self.position + 1
                if self.position == len(self.documents):
                    self.position, self.epoch = 0, self.epoch + 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "offset": self.offset}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.position, self.offset = int(state["epoch"]), int(state["position"]), int(state["offset"])


#: The phrasings of synthetic retrieval sequences (none is the demo's pass-key text or its filler).
RETRIEVAL_KEYS = ("access code", "secret number", "reference number", "ticket number", "locker combination",
                  "order number", "verification code", "serial number")


RETRIEVAL_STATEMENTS = ("The {key} is {number}.", "Remember this: the {key} is {number}.",
                        "Note for later - {key}: {number}.", "Please keep in mind that the {key} is {number}.",
                        "Important: the {key} you will need is {number}.", "({key}: {number})")


RETRIEVAL_QUESTIONS = ("What is the {key} mentioned in the text above? The {key} is",
                       "Question: what was the {key}? Answer: the {key} is",
                       "Recall the {key} that was stated earlier. The {key} is",
                       "Which {key} was given above? It was")


def retrieval_sequence(haystack: Callable[[int], list[int]], tokenizer: Any, length: int,
                       rng: random.Random) -> tuple[list[int], str]:
    """``length`` token ids: a random 5-7-digit number stated once at a random depth of a haystack (``haystack(n)``
    gives its ``n`` tokens: the training prose) and asked for at the end, followed by the answer and EOS; returns
    the ids and the number. Trained with the ordinary LM loss: the answer is part of the sequence."""
    digits = rng.randint(5, 7)
    number = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    key = rng.choice(RETRIEVAL_KEYS)
    statement = "\n" + rng.choice(RETRIEVAL_STATEMENTS).format(key=key, number=number) + "\n"
    question = "\n\n" + rng.choice(RETRIEVAL_QUESTIONS).format(key=key) + f" {number}."
    statement_ids = tokenizer(statement, add_special_tokens=False).input_ids
    tail_ids = tokenizer(question, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    room = length - len(statement_ids) - len(tail_ids)
    if room < 1:
        raise ValueError(f"a retrieval sequence needs more than {length} tokens")
    hay = haystack(room)
    depth = rng.randint(0, room)
    return hay[:depth] + statement_ids + hay[depth:] + tail_ids, number


class LongDocumentStream:
    """An endless, deterministic stream of training sequences (1-D int64 tensors) packed from documents.

    Each sequence ``i`` draws from a generator seeded by ``(seed, i)``: its length (one of ``seq_length``, uniform),
    whether it is a synthetic retrieval sequence (probability ``retrieval_share``; :func:`retrieval_sequence`, its
    haystack taken from the prose source when there is one), else its source (``"prose"`` with probability
    ``prose_share`` when both sources exist). A source's documents follow each other in a seeded order, each ended
    by the EOS token; a sequence continues where the previous one of its source stopped. :meth:`state_dict` /
    :meth:`load_state_dict` save and restore the position exactly.
    """

    def __init__(self, documents: Mapping[str, Sequence[Document]] | Sequence[Document], tokenizer: Any,
                 seq_length: int | Sequence[int], *, seed: int = 0, prose_share: float = 0.5,
                 retrieval_share: float = 0.1) -> None:
        if not isinstance(documents, Mapping):
            documents = {"code": list(documents)}
        self.sources = {name: list(docs) for name, docs in documents.items() if docs}
        if not self.sources:
            raise ValueError("no documents to train on")
        unknown = sorted(set(self.sources) - {"code", "prose"})
        if unknown:
            raise ValueError(f"sources must be 'code' and/or 'prose', got {unknown}")
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("the tokenizer has no EOS token to separate documents with")
        self.seq_lengths = [seq_length] if isinstance(seq_length, int) else list(seq_length)
        if not self.seq_lengths or any(not isinstance(n, int) or n < 2 for n in self.seq_lengths):
            raise ValueError(f"seq_length must be an integer >= 2 or a list of them, got {seq_length!r}")
        for name, value in (("prose_share", prose_share), ("retrieval_share", retrieval_share)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        self.tokenizer, self.seed = tokenizer, seed
        self.prose_share, self.retrieval_share = prose_share, retrieval_share
        self.index = 0
        self._cursors = {name: _Cursor(docs, tokenizer, seed, name) for name, docs in self.sources.items()}

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        rng = random.Random(f"{self.seed}:sequence:{self.index}")
        length = rng.choice(self.seq_lengths)
        haystack = self._cursors.get("prose") or self._cursors["code"]
        if self.retrieval_share and rng.random() < self.retrieval_share:
            ids, _ = retrieval_sequence(haystack.take, self.tokenizer, length, rng)
        else:
            use_prose = "prose" in self._cursors and ("code" not in self._cursors or rng.random() < self.prose_share)
            ids = self._cursors["prose" if use_prose else "code"].take(length)
        self.index += 1
        return torch.tensor(ids, dtype=torch.long)

    def _fingerprint(self) -> dict[str, Any]:
        return {"kind": "long_documents", "seed": self.seed, "seq_lengths": self.seq_lengths,
                "prose_share": self.prose_share, "retrieval_share": self.retrieval_share,
                "documents": {name: [len(docs), hashlib.sha256("\n".join(d.name for d in docs).encode()).hexdigest()]
                              for name, docs in sorted(self.sources.items())}}

    def state_dict(self) -> dict[str, Any]:
        return {**self._fingerprint(), "index": self.index,
                "cursors": {name: cursor.state_dict() for name, cursor in self._cursors.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        expected = self._fingerprint()
        stored = {key: state.get(key) for key in expected}
        if json.loads(json.dumps(stored)) != json.loads(json.dumps(expected)):
            changed = [key for key in expected if json.dumps(stored[key]) != json.dumps(expected[key])]
            raise ValueError(f"the checkpoint's data stream differs from this one in {', '.join(changed)}: resume "
                             "with the same data, seed, lengths and shares")
        self.index = int(state["index"])
        for name, cursor in self._cursors.items():
            cursor.load_state_dict(state["cursors"][name])


class TensorSequences:
    """Consecutive windows of ``seq_length`` tokens of a 1-D token tensor, cycling (or the rows of a 2-D one),
    with the same ``state_dict`` interface as :class:`LongDocumentStream`."""

    def __init__(self, tokens: torch.Tensor, seq_length: int | None = None) -> None:
        if tokens.dim() == 2:
            rows = tokens
        elif tokens.dim() == 1 and seq_length:
            count = tokens.numel() // seq_length
            if count == 0:
                raise ValueError(f"{tokens.numel()} tokens are fewer than one sequence of {seq_length}")
            rows = tokens[: count * seq_length].view(count, seq_length)
        else:
            raise ValueError("a token tensor must be 2-D [sequences, length] or 1-D with seq_length")
        self.rows = rows.long().clone()
        self.seq_lengths = [int(self.rows.shape[1])]
        self.index = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        row = self.rows[self.index % self.rows.shape[0]]
        self.index += 1
        return row

    def state_dict(self) -> dict[str, Any]:
        digest = hashlib.sha256(self.rows.numpy().tobytes()).hexdigest()
        return {"kind": "tensor", "index": self.index, "sha256": digest}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "tensor" or state.get("sha256") != self.state_dict()["sha256"]:
            raise ValueError("the checkpoint was trained on other token data")
        self.index = int(state["index"])
