"""The embedded default: a seeded, fictional knowledge base and questions about it.

No dataset can be downloaded at run time, so the project writes its own encyclopedia of
made-up countries, cities, people, companies and inventions, with short passages per
entity, and 1-hop ("Where was X born?") and 2-hop ("In which country is the company founded
by X headquartered?") questions. Every name is invented, so the answers exist only in this
corpus and a model has to search for them. Generation is deterministic in the seed, takes
well under a second, and is cached on disk (see :func:`default_paths`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Bump when the generator's output changes, so stale caches are not reused.
KB_VERSION = 1
DEFAULT_SEED = 0
TEST_FRACTION = 0.2

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "kr", "th", "sh", "tr", "vel", "qu", "st", "gr"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "y"]
_CODAS = ["", "n", "r", "l", "s", "th", "m", "sk", "nd", "x"]
_CONTINENTS = ["Northern Aldera", "Southern Aldera", "Vessmark", "the Orrin Isles"]
_OCCUPATIONS = ["chemist", "architect", "painter", "engineer", "poet", "astronomer", "composer",
                "physician", "mathematician", "botanist", "cartographer", "novelist"]
_INDUSTRIES = ["shipping", "textile", "software", "mining", "pharmaceutical", "aviation",
               "publishing", "brewing", "railway", "optics"]
_DEVICES = ["engine", "loom", "lens", "compass", "press", "valve", "lamp", "clock", "telegraph",
            "kiln", "pump", "sextant"]


@dataclass
class _Entities:
    countries: list[dict[str, Any]]
    cities: list[dict[str, Any]]
    people: list[dict[str, Any]]
    companies: list[dict[str, Any]]
    inventions: list[dict[str, Any]]


class _Namer:
    """Draws pronounceable, globally unique made-up words."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        while True:
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
            w = (w + self.rng.choice(_CODAS)).capitalize()
            if w.lower() not in self.used and len(w) >= 4:
                self.used.add(w.lower())
                return w


def _entities(seed: int, n_countries: int, cities_per_country: int, n_people: int,
              n_companies: int, n_inventions: int) -> _Entities:
    rng = random.Random(seed)
    namer = _Namer(rng)
    countries = [{"name": namer.word(2), "continent": rng.choice(_CONTINENTS),
                  "language": namer.word(2) + "ish", "founded": rng.randint(900, 1700)}
                 for _ in range(n_countries)]
    cities = []
    for country in countries:
        for _ in range(cities_per_country):
            cities.append({"name": namer.word(rng.choice([2, 3])), "country": country["name"],
                           "founded": rng.randint(800, 1850), "river": namer.word(2)})
        country["capital"] = cities[-cities_per_country]["name"]
    city_country = {c["name"]: c["country"] for c in cities}
    people = []
    for _ in range(n_people):
        city = rng.choice(cities)["name"]
        people.append({"name": f"{namer.word(2)} {namer.word(rng.choice([2, 3]))}",
                       "born_city": city, "born_country": city_country[city],
                       "born_year": rng.randint(1790, 1990), "occupation": rng.choice(_OCCUPATIONS)})
    makers = rng.sample(range(n_people), n_companies + n_inventions)
    companies = []
    for i in makers[:n_companies]:
        founder, hq = people[i], rng.choice(cities)
        companies.append({"name": namer.word(rng.choice([2, 3])) + rng.choice([" Works", " Group", " & Co.", ""]),
                          "founder": founder["name"], "founded": founder["born_year"] + rng.randint(22, 60),
                          "hq_city": hq["name"], "hq_country": hq["country"],
                          "industry": rng.choice(_INDUSTRIES)})
        founder["company"] = companies[-1]["name"]
    inventions = []
    for i in makers[n_companies:]:
        inventor = people[i]
        inventions.append({"name": f"{namer.word(2)} {rng.choice(_DEVICES)}", "inventor": inventor["name"],
                           "year": inventor["born_year"] + rng.randint(20, 55)})
        inventor["invention"] = inventions[-1]["name"]
    return _Entities(countries, cities, people, companies, inventions)


def _passages(kb: _Entities) -> list[dict[str, str]]:
    out: list[tuple[str, str]] = []
    for c in kb.countries:
        out.append((c["name"], f"{c['name']} is a country in {c['continent']}, founded in {c['founded']}. "
                    f"Its capital is {c['capital']} and its official language is {c['language']}."))
    for c in kb.cities:
        out.append((c["name"], f"{c['name']} is a city in {c['country']}, founded in {c['founded']}. "
                    f"It lies on the {c['river']} River."))
    for p in kb.people:
        out.append((p["name"], f"{p['name']} (born {p['born_year']}) is a {p['occupation']} "
                    f"born in {p['born_city']}, {p['born_country']}."))
        if "company" in p:
            out.append((p["name"], f"In later life {p['name']} founded the company {p['company']}, "
                        "which still bears the founder's mark."))
        if "invention" in p:
            out.append((p["name"], f"{p['name']} is best known as the inventor of the {p['invention']}."))
    for c in kb.companies:
        out.append((c["name"], f"{c['name']} is a {c['industry']} company founded in {c['founded']} by "
                    f"{c['founder']}. It is headquartered in {c['hq_city']}, {c['hq_country']}."))
    for i in kb.inventions:
        out.append((f"{i['name']}".capitalize(), f"The {i['name']} was invented by {i['inventor']} in {i['year']}."))
    return [{"id": str(n), "contents": f"{title}\n{text}"} for n, (title, text) in enumerate(out)]


def _questions(kb: _Entities) -> list[dict[str, Any]]:
    q: list[tuple[str, list[str], int]] = []
    for c in kb.countries:
        q.append((f"What is the capital of {c['name']}?", [c["capital"]], 1))
    for c in kb.cities:
        q.append((f"In which country is the city of {c['name']}?", [c["country"]], 1))
    for p in kb.people:
        q.append((f"Where was {p['name']} born?", [p["born_city"], f"{p['born_city']}, {p['born_country']}"], 1))
        q.append((f"In what year was {p['name']} born?", [str(p["born_year"])], 1))
        capital = next(c["capital"] for c in kb.countries if c["name"] == p["born_country"])
        q.append((f"What is the capital of the country where {p['name']} was born?", [capital], 2))
    people = {p["name"]: p for p in kb.people}
    for c in kb.companies:
        q.append((f"Who founded {c['name']}?", [c["founder"]], 1))
        q.append((f"In which city is {c['name']} headquartered?", [c["hq_city"]], 1))
        q.append((f"In which country is the company founded by {c['founder']} headquartered?", [c["hq_country"]], 2))
        q.append((f"In what year was the founder of {c['name']} born?", [str(people[c["founder"]]["born_year"])], 2))
    for i in kb.inventions:
        q.append((f"Who invented the {i['name']}?", [i["inventor"]], 1))
        q.append((f"In which city was the inventor of the {i['name']} born?", [people[i["inventor"]]["born_city"]], 2))
    return [{"id": f"kb-{n}", "question": text, "golden_answers": golds, "hops": hops}
            for n, (text, golds, hops) in enumerate(q)]


def generate(seed: int = DEFAULT_SEED, *, n_countries: int = 12, cities_per_country: int = 6,
             n_people: int = 360, n_companies: int = 100, n_inventions: int = 100
             ) -> tuple[list[dict[str, str]], dict[str, list[dict[str, Any]]]]:
    """Build the corpus (``id``, ``contents``) and the train/test questions for ``seed``."""
    kb = _entities(seed, n_countries, cities_per_country, n_people, n_companies, n_inventions)
    questions = _questions(kb)
    random.Random(seed + 1).shuffle(questions)
    n_test = int(len(questions) * TEST_FRACTION)
    return _passages(kb), {"test": questions[:n_test], "train": questions[n_test:]}


def cache_root() -> Path:
    """``$FRESHPER_CACHE`` if set, else ``.cache/freshper`` under the working directory."""
    return Path(os.environ.get("FRESHPER_CACHE") or Path.cwd() / ".cache" / "freshper")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)  # atomic: concurrent processes never see half a file


def default_paths(seed: int = DEFAULT_SEED) -> dict[str, Path]:
    """Paths of the default ``corpus``, ``train`` and ``test`` files, generating them once."""
    root = cache_root() / "search" / f"kb-v{KB_VERSION}-seed{seed}"
    paths = {name: root / f"{name}.jsonl" for name in ("corpus", "train", "test")}
    if not all(p.exists() for p in paths.values()):
        root.mkdir(parents=True, exist_ok=True)
        corpus, splits = generate(seed)
        for name, rows in (("train", splits["train"]), ("test", splits["test"]), ("corpus", corpus)):
            _write_jsonl(paths[name], rows)
        logger.info("wrote the default search knowledge base (%d passages) to %s", len(corpus), root)
    return paths
