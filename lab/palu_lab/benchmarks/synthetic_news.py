"""Synthetic news articles with known facts: gold sensitive spans for the raw-text annotator.

Each article is a handful of sentences filled from random but consistent facts (people, their roles,
organisations, places, dates, counts, amounts, quoted titles, offences and projects) between filler
sentences that state nothing specific. The facts' character ranges are the gold spans.

Two disjoint parts keep the annotator's evaluation honest: `tuning` and `held_out` draw their names,
places, organisations, roles and sentence templates from separate halves of every pool, so a rule or
weight set by reading the tuning part has seen neither the wording nor the vocabulary of the held-out part.
"""

import random
import re
from dataclasses import dataclass

from palu_trainer.spans.format import Span

PARTS = ("tuning", "held_out")

FIRST_NAMES = (
    "Alan Bronwen Callum Deborah Eamon Fiona Gareth Helen Iwan Janet Kieran Lorna Martin Nia Owen Paula "
    "Rhys Sian Trevor Ursula Vikram Wendy Yasmin Zoltan Aled Bethan Conor Delyth Euan Gwen Hamish Imogen "
    "Jasper Kirsty Lewis Moira Niall Olwen Piers Rowena"
).split()
SURNAMES = (
    "Ashworth Blackwood Carmichael Dunmore Ellery Fenwick Garside Hollins Ingram Jessop Kinnear Lomax "
    "Maddocks Northcott Oakley Pennington Quayle Redfern Stainton Thirkell Underwood Varley Whitlock "
    "Yardley Aldous Bramhall Cotterill Dearden Enwright Flitcroft Goodall Hepworth Illingworth Jowett "
    "Kershaw Lightfoot Mellor Nuttall Ormerod Pickles"
).split()
TOWNS = (
    "Abergele Bridlington Carnforth Dunstable Ellesmere Frodsham Glossop Hexham Ilkley Kendal Ludlow Malton "
    "Nantwich Oswestry Penrith Ripon Settle Thirsk Ulverston Wetherby Alnwick Buxton Clitheroe Driffield "
    "Evesham Falmouth Grantham Helston Ivybridge Keswick Lydney Matlock"
).split()
ORGANISATION_KINDS = (
    "Logistics;Building Society;Housing Trust;Water;Engineering;Bus Company;Foods;Energy;Hospital Trust;"
    "Rugby Club;Chamber of Commerce;Freight;Dairies;Printing;Steel;Brewery"
).split(";")
ROLES = (
    "chief executive;finance director;head teacher;council leader;managing director;chief constable;"
    "operations manager;lead investigator;head of planning;union representative;chief medical officer;"
    "site manager;cabinet member for housing;director of public health;project engineer;club chairman"
).split(";")
OFFENCES = (
    "fraud;dangerous driving;theft of machinery;money laundering;arson;false accounting;"
    "assault by beating;perverting the course of justice;illegal dumping;tax evasion;bribery;"
    "criminal damage;drink driving;blackmail;insider dealing;embezzlement"
).split(";")
PROJECTS = (
    "flood defences;electric buses;new hospital wing;solar farms;northern bypass;affordable homes;"
    "swimming pool;cycle lanes;recycling plant;tidal barrage;broadband masts;park and ride;"
    "sea walls;cancer unit;wind turbines;rail link"
).split(";")
TITLE_WORDS = (
    "Fair Shares Lost Harbour Rising Tide Broken Promises Quiet Streets Northern Light Open Doors "
    "Second Chances Hidden Costs Common Ground Safe Passage Clear Water Better Futures Heavy Weather"
).split()
MONTHS = "January February March April May June July August September October November December".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()

# Sentence templates: `{slot}` is a fact (a gold span), `<slot>` is context (no span).
TEMPLATES = {
    "tuning": (
        "{person}, the {role} of {organisation}, said the firm would cut {count} jobs at its {town} site.",
        "The plans for the {project} in {town} were approved on {date}, <pronoun> said.",
        "{person} was charged with {offence} and appeared before {magistrates_court} on {day}.",
        "The {organisation} report, called '{title}', found that costs had risen by {percent}.",
        "Officials said the scheme would cost {amount} and take {count} months to complete.",
        "A {age} man from {town} has been arrested, police said.",
        "In {year}, <pronoun> became the {role} of {organisation}.",
        "The council's {role}, {person}, said the decision was taken on {date}.",
    ),
    "held_out": (
        "Speaking on {day}, {person} told reporters that {organisation} had lost {amount}.",
        "{organisation} confirmed it would invest {amount} in the {project} by {year}.",
        "According to {person}, {count} people were evacuated from homes in {town}.",
        "A jury at {crown_court} heard that the {age} defendant denied {offence}.",
        "The documentary, titled '{title}', was first broadcast on {date}.",
        "Figures published on {day} showed a fall of {percent} in the number of visitors to {town}.",
        "<Pronoun> had worked as {role_with_article} at {organisation} since {year}.",
        "{person}, who chairs {organisation}, described the result as disappointing.",
    ),
}
FILLERS = {
    "tuning": (
        "The announcement came after months of discussion.",
        "Residents said they were relieved that a decision had finally been made.",
        "Further details are expected to be published later this year.",
        "The proposals have divided opinion in the area.",
    ),
    "held_out": (
        "It is not yet clear what will happen next.",
        "Local people have been asked for their views.",
        "A spokesperson declined to comment further on the matter.",
        "The issue is likely to be discussed again at the next meeting.",
    ),
}
SLOT = re.compile(r"\{(\w+)\}|<(\w+)>")


@dataclass(frozen=True)
class NewsArticle:
    """One generated article: its text and the gold spans of the facts it states."""

    text: str
    spans: list[Span]


def _half(pool, part: str):
    """Alternate entries of a pool: the part's own half, disjoint from the other part's."""
    return pool[PARTS.index(part) :: 2]


class _Facts:
    def __init__(self, part: str, rng: random.Random):
        self.rng = rng
        self.first_names, self.surnames = _half(FIRST_NAMES, part), _half(SURNAMES, part)
        self.towns, self.kinds = _half(TOWNS, part), _half(ORGANISATION_KINDS, part)
        self.roles, self.offences = _half(ROLES, part), _half(OFFENCES, part)
        self.projects, self.title_words = _half(PROJECTS, part), _half(TITLE_WORDS, part)
        self.person = f"{rng.choice(self.first_names)} {rng.choice(self.surnames)}"
        self.pronoun = rng.choice(("he", "she"))
        self.organisation = f"{rng.choice(self.surnames)} {rng.choice(self.kinds)}"

    def value(self, slot: str) -> str:
        rng = self.rng
        day, month, year = rng.randint(1, 28), rng.choice(MONTHS), rng.randint(1995, 2023)
        values = {
            "person": lambda: self.person,
            "pronoun": lambda: self.pronoun,
            "Pronoun": lambda: self.pronoun.capitalize(),
            "organisation": lambda: self.organisation,
            "role": lambda: rng.choice(self.roles),
            "role_with_article": lambda: rng.choice(self.roles),
            "town": lambda: rng.choice(self.towns),
            "magistrates_court": lambda: f"{rng.choice(self.towns)} Magistrates' Court",
            "crown_court": lambda: f"{rng.choice(self.towns)} Crown Court",
            "project": lambda: rng.choice(self.projects),
            "offence": lambda: rng.choice(self.offences),
            "title": lambda: " ".join(rng.sample(self.title_words, 2)),
            "date": lambda: rng.choice((f"{day} {month}", f"{day} {month} {year}", f"{month} {day}")),
            "day": lambda: rng.choice(DAYS),
            "year": lambda: str(year),
            "count": lambda: str(rng.choice((rng.randint(3, 60), rng.randint(100, 2000)))),
            "percent": lambda: rng.choice((f"{rng.randint(2, 40)}%", f"{rng.randint(2, 40)} per cent")),
            "amount": lambda: rng.choice(
                (
                    f"£{rng.randint(2, 90)}m",
                    f"£{rng.randint(1, 9)}.{rng.randint(1, 9)} million",
                    f"${rng.randint(2, 20)}bn",
                )
            ),
            "age": lambda: f"{rng.randint(18, 80)}-year-old",
        }
        return values[slot]()


def _fill(template: str, facts: _Facts) -> tuple[str, list[Span]]:
    text, spans, cursor = "", [], 0
    for match in SLOT.finditer(template):
        text += template[cursor : match.start()]
        slot = match.group(1) or match.group(2)
        value = facts.value(slot)
        if slot == "role_with_article":
            text += "an " if value[0] in "aeiou" else "a "
        if match.group(1):
            spans.append((len(text), len(text) + len(value)))
        text += value
        cursor = match.end()
    return text + template[cursor:], spans


def synthetic_news(num_articles: int, part: str, seed: int = 0) -> list[NewsArticle]:
    """`num_articles` articles of `part` (tuning | held_out); deterministic from `seed`."""
    if part not in PARTS:
        raise ValueError(f"part={part!r}; choose one of {PARTS}")
    rng = random.Random(f"{seed}-{part}")
    articles = []
    for _ in range(num_articles):
        facts = _Facts(part, rng)
        sentences = rng.sample(TEMPLATES[part], 4) + rng.sample(FILLERS[part], 2)
        rng.shuffle(sentences)
        paragraphs, spans, length = [], [], 0
        for template in sentences:
            sentence, sentence_spans = _fill(template, facts)
            offset = length + (2 if paragraphs else 0)
            spans += [(start + offset, end + offset) for start, end in sentence_spans]
            paragraphs.append(sentence)
            length = offset + len(sentence)
        articles.append(NewsArticle("\n\n".join(paragraphs), spans))
    return articles
