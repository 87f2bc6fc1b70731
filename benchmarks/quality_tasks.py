"""RULER-style synthetic long-context tasks for ``bench_quality.py``: prompts of an exact token length with the
answer placed where the prompt says, and the scoring of a generated answer.

The five tasks follow the categories of RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"): retrieval with one needle, with several keys, with several values; multi-hop
tracing (variable tracking); aggregation (common-word extraction). The wording, the haystack and the numbers are
this file's own:

* ``needle``: one registry note ("the item labelled KEY has the value V", V a 7-digit number) at a random depth;
  asked for KEY's value. Score 1 when V is in the answer.
* ``multikey``: four notes of four different keys, one asked for. Score 1 when the asked value is in the answer
  and none of the three distractor values is.
* ``multivalue``: four notes giving one key four different values; asked for all. Score: the share of the four
  values in the answer.
* ``vartrack``: two chains of five names each ("Let A be V." then "Let B be the same as A." ...), statements at
  random depths, each chain in its own order; asked which names equal the first chain's number. Score: the share
  of that chain's five names in the answer (names of the other chain cost nothing, as in RULER's recall).
* ``cwe``: a list of made-up words in which five words occur 30 times each and every other word 3 times (in a
  list too short for that, the five words take at most half of it and still occur more than any other), shuffled;
  asked for the five most frequent. Score: the share of the five in the answer.

The haystack of the first four tasks is neutral sentences made from a seeded vocabulary ("The quiet tailor
lingers at the old bridge."), never the demo's pass-key filler (``hf_sparse.tools.eval.PASSKEY_FILLER``), nor text of
the long-context adapter's training (installed packages' source code) nor the phrasings of its synthetic
retrieval sequences (``hf_sparse.tools.long_documents.RETRIEVAL_*``): it holds no digit and none of the key words. The
word list of ``cwe`` is made-up words of three syllables.

A prompt is instruction, haystack, question, as one user message of the tokenizer's chat template when it has
one (as ``hf_sparse.tools.eval.passkey_prompt`` builds the demo's), else plain text, and then the first words of the
answer (its cue: "The value of the item labelled KEY is"), as RULER's prompts end. Statements go
in at sentence boundaries (for ``cwe``, word boundaries) nearest their depth; the haystack is cut to make the
prompt exactly the requested length. Everything is drawn from ``random.Random`` seeded by strings of the seed,
the task and the instance index: the same instance has the same keys, values and depths at every length (the
haystack is longer), and every method answers the same prompts.
"""
from __future__ import annotations

import bisect
import random
import re
import string
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

# -- the haystack's vocabulary ------------------------------------------------------------------------------------

ADJECTIVES = ("quiet", "narrow", "wooden", "distant", "gentle", "crowded", "ancient", "modest", "hollow", "polished",
              "steady", "patient", "rusty", "tidy", "faded", "sturdy", "humble", "curious", "silent", "broad",
              "shallow", "dusty", "hidden", "simple", "busy", "careful", "weathered", "plain", "crooked", "little")
SUBJECTS = ("ferry", "cart", "tailor", "kettle", "ladder", "wagon", "clock", "bench", "tram", "postman", "gardener",
            "weaver", "carpenter", "shepherd", "fisherman", "miller", "potter", "baker", "librarian", "teacher",
            "courier", "traveller", "student", "sailor", "farmer", "painter", "musician", "lamp", "rowboat", "dog")
VERBS = ("rests beside", "waits near", "stands behind", "leans against", "passes by", "turns toward", "stays inside",
         "wanders through", "rolls past", "settles under", "lingers at", "returns to", "pauses by", "moves along",
         "sits across from", "drifts toward", "hurries past", "circles around")
PLACES = ("old bridge", "village square", "stone wall", "harbour", "orchard", "library", "train station",
          "market hall", "chapel", "meadow", "riverbank", "workshop", "courtyard", "hillside", "lighthouse",
          "schoolhouse", "post office", "town hall", "barn", "pond", "bakery", "ferry landing", "vineyard", "quarry")
TIMES = ("morning", "evening", "afternoon", "winter", "spring", "autumn", "summer", "week")
SENTENCE_FORMS = ("The {adjective} {subject} {verb} the {place}.",
                  "{a} {adjective} {subject} {verb} the {adjective2} {place}.",
                  "Every {time}, the {subject} {verb} the {place}.",
                  "Later, {a} {adjective} {subject} {verb} the {place}.")
#: Sentences in the haystack pool (each haystack draws from it with replacement).
SENTENCE_POOL = 16384

#: The two halves of a registry key ("cobalt-otter"): words the haystack never uses.
KEY_FIRST = ("amber", "cobalt", "crimson", "ivory", "jade", "scarlet", "violet", "copper", "silver", "onyx", "coral",
             "indigo", "maroon", "ochre", "teal", "saffron")
KEY_SECOND = ("falcon", "otter", "badger", "heron", "lynx", "walrus", "gecko", "ibis", "marmot", "panda", "tapir",
              "weasel", "yak", "zebra", "koala", "bison")

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"

# -- the tasks' wording ----------------------------------------------------------------------------------------------

REGISTRY_INSTRUCTION = ("A long text follows. Hidden in it are registry notes, each giving the value of a labelled "
                        "item. Read the whole text, then answer the question after it.")
REGISTRY_NOTE = "Registry note: the item labelled {key} has the value {value}."
REGISTRY_QUESTION = "What value does the registry give for the item labelled {key}? Answer with the value only."
REGISTRY_CUE = "The value of the item labelled {key} is"
REGISTRY_VALUES_QUESTION = ("The registry gives the item labelled {key} several values. What are they? List every "
                            "one of them.")
REGISTRY_VALUES_CUE = "The values of the item labelled {key} are:"
TRACKING_INSTRUCTION = ("A long text follows. Hidden in it are statements that give names a number, some of them "
                        "by referring to another name. Read the whole text, then answer the question after it.")
TRACKING_FIRST = "Let {name} be {value}."
TRACKING_NEXT = "Let {name} be the same as {previous}."
TRACKING_QUESTION = "Which names are equal to {value}, directly or through other names? List every such name."
TRACKING_CUE = "The names equal to {value} are:"
WORDS_INSTRUCTION = ("A long list of words follows. A few of the words are repeated far more often than the rest. "
                     "Read the whole list, then answer the question after it.")
WORDS_QUESTION = "Which {count} words occur most often in the list? Answer with those {count} words only."
WORDS_CUE = "The {count} words that occur most often are:"
_MARK = "<<hf_sparse task haystack>>"


@dataclass(frozen=True)
class Task:
    """One task of the suite: its name (the JSON's), its column title, the greedy tokens an answer gets."""

    name: str
    title: str
    answer_tokens: int


TASKS = {task.name: task for task in (Task("needle", "needle", 12), Task("multikey", "multi-key", 12),
                                      Task("multivalue", "multi-value", 40), Task("vartrack", "var. tracking", 30),
                                      Task("cwe", "common words", 30))}
NEEDLE_KEYS = 4  # keys of multikey (one asked, three distractors)
VALUES = 4  # values of multivalue
CHAINS, CHAIN_NAMES = 2, 5  # vartrack: chains, names per chain (four hops)
COMMON_WORDS, COMMON_COUNT, RARE_COUNT = 5, 30, 3  # cwe
COMMON_CHOICES = 1000  # cwe's common words are drawn from the first made-up words


@dataclass(frozen=True)
class TaskPrompt:
    """One instance of a task, as token ids of an exact length.

    Attributes:
        task, index: the task's name and the instance's number.
        input_ids: ``[1, length]`` token ids: instruction, haystack with the statements, question.
        haystack_start: index of the haystack's first token (the template's head and the instruction come before).
        context_length: tokens before the question (Star's context; the question and the template's tail are its
            query).
        answers: what a right answer names (values, names or words).
        distractors: values a right answer must not name (``multikey``), else empty.
        statements: ``(token index, text)`` of each statement placed in the haystack, in the prompt's order (for
            ``cwe``, each occurrence of a common word).
        question: the question's text.
        cue: the start of the answer the prompt ends with (the answer's first words, as RULER's prompts end).
    """

    task: str
    index: int
    input_ids: torch.Tensor
    haystack_start: int
    context_length: int
    answers: tuple[str, ...]
    distractors: tuple[str, ...]
    statements: tuple[tuple[int, str], ...]
    question: str
    cue: str


# -- scoring -------------------------------------------------------------------------------------------------------


def names_number(answer: str, number: str) -> bool:
    """Whether ``answer`` holds ``number`` as a whole run of digits ("1234567", not "112345678")."""
    return re.search(rf"(?<!\d){re.escape(number)}(?!\d)", answer) is not None


def names_word(answer: str, word: str) -> bool:
    """Whether ``answer`` holds ``word`` as a whole word, in any case."""
    return re.search(rf"(?<![A-Za-z]){re.escape(word)}(?![A-Za-z])", answer, re.IGNORECASE) is not None


def score(prompt: TaskPrompt, answer: str) -> float:
    """The answer's score in [0, 1] (the module docstring says each task's rule)."""
    if prompt.task in ("needle", "multikey"):
        right = names_number(answer, prompt.answers[0])
        return float(right and not any(names_number(answer, value) for value in prompt.distractors))
    found = names_number if prompt.task == "multivalue" else names_word
    return sum(found(answer, item) for item in prompt.answers) / len(prompt.answers)


# -- text ----------------------------------------------------------------------------------------------------------


def neutral_sentences(count: int, seed: int) -> list[str]:
    """``count`` haystack sentences from the seeded vocabulary (repeats possible)."""
    rng = random.Random(f"{seed}:sentences")
    sentences = []
    for _ in range(count):
        form = rng.choice(SENTENCE_FORMS)
        adjective, adjective2 = rng.sample(ADJECTIVES, 2)
        text = form.format(a="an" if adjective[0] in "aeiou" else "a", adjective=adjective, adjective2=adjective2,
                           subject=rng.choice(SUBJECTS), verb=rng.choice(VERBS), place=rng.choice(PLACES),
                           time=rng.choice(TIMES))
        sentences.append(text[0].upper() + text[1:])
    return sentences


def made_up_words(count: int, seed: int) -> list[str]:
    """``count`` distinct made-up words of three consonant-vowel syllables ("bralo" is two), in a seeded order."""
    syllables = [consonant + vowel for consonant in _CONSONANTS for vowel in _VOWELS]
    if count > len(syllables) ** 3:
        raise ValueError(f"at most {len(syllables) ** 3} made-up words, asked for {count}")
    rng = random.Random(f"{seed}:words")
    words: dict[str, None] = {}
    while len(words) < count:
        words["".join(rng.choice(syllables) for _ in range(3))] = None
    return list(words)


def registry_key(rng: random.Random) -> str:
    return f"{rng.choice(KEY_FIRST)}-{rng.choice(KEY_SECOND)}"


def tracking_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def _distinct(draw: Callable[[], str], count: int) -> list[str]:
    found: dict[str, None] = {}
    while len(found) < count:
        found[draw()] = None
    return list(found)


# -- prompts -------------------------------------------------------------------------------------------------------


class TaskSuite:
    """Builds the prompts of every task for one tokenizer and seed (its haystack pools tokenized once)."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tokenizer, self.seed = tokenizer, seed
        self.sentences = self._pieces(neutral_sentences(SENTENCE_POOL, seed))
        self._words: list[str] = []
        self._word_ids: list[list[int]] = []

    def _pieces(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text after a space: pieces that join as the texts would, space-separated."""
        return self.tokenizer([" " + text for text in texts], add_special_tokens=False).input_ids

    def words(self, count: int) -> tuple[list[str], list[list[int]]]:
        """The first ``count`` made-up words of this seed and their token ids (tokenized once, grown as needed)."""
        if count > len(self._words):
            self._words = made_up_words(max(count, 2 * len(self._words)), self.seed)
            self._word_ids = self._pieces(self._words)
        return self._words[:count], self._word_ids[:count]

    def prompt(self, task: str, length: int, index: int) -> TaskPrompt:
        """Instance ``index`` of ``task`` as a prompt of exactly ``length`` tokens."""
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
        rng = random.Random(f"{self.seed}:{task}:{index}")
        haystack_rng = random.Random(f"{self.seed}:{task}:{index}:haystack")
        return getattr(self, f"_{task}")(rng, haystack_rng, length, index)

    # Each task: what is asked, the statements and their depths, the haystack's pieces.

    def _needle(self, rng: random.Random, haystack: random.Random, length: int, index: int) -> TaskPrompt:
        key, value = registry_key(rng), str(rng.randint(10 ** 6, 10 ** 7 - 1))
        statements = [(rng.random(), REGISTRY_NOTE.format(key=key, value=value))]
        return self._assemble("needle", index, length, REGISTRY_INSTRUCTION, REGISTRY_QUESTION.format(key=key),
                              REGISTRY_CUE.format(key=key), statements, self._sentence_draw(haystack), (value,), ())

    def _multikey(self, rng: random.Random, haystack: random.Random, length: int, index: int) -> TaskPrompt:
        keys = _distinct(lambda: registry_key(rng), NEEDLE_KEYS)
        values = _distinct(lambda: str(rng.randint(10 ** 6, 10 ** 7 - 1)), NEEDLE_KEYS)
        statements = [(rng.random(), REGISTRY_NOTE.format(key=key, value=value)) for key, value in zip(keys, values)]
        return self._assemble("multikey", index, length, REGISTRY_INSTRUCTION, REGISTRY_QUESTION.format(key=keys[0]),
                              REGISTRY_CUE.format(key=keys[0]), statements, self._sentence_draw(haystack),
                              (values[0],), tuple(values[1:]))

    def _multivalue(self, rng: random.Random, haystack: random.Random, length: int, index: int) -> TaskPrompt:
        key = registry_key(rng)
        values = _distinct(lambda: str(rng.randint(10 ** 6, 10 ** 7 - 1)), VALUES)
        statements = [(rng.random(), REGISTRY_NOTE.format(key=key, value=value)) for value in values]
        return self._assemble("multivalue", index, length, REGISTRY_INSTRUCTION,
                              REGISTRY_VALUES_QUESTION.format(key=key), REGISTRY_VALUES_CUE.format(key=key),
                              statements, self._sentence_draw(haystack), tuple(values), ())

    def _vartrack(self, rng: random.Random, haystack: random.Random, length: int, index: int) -> TaskPrompt:
        names = _distinct(lambda: tracking_name(rng), CHAINS * CHAIN_NAMES)
        numbers = _distinct(lambda: str(rng.randint(10 ** 4, 10 ** 5 - 1)), CHAINS)
        statements = []
        for chain, number in enumerate(numbers):
            chain_names = names[chain * CHAIN_NAMES: (chain + 1) * CHAIN_NAMES]
            depths = sorted(rng.random() for _ in chain_names)  # a chain's statements in its order
            texts = [TRACKING_FIRST.format(name=chain_names[0], value=number)]
            texts += [TRACKING_NEXT.format(name=name, previous=previous)
                      for previous, name in zip(chain_names, chain_names[1:])]
            statements += list(zip(depths, texts))
        return self._assemble("vartrack", index, length, TRACKING_INSTRUCTION,
                              TRACKING_QUESTION.format(value=numbers[0]), TRACKING_CUE.format(value=numbers[0]),
                              statements, self._sentence_draw(haystack), tuple(names[:CHAIN_NAMES]), ())

    def _cwe(self, rng: random.Random, haystack: random.Random, length: int, index: int) -> TaskPrompt:
        """Made-up words: the common ones are statements (each occurrence at a random depth), the rare ones the
        haystack, each rare word ``RARE_COUNT`` times in a shuffled order."""
        question, cue = WORDS_QUESTION.format(count=COMMON_WORDS), WORDS_CUE.format(count=COMMON_WORDS)
        prefix, suffix = self._frame(WORDS_INSTRUCTION, question, cue)
        room = length - len(prefix) - len(suffix)  # the list's tokens
        words, word_ids = self.words(max(room // RARE_COUNT + COMMON_WORDS + 1, COMMON_CHOICES))  # enough rare ones
        common = rng.sample(range(COMMON_CHOICES), COMMON_WORDS)  # the same words at every length
        tokens_per_word = sum(len(ids) for ids in word_ids) / len(word_ids)
        # at most half the list, and more often than any rare word
        count = min(COMMON_COUNT, max(RARE_COUNT + 1, int(room / tokens_per_word / (2 * COMMON_WORDS))))
        statements = [(rng.random(), words[i]) for i in common for _ in range(count)]
        rare_words = [i for i in range(len(words)) if i not in common]
        haystack.shuffle(rare_words)
        groups = iter([word_ids[i]] * RARE_COUNT for i in rare_words)
        return self._assemble("cwe", index, length, WORDS_INSTRUCTION, question, cue, statements,
                              _shuffled_groups(groups, haystack), tuple(words[i] for i in common), ())

    def _sentence_draw(self, rng: random.Random) -> Callable[[int], list[list[int]]]:
        def take(tokens: int) -> list[list[int]]:
            pieces, total = [], 0
            while total < tokens:
                pieces.append(self.sentences[rng.randrange(len(self.sentences))])
                total += len(pieces[-1])
            return pieces
        return take

    def _frame(self, instruction: str, question: str, cue: str) -> tuple[list[int], list[int]]:
        """Token ids before the haystack (the template's head and the instruction) and after it (the question, the
        template's tail and the answer's ``cue``)."""
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None):
            message = instruction + "\n\n" + _MARK + "\n\n" + question
            text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                 add_generation_prompt=True) + cue
            special = False  # the template writes its own special tokens
        else:
            text, special = instruction + "\n\n" + _MARK + "\n\n" + question + "\n\n" + cue, True
        if text.count(_MARK) != 1:
            raise ValueError("the tokenizer's chat template does not keep the user message as written")
        before, after = text.split(_MARK)
        prefix = tokenizer(before, add_special_tokens=special).input_ids
        return prefix, tokenizer(after, add_special_tokens=False).input_ids

    def _assemble(self, task: str, index: int, length: int, instruction: str, question: str, cue: str,
                  statements: list[tuple[float, str]], haystack: Callable[[int], list[list[int]]],
                  answers: tuple[str, ...], distractors: tuple[str, ...]) -> TaskPrompt:
        """The prompt: ``statements`` ((depth, text)) placed at the piece boundaries of the haystack nearest their
        depths (ties in the given order), the haystack (``haystack(n)``: pieces of at least ``n`` tokens) cut so
        that the prompt has ``length`` tokens."""
        prefix, suffix = self._frame(instruction, question, cue)
        placed = sorted(enumerate(statements), key=lambda item: (item[1][0], item[0]))
        statement_ids = self._pieces([text for _, (_, text) in placed])
        room = length - len(prefix) - len(suffix) - sum(len(ids) for ids in statement_ids)
        if room < 1:
            raise ValueError(f"a {task} prompt of {length} tokens leaves no room for a haystack: instruction, "
                             f"statements and question take {length - room} tokens")
        pieces = haystack(room)
        starts, total = [], 0  # the token offset of each piece boundary within the cut haystack
        for piece in pieces:
            if total >= room:
                break
            starts.append(total)
            total += len(piece)
        starts.append(room)
        flat = [token for piece in pieces for token in piece][:room]
        ids, inserted, cursor = list(prefix), [], 0
        for (_, (depth, statement_text)), statement in zip(placed, statement_ids):
            after = min(bisect.bisect_left(starts, depth * room), len(starts) - 1)
            nearest = min(starts[max(after - 1, 0)], starts[after], key=lambda start: abs(start - depth * room))
            offset = max(nearest, cursor)  # statements keep their order
            ids += flat[cursor:offset]
            cursor = offset
            inserted.append((len(ids), statement_text))
            ids += statement
        ids += flat[cursor:]
        context_length = len(ids)
        ids += suffix
        if len(ids) != length:
            raise AssertionError(f"built {len(ids)} tokens, not {length}")
        return TaskPrompt(task, index, torch.tensor(ids, dtype=torch.long)[None], len(prefix), context_length, answers,
                          distractors, tuple(inserted), question, cue)


def _shuffled_groups(groups: Iterator[list[list[int]]], rng: random.Random) -> Callable[[int], list[list[int]]]:
    """``haystack(n)`` for ``TaskSuite._assemble``: the pieces of ``groups`` until ``n`` tokens, shuffled together
    (each rare word's copies spread over the list)."""
    def take(tokens: int) -> list[list[int]]:
        pieces, total = [], 0
        while total < tokens:
            group = next(groups)
            pieces += group
            total += sum(len(piece) for piece in group)
        rng.shuffle(pieces)
        return pieces
    return take
