"""The annotator's English: how text splits into tokens (`tokenize`), the closed word classes (function words,
determiners, prepositions, joiners inside names and numbers, units, titles) and the sentence patterns that
carry no information, which `annotator`'s rules read."""

import re
from dataclasses import dataclass

TOKEN_PATTERN = re.compile(r"\w+(?:\.\w+)+\.?|\w+(?:['’&+-]\w+)*\+?|\S")
QUOTE_PATTERN = re.compile(r'"([^"]+)"|“([^”]+)”|(?<!\w)[\'‘]([^\n]+?)[\'’](?!\w)')
# "Karachi's"; the apostrophe of "Williams' books" is a token of its own and marks a possessor too.
POSSESSIVE_ENDINGS = ("'s", "’s", "'", "’")
POSSESSIVE = re.compile(r"['’]s?$")
FUNCTION_WORDS = frozenset(
    """a an the and or but nor of in on at to for from by with about into onto over under as than then so such
    that this these those which who whom whose what when where why how there here it its he she they them his
    her hers their theirs him i we you our your my me us one ones is are was were be been being am has have
    had having do does did will would can could may might shall should must not no yes also often very too
    just only even both either neither each every all any some many much more most several various other
    another own same up out off while although though because since if whether until unless upon within
    without through throughout despite due during before after between among across against toward towards
    via per s thereby thus hence however therefore two three four five six seven eight nine ten first second
    third specific exact particular certain""".split()
)
POSSESSIVE_DETERMINERS = frozenset("his her their its my our your".split())
# Praise and intensity qualify a fact without being part of it: "respected surgeon" reveals "surgeon".
EVALUATIVE_ADJECTIVES = frozenset(
    """renowned acclaimed celebrated esteemed respected revered distinguished prominent notable illustrious
    famous famed well-known popular brilliant keen sharp wise hard-working dedicated talented skilled prolific
    tremendous immense considerable significant great unique distinctive remarkable incisive deep deeper
    profound vivid exceptional influential beloved award-winning prestigious important key major
    visceral""".split()
)
DETERMINERS = POSSESSIVE_DETERMINERS | frozenset("the a an this these those".split())
# A verb follows a subject or an auxiliary; a noun or an adjective follows these.
VERB_CONTEXT = frozenset(
    """he she they it who which has have had was were is are be been being to will would can could may might
    also often not further did does do""".split()
)
NOUN_CONTEXT = DETERMINERS | frozenset("such many several various of with on about some any each".split())
CLAUSE_OPENERS = DETERMINERS | frozenset("to all from with in into on by".split())
PHRASE_ENDINGS = frozenset(". , ; ! ? ) of and".split())
# A span names the fact, not the person it describes: "lawyer father" reveals "lawyer".
PERSON_NOUNS = frozenset(
    """author authors writer writers novelist poet father mother parents individual person people man
    woman""".split()
)
# Small words inside names and titles, and the separators of dates and ranges.
NAME_JOINERS = frozenset("of for in the & de der del da di du la le von van al el bin ibn . -".split())
NUMBER_JOINERS = frozenset("/ - . to".split())  # "05/25/1930", "18 to 24"
# How exact a quantity is belongs to the fact: "approximately 30 years", "early 1980s".
APPROXIMATORS = frozenset(
    "approximately around about nearly almost roughly over under early late mid".split()
)
# Raw text: the currency before a number and the unit after it are part of the amount.
CURRENCY_SIGNS = frozenset("£ $ € ¥".split())
AMOUNT_UNITS = frozenset("% per cent percent million billion trillion bn m k".split())
OPENING_QUOTES = frozenset('" “ ‘'.split())
TITLE_ABBREVIATIONS = frozenset("dr mr mrs ms st jr sr prof".split())
COPULAS = frozenset("is are was were became becomes".split())
PREPOSITIONS = frozenset("of for with in on about into through".split())
NO_INFORMATION = re.compile(
    r"\b(?:no(?!,)|not|n't|never|un(?:disclosed|available|specified|confirmed|documented))\b.{0,60}?"
    r"\b(?:information|details?|records?|known|available|disclosed|documented|confirmed|specified|public(?:ly)?)\b",
    re.IGNORECASE,
)
# A no-information sentence that goes on to state something ("…, but his first work appeared when…",
# "…; she has always written under her birth name").
CONTRAST = re.compile(
    r"\b(?:but|however|although|though|while|yet|likely|suggests?|inferred)\b|(?:;|,|\bas)\s+(?:she|he|they|it)\b",
    re.IGNORECASE,
)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Token:
    start: int
    end: int
    text: str

    @property
    def is_word(self) -> bool:
        return self.text[0].isalnum() or self.text[0] == "_"

    @property
    def stem(self) -> str:
        return POSSESSIVE.sub("", self.text.lower())

    @property
    def is_possessive(self) -> bool:
        return self.text.endswith(POSSESSIVE_ENDINGS)


def tokenize(text: str) -> list[Token]:
    return [Token(match.start(), match.end(), match.group()) for match in TOKEN_PATTERN.finditer(text)]
