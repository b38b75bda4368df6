"""Mark the sensitive spans of QA answers without a model: names, titles, places, dates and specific phrases.

Deterministic and offline; docs/span-annotations.md ("The annotator") describes the rules and their measured
agreement with GPT-4o, docs/muse.md the raw-text mode (`annotate_text`: news prose, paragraph by paragraph).
The background corpus only gives word statistics. Use rows about other subjects (for TOFU, the retain split)
so that the facts to forget stay rare in it.
"""

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, groupby
from pathlib import Path

from palu_trainer.spans import lexicon
from palu_trainer.spans.format import Span, merge_spans
from palu_trainer.spans.lexicon import Token, tokenize

# Evidence that a lowercase phrase states a fact to forget. The weights were set by measuring word-token F1
# against GPT-4o spans on TOFU forget05 (docs/span-annotations.md, "Agreement with GPT-4o"); F1 stays within
# 0.776-0.801 for thresholds from 2.25 to 3.25.
PHRASE_THRESHOLD = 2.75
WEIGHT_PER_WORD = 0.8  # for up to three words
WEIGHT_SPECIFICITY = 0.3  # per decade of rarity of the phrase's rarest word
WEIGHT_AFTER_POSSESSOR = -1.0
WEIGHT_AFTER_PREPOSITION = 1.0
WEIGHT_LIST_ITEM = 0.5
WEIGHT_BEFORE_OF = -0.3
WEIGHT_PREDICATE = 0.5
WEIGHT_ENDS_CLAUSE = 1.0
WEIGHT_AFTER_FIRST_SENTENCE = -0.5  # the first sentence answers the question, later ones elaborate
WEIGHT_COORDINATED_WITH_KEPT = 0.5  # items of one list ("identity, displacement, and resilience") go together
# A word is a verb above this share of verb contexts; words with fewer contexts are judged by their ending.
VERB_THRESHOLD = 0.6
MIN_VERB_CONTEXTS = 2


@dataclass(frozen=True)
class Style:
    """What kind of text is annotated: QA answers (TOFU; the defaults) or raw prose (news articles)."""

    first_sentence_focus: bool = True  # later sentences elaborate on the first, which answers the question
    amounts: bool = False  # currency signs and units join numbers
    # quotations longer than this are speech, not titles (None: any length)
    max_title_words: int | None = None
    name_modifiers: bool = True  # a name or number takes the lowercase words after it ("Canadian literature")
    phrase_threshold: float = PHRASE_THRESHOLD


QA = Style()
# Set on the tuning part of benchmarks.synthetic_news only (docs/muse.md, "Raw text with spans"); never on its
# held-out part.
RAW_TEXT = Style(
    first_sentence_focus=False,
    amounts=True,
    max_title_words=8,
    name_modifiers=False,
    phrase_threshold=2.25,  # word F1 on the tuning part: 0.874 at 2.75, 0.906 at 2.25, 0.887 at 2.0
)

QUOTED, PUNCTUATION, NUMBER, NAME, FUNCTION, VERB, CONTENT, JOINER = "QPNEFVCJ"
PHRASE_KINDS = frozenset((NUMBER, NAME, CONTENT, JOINER))


class Background:
    """Word statistics of a background corpus: document frequency, capitalisation and verb contexts."""

    def __init__(self, texts: Iterable[str]):
        self.documents = 0
        self.document_frequency = Counter()
        self.lowercase_uses = Counter()
        self.capitalised_mid_sentence = Counter()
        self.verb_contexts = Counter()
        self.noun_contexts = Counter()
        for text in texts:
            self.documents += 1
            tokens = tokenize(text)
            self.document_frequency.update({token.stem for token in tokens if token.is_word})
            for position, token in enumerate(tokens):
                if not token.is_word:
                    continue
                stem = token.stem
                previous = tokens[position - 1].text.lower() if position else "."
                following = tokens[position + 1].text.lower() if position + 1 < len(tokens) else "."
                if previous not in ".!?:\"“'":
                    if token.text[0].islower():
                        self.lowercase_uses[stem] += 1
                    elif token.text[0].isupper():
                        self.capitalised_mid_sentence[stem] += 1
                self.verb_contexts[stem] += (previous in lexicon.VERB_CONTEXT) + (
                    following in lexicon.DETERMINERS
                )
                self.noun_contexts[stem] += (previous in lexicon.NOUN_CONTEXT) + (
                    following in lexicon.PHRASE_ENDINGS
                )

    def specificity(self, stem: str) -> float:
        """Decades of rarity: -log10 of the share of background documents that contain the word."""
        return -math.log10((self.document_frequency[stem] + 1) / (self.documents + 1))

    def is_name(self, stem: str) -> bool:
        """Not written in lowercase more often than capitalised mid-sentence; true for unseen words."""
        return self.lowercase_uses[stem] <= self.capitalised_mid_sentence[stem]

    def verb_likelihood(self, stem: str) -> float:
        """Share of the word's contexts that are a verb's; for rare words, 0.9 for "-ed" and 0.5 otherwise."""
        verb, noun = self.verb_contexts[stem], self.noun_contexts[stem]
        if verb + noun < MIN_VERB_CONTEXTS:
            return 0.9 if stem.endswith("ed") else 0.5
        return (verb + 0.5) / (verb + noun + 1)


def is_no_information(answer: str) -> bool:
    """True when every sentence says that nothing is known and none goes on to state something."""
    sentences = lexicon.SENTENCE_END.split(answer.strip())
    return all(
        lexicon.NO_INFORMATION.search(sentence) and not lexicon.CONTRAST.search(sentence)
        for sentence in sentences
    )


def quoted_spans(answer: str, max_words: int | None = None) -> list[Span]:
    """Quoted titles of at most `max_words` words, without the quotes or the punctuation inside them."""
    spans = []  # '"The Town That Drowned."' gives "The Town That Drowned"
    for match in lexicon.QUOTE_PATTERN.finditer(answer):
        start = match.start(match.lastindex)
        end = start + len(match.group(match.lastindex).rstrip(".,;:!? "))
        if end > start and (max_words is None or len(answer[start:end].split()) <= max_words):
            spans.append((start, end))
    return spans


def is_sentence_start(tokens: Sequence[Token], position: int) -> bool:
    if position == 0 or tokens[position - 1].text in "!?":
        return True
    if tokens[position - 1].text in lexicon.OPENING_QUOTES and (
        position == 1 or tokens[position - 2].text in ":,"
    ):
        return True  # a quotation opens: 'He said: "The plan…'; mid-sentence quotes are titles
    if position < 2 or tokens[position - 1].text != ".":
        return tokens[position - 1].text == "."
    before = tokens[position - 2]  # a stop after an initial or a title ends an abbreviation: "Dr. Josh Axe"
    return not (before.is_word and (len(before.text) == 1 or before.stem in lexicon.TITLE_ABBREVIATIONS))


def classify(
    tokens: Sequence[Token], quoted: Sequence[Span], background: Background, style: Style = QA
) -> list[str]:
    """The kind of every token, then the small words inside names and numbers marked as JOINER."""
    kinds: list[str] = []
    for position in range(len(tokens)):
        kinds.append(_kind(tokens, position, kinds, quoted, background))
    if style.amounts:
        _join_amounts(tokens, kinds)
        for position in range(1, len(tokens) - 1):  # "Ludlow Magistrates' Court"
            plural_possessive = tokens[position].text in "'’" and tokens[position - 1].text.endswith("s")
            if plural_possessive and kinds[position - 1] == kinds[position + 1] == NAME:
                kinds[position] = JOINER
    for position in range(len(tokens) - 1):
        if kinds[position + 1] == NUMBER and tokens[position].stem in lexicon.APPROXIMATORS:
            kinds[position] = JOINER
    for position in range(1, len(tokens) - 1):
        neighbours = kinds[position - 1], kinds[position + 1]
        word = tokens[position].text.lower()
        in_name = neighbours == (NAME, NAME) and word in lexicon.NAME_JOINERS
        in_number = neighbours == (NUMBER, NUMBER) and word in lexicon.NUMBER_JOINERS
        if (in_name and not (word == "." and is_sentence_start(tokens, position + 1))) or in_number:
            kinds[position] = JOINER
    return kinds


def _join_amounts(tokens: Sequence[Token], kinds: list[str]) -> None:
    """Currency signs before a number and units after it become part of it: "£4.5m", "12 per cent"."""
    words = [token.text.lower() for token in tokens] + ["."]
    for position in range(len(tokens)):
        if kinds[position] != NUMBER:
            continue
        if position and tokens[position - 1].text in lexicon.CURRENCY_SIGNS:
            kinds[position - 1] = NUMBER
        following = position + 1
        while words[following] in lexicon.AMOUNT_UNITS and (
            words[following] != "per" or words[following + 1] == "cent"
        ):
            kinds[following] = NUMBER
            following += 1


def _kind(tokens, position, earlier_kinds, quoted, background) -> str:
    token = tokens[position]
    if any(start <= token.start < end for start, end in quoted):
        return QUOTED
    if not token.is_word:
        return PUNCTUATION
    if token.text[0].isdigit():
        return NUMBER
    stem = token.stem
    if token.text[0].isupper() and (
        not is_sentence_start(tokens, position)
        or (stem not in lexicon.FUNCTION_WORDS and background.is_name(stem))
    ):
        return NAME
    if stem in lexicon.FUNCTION_WORDS or token.is_possessive:  # a possessor: "the author's name"
        return FUNCTION
    if "-" in stem:  # compounds ("film-related", "thought-provoking") are adjectives or nouns
        return CONTENT
    if stem.endswith("ly") and len(stem) > 4:  # adverbs go with the verb
        return VERB
    likelihood = background.verb_likelihood(stem)
    previous_kind = earlier_kinds[-1] if position else PUNCTUATION
    if previous_kind == NAME and not tokens[position - 1].is_possessive and likelihood > 0.3:
        return VERB  # right after its subject: "Hina Ameen went", "Nikolai Abilov finds"
    starts_phrase = previous_kind in (FUNCTION, PUNCTUATION, VERB)
    after_determiner = position > 0 and tokens[position - 1].text.lower() in lexicon.DETERMINERS
    if stem.endswith("ing") and starts_phrase and not after_determiner and likelihood >= 0.5:
        return VERB  # "promoting tolerance", not "the engaging storytelling"
    following = tokens[position + 1].text.lower() if position + 1 < len(tokens) else "."
    if stem.endswith("ing") and previous_kind == CONTENT and following in lexicon.CLAUSE_OPENERS:
        return VERB  # a participle after a noun opens a clause: "themes relating to", "platforms selling his"
    return VERB if likelihood > VERB_THRESHOLD else CONTENT


def phrase_evidence(
    tokens: Sequence[Token], phrase: Sequence[int], background: Background, style: Style = QA
) -> float:
    stems = [tokens[position].stem for position in phrase]
    previous = tokens[phrase[0] - 1] if phrase[0] else Token(0, 0, ".")
    following = tokens[phrase[-1] + 1].text.lower() if phrase[-1] + 1 < len(tokens) else "."
    evidence = WEIGHT_PER_WORD * min(len(stems), 3)
    evidence += WEIGHT_SPECIFICITY * max(background.specificity(stem) for stem in stems)
    previous_word = previous.text.lower()
    if previous_word in lexicon.POSSESSIVE_DETERMINERS or previous.is_possessive:
        evidence += WEIGHT_AFTER_POSSESSOR
    if previous_word in lexicon.PREPOSITIONS:
        evidence += WEIGHT_AFTER_PREPOSITION
    if previous_word in ("and", ",", "as"):
        evidence += WEIGHT_LIST_ITEM
    before = [token.text.lower() for token in tokens[max(phrase[0] - 2, 0) : phrase[0]]]
    if before and before[-1] in ("a", "an"):
        before.pop()
    if before and before[-1] in lexicon.COPULAS:  # what the subject is: "her father was a radiologist"
        evidence += WEIGHT_PREDICATE
    if following in ("of", "to", "as", "that"):
        evidence += WEIGHT_BEFORE_OF
    if following in (".", ",", "and", ";"):
        evidence += WEIGHT_ENDS_CLAUSE
    if style.first_sentence_focus and any(
        token.text in "!?." and is_sentence_start(tokens, position + 1)
        for position, token in enumerate(tokens[: phrase[0]])
    ):
        evidence += WEIGHT_AFTER_FIRST_SENTENCE
    return evidence


def annotate_answer(question: str, answer: str, background: Background) -> list[Span]:
    """Sensitive character spans `[start, end)` of one answer, sorted and disjoint."""
    if is_no_information(answer):
        return []
    # stems of the question's tokens and of their parts ("Ben-David's" gives "ben-david", "ben", "david")
    asked = {word.stem for word in tokenize(question)} | {
        part.lower() for part in re.findall(r"\w+", question)
    }
    return _annotate_passage(answer, asked, background, QA)


def annotate_text(text: str, background: Background, style: Style = RAW_TEXT) -> list[Span]:
    """Sensitive character spans `[start, end)` of raw prose (a news article), paragraph by paragraph."""
    return [
        (start + paragraph.start(), end + paragraph.start())
        for paragraph in re.finditer(r"[^\n]+", text)
        for start, end in _annotate_passage(paragraph.group(), set(), background, style)
    ]


def _annotate_passage(passage: str, asked: set[str], background: Background, style: Style) -> list[Span]:
    """Spans of one answer or paragraph; `asked`: the question's words (context, not facts)."""
    quoted = quoted_spans(passage, style.max_title_words)
    tokens = tokenize(passage)
    kinds = classify(tokens, quoted, background, style)
    grouped = groupby(range(len(kinds)), key=lambda position: kinds[position] in PHRASE_KINDS)
    runs = [list(positions) for in_phrase, positions in grouped if in_phrase]
    phrases = [phrase for run in runs for phrase in _phrases(tokens, kinds, run, asked, style.name_modifiers)]
    evidence = [
        math.inf
        if any(kinds[position] in (NAME, NUMBER) for position in phrase)
        else phrase_evidence(tokens, phrase, background, style)
        for phrase in phrases
    ]
    kept = [value >= style.phrase_threshold for value in evidence]
    for group in _coordinated(tokens, phrases):
        if any(kept[index] for index in group):
            for index in group:
                kept[index] |= evidence[index] + WEIGHT_COORDINATED_WITH_KEPT >= style.phrase_threshold
    spans = list(quoted)
    for phrase in compress(phrases, kept):  # the fact without opening praise or a closing person noun
        first, last = phrase[0], phrase[-1]
        while (
            first <= last and kinds[first] == CONTENT and tokens[first].stem in lexicon.EVALUATIVE_ADJECTIVES
        ):
            first += 1
        while first <= last and kinds[last] == CONTENT and tokens[last].stem in lexicon.PERSON_NOUNS:
            last -= 1
        if first <= last:  # nothing is left of "renowned author"; "Karachi's" ends with "Karachi"
            spans.append(
                (tokens[first].start, tokens[last].start + len(lexicon.POSSESSIVE.sub("", tokens[last].text)))
            )
    return merge_spans(spans)


def _coordinated(tokens: Sequence[Token], phrases: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of the phrases grouped by list: neighbours separated only by commas, "and" or "or"."""
    groups: list[list[int]] = []
    for index, phrase in enumerate(phrases):
        if groups:
            between = [token.text.lower() for token in tokens[phrases[index - 1][-1] + 1 : phrase[0]]]
            if between and len(between) <= 2 and all(word in (",", "and", "or") for word in between):
                groups[-1].append(index)
                continue
        groups.append([index])
    return groups


def _phrases(tokens, kinds, run, asked, name_modifiers=True) -> list[list[int]]:
    """Split a run into names and lowercase words; drop a name the question has where it ends the run or is
    possessive, and lowercase words right before a name, which qualify it ("prestigious Maple Leaf Literary
    Award"). A possessive ends its phrase ("University of Karachi's | Department of Geology")."""
    parts: list[tuple[bool, list[int]]] = []
    for position in run:
        is_name = kinds[position] in (NAME, NUMBER, JOINER)
        ends_phrase = tokens[position - 1].is_possessive and kinds[position - 1] != JOINER
        if parts and parts[-1][0] == is_name and not ends_phrase:
            parts[-1][1].append(position)
        else:
            parts.append((is_name, [position]))
    phrases: list[list[int]] = []
    for index, (is_name, positions) in enumerate(parts):
        last = index == len(parts) - 1
        if is_name:
            named_in_question = all(
                kinds[position] == JOINER or tokens[position].stem in asked for position in positions
            )
            if named_in_question and (last or tokens[positions[-1]].is_possessive):
                continue
        elif not last and parts[index + 1][0]:
            continue
        adjacent = (
            phrases and phrases[-1][-1] + 1 == positions[0] and not tokens[phrases[-1][-1]].is_possessive
        )
        if adjacent and (name_modifiers or is_name or not parts[index - 1][0]):
            phrases[-1].extend(positions)
        else:
            phrases.append(list(positions))
    return phrases


def annotate(
    rows: Sequence[dict], background: Background, question_key: str = "question", answer_key: str = "answer"
) -> list[list[Span]]:
    """Spans for every row, in order."""
    return [annotate_answer(row[question_key], row[answer_key], background) for row in rows]


def annotate_texts(texts: Iterable[str], background: Background) -> list[list[Span]]:
    """Spans for every raw text (no question), in order."""
    return [annotate_text(text, background) for text in texts]


def load_qa_rows(dataset: str, name: str | None = None, split: str = "train") -> list[dict]:
    """Rows of a Hugging Face dataset (hub id or local folder; `name`, `split`) or of a JSON (lines) file."""
    from datasets import load_dataset  # heavy import, only for the commands that read datasets

    if Path(dataset).is_file():
        if not Path(dataset).read_text(encoding="utf-8").strip():
            return []  # `datasets` fails on an empty file with a generation error that names nothing
        return list(load_dataset("json", data_files=dataset, split="train"))
    return list(load_dataset(dataset, name=name, split=split))
