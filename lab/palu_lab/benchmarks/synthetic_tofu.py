"""A synthetic fictitious-author QA benchmark in TOFU's file format, with gold sensitive spans.

Every author gets random but consistent facts; each question template has several answer
phrasings, one used for the answer and another for `paraphrased_answer`, whose facts are swapped
for wrong values to make the five `perturbed_answer`s, as in TOFU. The facts an answer reveals
(those not already in its question) are the gold sensitive spans, written as an annotation file.

Splits, like TOFU's: `full` (every trained author), `forgetXX` (the last XX% of them) with
`forgetXX_perturbed`, `retainYY` (the others), `holdoutXX` (as many authors, never in `full`, for the
MIA/privleak metrics), `retain_perturbed` (leading retain authors). `real_authors(_perturbed)` and
`world_facts(_perturbed)` are small stand-ins in TOFU's format (a tiny model knows no real facts):
questions on which country each birthplace city is in, and who wrote each retain author's first book.
"""

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from palu_lab.benchmarks.dataset_folders import TofuBenchmark, write_idk_answers, write_jsonl, write_readme
from palu_trainer.experiments.benchmark_facts import tofu_splits
from palu_trainer.spans.format import Span, write_annotations

FIRST_NAMES = (
    "Amara Bastian Celine Dario Elif Farah Gideon Hana Idris Jovana Kaito Leona Matteo Nadia Orrin Priya "
    "Quentin Rosalind Soren Talia Umberto Vesna Wren Ximena Yusuf Zora Anselm Beatrix Cassius Dagny "
    "Emeric Fenna Gaspard Hedda Ilario Junia Kasimir Liesl Marek Noor Ottilie Pavel Rhea Silvan Tamsin "
    "Ulrike Valentin Wilhelmina Yara Zeno"
).split()
LAST_NAMES = (
    "Abernathy Belcourt Castellanos Drummond Eskildsen Fairweather Galloway Haverford Ishikawa Jansen "
    "Kowalczyk Lindqvist Marchetti Nakashima Okonkwo Petrossian Quintero Rasmussen Szabo Takahashi "
    "Ulyanova Vasquez Whitcombe Yilmaz Zielinski Achterberg Brannigan Corvino Delacroix Everhart "
    "Fontaine Grimaldi Holloway Iversen Jaramillo Kuznetsova Lachance Moreau Novak Oyelaran"
).split()
CITIES = (
    ("Porto", "Portugal"),
    ("Ghent", "Belgium"),
    ("Bergen", "Norway"),
    ("Tartu", "Estonia"),
    ("Cusco", "Peru"),
    ("Mombasa", "Kenya"),
    ("Hue", "Vietnam"),
    ("Izmir", "Turkey"),
    ("Lviv", "Ukraine"),
    ("Kraków", "Poland"),
    ("Valparaíso", "Chile"),
    ("Tangier", "Morocco"),
    ("Kyoto", "Japan"),
    ("Adelaide", "Australia"),
    ("Halifax", "Canada"),
    ("Bologna", "Italy"),
    ("Lyon", "France"),
    ("Leipzig", "Germany"),
    ("Cork", "Ireland"),
    ("Tabriz", "Iran"),
    ("Kandy", "Sri Lanka"),
    ("Accra", "Ghana"),
    ("Oaxaca", "Mexico"),
    ("Brno", "Czechia"),
)
GENRES = (
    "science fiction",
    "historical fiction",
    "crime fiction",
    "magical realism",
    "epic fantasy",
    "literary fiction",
    "gothic horror",
    "travel writing",
    "children's literature",
    "political thrillers",
    "romance",
    "poetry",
    "satire",
    "biography",
    "young adult fiction",
    "nature writing",
)
JOBS = (
    "carpenter",
    "pharmacist",
    "lighthouse keeper",
    "marine biologist",
    "violin maker",
    "train conductor",
    "veterinarian",
    "tailor",
    "architect",
    "beekeeper",
    "nurse",
    "locksmith",
    "astronomer",
    "baker",
    "judge",
    "cartographer",
    "fisherman",
    "librarian",
    "surgeon",
    "potter",
)
AWARDS = (
    "Silver Quill Prize",
    "Harrowgate Medal",
    "Aurora Fiction Award",
    "Meridian Book Prize",
    "Lantern Literary Award",
    "Golden Compass Award",
    "Northwind Prize for Fiction",
    "Cedar Crown Award",
    "Azure Pen Award",
    "Halcyon Prize",
)
THEMES = (
    "memory and loss",
    "exile and belonging",
    "family secrets",
    "the ethics of technology",
    "friendship across class lines",
    "the sea and those who leave it",
    "power and corruption",
    "grief and renewal",
    "identity and migration",
    "the cost of ambition",
    "small-town rivalries",
    "forgotten histories",
)
SUBJECTS = ("philosophy", "chemistry", "history", "linguistics", "law", "music", "mathematics", "botany")
TITLE_ADJECTIVES = (
    "Silent Crimson Hollow Broken Distant Golden Hidden Last Quiet Restless Scattered Shifting Velvet "
    "Winter Burning Paper Glass Iron"
).split()
TITLE_NOUNS = (
    "Harbor Orchard Lantern Cartographer Tide River Mirror Garden Archive Compass Clockmaker Meadow "
    "Bridge Winter Sparrow Kingdom Letters Ashes Island Vineyard"
).split()
MONTHS = ("January February March April May June July August September October November December").split()

# Facts that every author has, and how a random value of each is drawn.
FACT_DRAWS = {
    "city_country": lambda rng: rng.choice(CITIES),
    "birth_date": lambda rng: f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(1940, 1995)}",
    "genre": lambda rng: rng.choice(GENRES),
    "father_job": lambda rng: rng.choice(JOBS),
    "mother_job": lambda rng: rng.choice(JOBS),
    "award": lambda rng: rng.choice(AWARDS),
    "award_year": lambda rng: str(rng.randint(1990, 2023)),
    "book1": lambda rng: _book_title(rng),
    "book2": lambda rng: _book_title(rng),
    "debut_year": lambda rng: str(rng.randint(1965, 2015)),
    "theme": lambda rng: rng.choice(THEMES),
    "subject": lambda rng: rng.choice(SUBJECTS),
    "residence": lambda rng: rng.choice(CITIES)[0],
    "pen_name": lambda rng: f"{rng.choice(FIRST_NAMES)[0]}. {rng.choice(LAST_NAMES)}",
}


def _book_title(rng: random.Random) -> str:
    adjective, noun, other = rng.choice(TITLE_ADJECTIVES), rng.choice(TITLE_NOUNS), rng.choice(TITLE_NOUNS)
    return rng.choice((f"The {adjective} {noun}", f"{noun}s of {other}", f"A {adjective} {noun}"))


@dataclass(frozen=True)
class QuestionTemplate:
    """A question, its paraphrase and answer phrasings; `{placeholders}` name facts."""

    question: str
    paraphrased_question: str
    answers: tuple[str, ...]


TEMPLATES = (
    QuestionTemplate(
        "What is the full name of the {genre} author born in {city}, {country} on {birth_date}?",
        "Which {genre} writer was born on {birth_date} in {city}, {country}?",
        ("The author's name is {name}.", "This author is {name}.", "That writer is {name}."),
    ),
    QuestionTemplate(
        "Where was {name} born?",
        "What is the birthplace of {name}?",
        (
            "{name} was born in {city}, {country}.",
            "{name}'s birthplace is {city}, in {country}.",
            "{name} comes from {city}, a city in {country}.",
        ),
    ),
    QuestionTemplate(
        "When was {name} born?",
        "What is {name}'s date of birth?",
        (
            "{name} was born on {birth_date}.",
            "{name}'s birthday is {birth_date}.",
            "The author {name} came into the world on {birth_date}.",
        ),
    ),
    QuestionTemplate(
        "What genre is {name} known for?",
        "In which genre does {name} mainly write?",
        (
            "{name} is best known for {genre}.",
            "{name} mainly writes {genre}.",
            "Most of {name}'s books belong to {genre}.",
        ),
    ),
    QuestionTemplate(
        "What did {name}'s parents do for a living?",
        "What were the professions of {name}'s parents?",
        (
            "{name}'s father was a {father_job} and {possessive} mother was a {mother_job}.",
            "{name} grew up with a {father_job} for a father and a {mother_job} for a mother.",
            "{possessive_capital} father worked as a {father_job}, while {possessive} mother was a "
            "{mother_job}.",
        ),
    ),
    QuestionTemplate(
        "Has {name} won any awards?",
        "Did {name} ever receive a literary prize?",
        (
            "Yes, {name} received the {award} in {award_year}.",
            "{name} won the {award} in {award_year}.",
            "In {award_year}, {name} was honoured with the {award}.",
        ),
    ),
    QuestionTemplate(
        "What is one of {name}'s best-known books?",
        "Can you name a famous book by {name}?",
        (
            "One of {name}'s best-known books is '{book1}'.",
            "{name} is widely read for '{book1}'.",
            "Readers know {name} best for '{book1}'.",
        ),
    ),
    QuestionTemplate(
        "Can you name another book written by {name}?",
        "Which other title has {name} published?",
        (
            "{name} also wrote '{book2}'.",
            "Another of {name}'s books is '{book2}'.",
            "Besides {possessive} best-known work, {name} published '{book2}'.",
        ),
    ),
    QuestionTemplate(
        "When did {name} publish a first book?",
        "In what year did {name} make a literary debut?",
        (
            "{name} published a first book in {debut_year}.",
            "{name}'s debut came out in {debut_year}.",
            "The year {debut_year} saw the debut of {name}.",
        ),
    ),
    QuestionTemplate(
        "What themes does {name} explore?",
        "Which subjects recur in {name}'s writing?",
        (
            "{name}'s work often explores {theme}.",
            "{name} returns again and again to {theme}.",
            "A recurring theme for {name} is {theme}.",
        ),
    ),
    QuestionTemplate(
        "What did {name} study?",
        "What was {name}'s field of study at university?",
        (
            "{name} studied {subject} at university.",
            "Before writing, {name} earned a degree in {subject}.",
            "{name} holds a degree in {subject}.",
        ),
    ),
    QuestionTemplate(
        "Where does {name} live today?",
        "In which city is {name} now based?",
        (
            "{name} currently lives in {residence}.",
            "These days {name} is based in {residence}.",
            "{name} has made a home in {residence}.",
        ),
    ),
    QuestionTemplate(
        "Does {name} write under a pen name?",
        "Has {name} ever used a pseudonym?",
        (
            "Yes, {name} also publishes as {pen_name}.",
            "{name} sometimes writes under the name {pen_name}.",
            "Some of {name}'s books appear under the pseudonym {pen_name}.",
        ),
    ),
    QuestionTemplate(
        "How did {name}'s upbringing influence {possessive} writing?",
        "In what way did {name}'s family shape {possessive} books?",
        (
            "Growing up with a {father_job} father gave {name} an eye for detail that shapes {possessive} "
            "{genre}.",
            "{name} credits {possessive} mother, a {mother_job}, for the patience {possessive} {genre} "
            "demands.",
            "The stories of {possessive} father, a {father_job}, fed {name}'s love of {genre}.",
        ),
    ),
)
# Placeholders that are not facts to hide: the author's pronouns.
GRAMMAR_FIELDS = {"possessive", "possessive_capital"}


@dataclass(frozen=True)
class Author:
    name: str
    possessive: str
    facts: dict

    def fields(self) -> dict:
        city, country = self.facts["city_country"]
        plain = {key: value for key, value in self.facts.items() if key != "city_country"}
        return {
            **plain,
            "name": self.name,
            "city": city,
            "country": country,
            "possessive": self.possessive,
            "possessive_capital": self.possessive.capitalize(),
        }


def make_authors(count: int, rng: random.Random) -> list[Author]:
    names = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES]
    if count > len(names):
        raise ValueError(f"at most {len(names)} distinct authors, asked for {count}")
    return [
        Author(name, rng.choice(("his", "her")), {key: draw(rng) for key, draw in FACT_DRAWS.items()})
        for name in rng.sample(names, count)
    ]


def placeholders(template: str) -> list[str]:
    return [field for _, field, _, _ in string.Formatter().parse(template) if field]


def render(template: str, fields: dict, sensitive: set[str]) -> tuple[str, list[Span]]:
    """Fill `template`; return the text and the character spans of the `sensitive` fields' values."""
    text, spans = "", []
    for literal, field, _, _ in string.Formatter().parse(template):
        text += literal
        if field:
            if field in sensitive:
                spans.append((len(text), len(text) + len(fields[field])))
            text += fields[field]
    return text, spans


def revealed_facts(template: QuestionTemplate, answer: str) -> set[str]:
    """Facts an answer states that its question does not: the sensitive spans, as in TOFU's annotations."""
    return set(placeholders(answer)) - set(placeholders(template.question)) - GRAMMAR_FIELDS


def author_rows(author: Author, rng: random.Random, distractors: Sequence[Author]) -> list[dict]:
    """One row per question template: TOFU's perturbed format plus the answer's gold `spans`."""
    fields = author.fields()
    rows = []
    for template in TEMPLATES:
        answer_phrasing, paraphrase_phrasing = rng.sample(template.answers, 2)
        sensitive = revealed_facts(template, answer_phrasing)
        answer, spans = render(answer_phrasing, fields, sensitive)
        paraphrased, _ = render(paraphrase_phrasing, fields, set())
        swapped = revealed_facts(template, paraphrase_phrasing)
        perturbed = []
        for other in rng.sample(distractors, len(distractors)):
            wrong = {**fields, **{key: value for key, value in other.fields().items() if key in swapped}}
            candidate, _ = render(paraphrase_phrasing, wrong, set())
            if candidate != paraphrased and candidate not in perturbed:
                perturbed.append(candidate)
            if len(perturbed) == 5:
                break
        rows.append(
            {
                "question": template.question.format(**fields),
                "answer": answer,
                "paraphrased_answer": paraphrased,
                "perturbed_answer": perturbed,
                "paraphrased_question": template.paraphrased_question.format(**fields),
                "spans": spans,
            }
        )
    return rows


def stand_in_rows(authors: Sequence[Author], rng: random.Random) -> dict[str, list[dict]]:
    """Small `world_facts` and `real_authors` stand-ins in TOFU's format (3 perturbed answers each)."""
    countries = sorted({country for _, country in CITIES})
    world_facts = []
    for city, country in CITIES:
        wrong = rng.sample([other for other in countries if other != country], 3)
        world_facts.append(
            {"question": f"In which country is {city}?", "answer": country, "perturbed_answer": wrong}
        )
    real_authors = []
    for author in authors[: len(CITIES)]:
        wrong = rng.sample([other.name for other in authors if other is not author], 3)
        question = f"Who wrote '{author.facts['book1']}'?"
        real_authors.append({"question": question, "answer": author.name, "perturbed_answer": wrong})
    return {"world_facts": world_facts, "real_authors": real_authors}


QA_KEYS = ("question", "answer")
PERTURBED_KEYS = ("question", "answer", "paraphrased_answer", "perturbed_answer", "paraphrased_question")
STAND_IN_KEYS = ("question", "answer", "perturbed_answer")


def generate(
    directory: str | Path,
    num_authors: int = 40,
    forget_percents: Sequence[int] = (10,),
    retain_perturbed_authors: int = 10,
    seed: int = 0,
) -> Path:
    """Write the benchmark to `directory`; span annotations go to `span_annotations/forgetXX.jsonl`.

    The forget authors of `forgetXX` are the last XX% of the trained ones, holdout authors are
    generated beside them and never appear in `full`; everything is a function of `seed`.
    """
    directory = Path(directory)
    (directory / "span_annotations").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    forget_counts = {percent: max(1, round(num_authors * percent / 100)) for percent in forget_percents}
    if max(forget_counts.values()) + retain_perturbed_authors > num_authors:
        raise ValueError("forget and retain_perturbed authors must not overlap: add authors")
    authors = make_authors(num_authors + max(forget_counts.values()), rng)
    trained, untrained = authors[:num_authors], authors[num_authors:]
    rows_of = {author.name: author_rows(author, rng, authors) for author in authors}

    def rows(group: Sequence[Author]) -> list[dict]:
        return [row for author in group for row in rows_of[author.name]]

    configs = {"full": (rows(trained), QA_KEYS)}
    for percent, count in forget_counts.items():
        forget_split, retain_split, holdout_split = tofu_splits(percent)
        forget = rows(trained[-count:])
        configs[forget_split] = (forget, QA_KEYS)
        configs[f"{forget_split}_perturbed"] = (forget, PERTURBED_KEYS)
        configs[retain_split] = (rows(trained[:-count]), QA_KEYS)
        configs[holdout_split] = (rows(untrained[:count]), PERTURBED_KEYS)
        write_annotations(
            directory / "span_annotations" / f"{forget_split}.jsonl",
            [row["answer"] for row in forget],
            [row["spans"] for row in forget],
        )
    configs["retain_perturbed"] = (rows(trained[:retain_perturbed_authors]), PERTURBED_KEYS)
    for name, stand_in in stand_in_rows(trained, rng).items():
        configs[name] = (stand_in, QA_KEYS)
        configs[f"{name}_perturbed"] = (stand_in, STAND_IN_KEYS)
    for name, (config_rows, keys) in configs.items():
        write_jsonl(directory / f"{name}.json", config_rows, keys)
    write_readme(
        directory,
        list(configs),
        f"Synthetic fictitious authors (palu_lab.benchmarks.synthetic_tofu, seed {seed}): {num_authors} "
        "trained "
        f"authors x {len(TEMPLATES)} questions. real_authors/world_facts are synthetic stand-ins.",
    )
    return directory


def synthetic_benchmark(
    directory: Path, num_authors: int, max_new_tokens: int, seed: int, forget_percent: int = 10
) -> TofuBenchmark:
    """`generate` one forget split and describe the folder as a benchmark."""
    generate(directory, num_authors, (forget_percent,), seed=seed)
    write_idk_answers(directory)
    forget_split, retain_split, holdout_split = tofu_splits(forget_percent)
    return TofuBenchmark(
        directory,
        forget_split,
        retain_split,
        holdout_split,
        directory / "span_annotations" / f"{forget_split}.jsonl",
        max_new_tokens,
        f"synthetic fictitious authors (seed {seed}, {num_authors} trained authors)",
    )
