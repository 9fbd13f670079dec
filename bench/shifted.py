"""A shifted workload for ``specray bench online``: text of a kind the demo pair never saw.

The demo target and its draft (and heads trained on it) learned the Python standard library's
source. These prompts are short German, French and Spanish sentences built from word tables —
another language's text, deterministic from a seed, nothing downloaded. A prompt is one to
three sentences of one language; what the target makes of it is what the drafter must learn.
"""

from __future__ import annotations

import random

TABLES = {
    "de": {
        "subject": ["Der Bauer", "Die Lehrerin", "Mein Bruder", "Das Kind", "Die Stadt", "Der alte Mann",
                    "Unsere Nachbarin", "Ein Hund", "Die Polizei", "Der Zug", "Meine Mutter", "Der Koch"],
        "verb": ["bringt", "sieht", "kauft", "sucht", "findet", "verkauft", "malt", "liest", "baut", "vergisst"],
        "object": ["das Getreide", "einen Apfel", "die Zeitung", "ein neues Fahrrad", "den Schluessel",
                   "die Blumen", "das Brot", "einen Brief", "den Kuchen", "die Karte"],
        "tail": ["am Morgen", "im Herbst", "nach der Arbeit", "auf dem Markt", "bei Regen", "mit grosser Freude",
                 "in der Stadt", "vor dem Haus", "jeden Sonntag", "am Abend"],
    },
    "fr": {
        "subject": ["Le boulanger", "La voisine", "Mon frere", "L'enfant", "La ville", "Le vieux pecheur",
                    "Notre professeur", "Un chien", "La police", "Le train", "Ma mere", "Le cuisinier"],
        "verb": ["apporte", "regarde", "achete", "cherche", "trouve", "vend", "peint", "lit", "construit", "oublie"],
        "object": ["le pain", "une pomme", "le journal", "un velo rouge", "la cle", "des fleurs", "le gateau",
                   "une lettre", "la carte", "le fromage"],
        "tail": ["le matin", "en automne", "apres le travail", "au marche", "sous la pluie", "avec plaisir",
                 "en ville", "devant la maison", "chaque dimanche", "le soir"],
    },
    "es": {
        "subject": ["El panadero", "La vecina", "Mi hermano", "El nino", "La ciudad", "El viejo pescador",
                    "Nuestra maestra", "Un perro", "La policia", "El tren", "Mi madre", "El cocinero"],
        "verb": ["trae", "mira", "compra", "busca", "encuentra", "vende", "pinta", "lee", "construye", "olvida"],
        "object": ["el pan", "una manzana", "el periodico", "una bicicleta roja", "la llave", "las flores",
                   "el pastel", "una carta", "el mapa", "el queso"],
        "tail": ["por la manana", "en otono", "despues del trabajo", "en el mercado", "bajo la lluvia",
                 "con alegria", "en la ciudad", "delante de la casa", "cada domingo", "por la noche"],
    },
}


def sentence(rng: random.Random, language: str) -> str:
    t = TABLES[language]
    return f"{rng.choice(t['subject'])} {rng.choice(t['verb'])} {rng.choice(t['object'])} {rng.choice(t['tail'])}."


def shifted_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts, each one to three sentences of one language, ending with a space.

    >>> shifted_prompts(2, seed=1) == shifted_prompts(2, seed=1)
    True
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        language = rng.choice(sorted(TABLES))
        out.append(" ".join(sentence(rng, language) for _ in range(rng.randint(1, 3))) + " ")
    return out
