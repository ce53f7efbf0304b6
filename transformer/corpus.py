"""A built-in English -> Spanish corpus generated from a small synchronous grammar.

This is the zero-setup default dataset: no download, deterministic in a seed,
and learnable by a small Transformer in minutes while still exercising what
attention is for (reordering, agreement at a distance, words without a
counterpart on the other side).

Every sentence is produced on both sides at once by the same derivation, so
each English sentence has exactly one Spanish translation. The grammar:

    sentence  -> clause
               | clause CONNECTOR clause         (because, and, but, although,
                                                  when, while, if)
               | WHEN/IF/... clause "," clause   (fronted subordinate clause)
    clause    -> subject predicate [time adverb]
    subject   -> pronoun | noun-phrase [relative clause]
    predicate -> intransitive verb [prepositional phrase]
               | transitive verb object [prepositional phrase]
               | be adjective                    (ser or estar, per adjective)
               | be prepositional-phrase         (always estar)
    noun-phrase -> determiner [adjective] noun    ("the black cat")
    relative  -> who/that predicate              ("the dog that sees the cat")
               | that subject transitive-verb    ("the book that I find")

Fixed choices that keep the mapping a function of the English side:

* Spanish adjectives follow the noun and agree with it ("the black cats" ->
  "los gatos negros"); there is at most one adjective per noun.
* Articles and determiners agree with the noun's gender and number; "some" is
  "unos/unas"; "you" is always singular "tú"; "they" is always "ellos".
* Subject pronouns I/you/we are dropped in Spanish (the verb ending carries
  the person); he/she/they are kept (él/ella/ellos). Predicate adjectives are
  only used with subjects whose gender is known from the English side.
* Tenses: simple present, present progressive ("is sleeping" -> "está
  durmiendo"), simple past -> preterite, "will" -> future. With "be", the
  past is the imperfect ("was tired" -> "estaba cansado").
* Object pronouns become clitics before the verb ("sees him" -> "lo ve",
  "is not watching us" -> "no nos está mirando").
* Animate direct objects (people, animals) take the personal "a" ("sees the
  cat" -> "ve al gato"); "a el" and "de el" contract to "al" and "del".
* "and" is "e" before a word starting with an /i/ sound ("e iré").
* Sentences are capitalised and end in a period on both sides.

Splits are assigned by a stable hash of the English sentence, so a sentence
always belongs to the same split whatever the seed or sizes, and the valid and
test splits do not depend on the train size.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator
from typing import NamedTuple

SPLITS = ("train", "valid", "test")

# The hash of an English sentence, modulo _HASH_BUCKETS, picks its split.
_HASH_BUCKETS = 64
_TEST_BUCKETS = range(0, 4)  # 1/16 of all sentences
_VALID_BUCKETS = range(4, 8)  # 1/16 of all sentences
# Largest split we agree to build: room for WMT14 en-de's 4.5M train pairs (which take about 2 minutes of
# CPU to generate).
_MAX_SPLIT_SIZE = 10_000_000
# Bump when a change to the grammar, lexicon or sampling changes the generated pairs: token caches of the
# built-in corpus are found by it (with the seed and size) and never re-read the corpus on a restart.
GENERATOR_VERSION = 1
# Sentences outside this English word range are re-drawn.
_MIN_WORDS, _MAX_WORDS = 4, 25

# ---------------------------------------------------------------------------
# Lexicon
# ---------------------------------------------------------------------------
# Noun categories (first letter of `cats`): h person, n animal, t thing,
# f food, d drink, p place. Further letters are tags used to pick sensible
# prepositions and verbs: i "in" (a container), o "on" (a surface),
# u "under/near/behind" (a landmark), x can be opened, M mass noun
# (no plural, no "a").


class _Noun(NamedTuple):
    en: str
    en_pl: str
    es: str
    es_pl: str
    fem: bool
    cats: str


_NOUN_TABLE = """
man men             | hombre hombres         | m | h
woman women         | mujer mujeres          | f | h
boy boys            | niño niños             | m | h
girl girls          | niña niñas             | f | h
king kings          | rey reyes              | m | h
queen queens        | reina reinas           | f | h
brother brothers    | hermano hermanos       | m | h
sister sisters      | hermana hermanas       | f | h
father fathers      | padre padres           | m | h
mother mothers      | madre madres           | f | h
uncle uncles        | tío tíos               | m | h
aunt aunts          | tía tías               | f | h
friend friends      | amigo amigos           | m | h
teacher teachers    | profesor profesores    | m | h
doctor doctors      | médico médicos         | m | h
farmer farmers      | granjero granjeros     | m | h
dog dogs            | perro perros           | m | n
cat cats            | gato gatos             | m | n
horse horses        | caballo caballos       | m | n
bird birds          | pájaro pájaros         | m | n
cow cows            | vaca vacas             | f | n
pig pigs            | cerdo cerdos           | m | n
mouse mice          | ratón ratones          | m | n
rabbit rabbits      | conejo conejos         | m | n
duck ducks          | pato patos             | m | n
lion lions          | león leones            | m | n
bear bears          | oso osos               | m | n
wolf wolves         | lobo lobos             | m | n
fox foxes           | zorro zorros           | m | n
frog frogs          | rana ranas             | f | n
snake snakes        | serpiente serpientes   | f | n
owl owls            | búho búhos             | m | n
book books          | libro libros           | m | tx
table tables        | mesa mesas             | f | tou
chair chairs        | silla sillas           | f | tou
door doors          | puerta puertas         | f | tx
window windows      | ventana ventanas       | f | tx
car cars            | coche coches           | m | tiou
ball balls          | pelota pelotas         | f | t
box boxes           | caja cajas             | f | tioux
letter letters      | carta cartas           | f | tx
key keys            | llave llaves           | f | t
bag bags            | bolsa bolsas           | f | tix
cup cups            | taza tazas             | f | t
hat hats            | sombrero sombreros     | m | t
pencil pencils      | lápiz lápices          | m | t
lamp lamps          | lámpara lámparas       | f | t
clock clocks        | reloj relojes          | m | t
bed beds            | cama camas             | f | tiou
map maps            | mapa mapas             | m | t
umbrella umbrellas  | paraguas paraguas      | m | tx
photo photos        | foto fotos             | f | t
tree trees          | árbol árboles          | m | tiu
flower flowers      | flor flores            | f | t
apple apples        | manzana manzanas       | f | f
cake cakes          | pastel pasteles        | m | f
orange oranges      | naranja naranjas       | f | f
egg eggs            | huevo huevos           | m | f
cookie cookies      | galleta galletas       | f | f
banana bananas      | plátano plátanos       | m | f
lemon lemons        | limón limones          | m | f
bread -             | pan -                  | m | fM
cheese -            | queso -                | m | fM
soup -              | sopa -                 | f | fM
milk -              | leche -                | f | dM
coffee -            | café -                 | m | dM
juice -             | zumo -                 | m | dM
tea -               | té -                   | m | dM
garden gardens      | jardín jardines        | m | p
house houses        | casa casas             | f | p
park parks          | parque parques         | m | p
city cities         | ciudad ciudades        | f | p
school schools      | escuela escuelas       | f | p
river rivers        | río ríos               | m | p
forest forests      | bosque bosques         | m | p
market markets      | mercado mercados       | m | p
street streets      | calle calles           | f | p
kitchen kitchens    | cocina cocinas         | f | p
room rooms          | habitación habitaciones | f | p
village villages    | pueblo pueblos         | m | p
beach beaches       | playa playas           | f | p
mountain mountains  | montaña montañas       | f | p
bridge bridges      | puente puentes         | m | pu
station stations    | estación estaciones    | f | p
library libraries   | biblioteca bibliotecas | f | p
hospital hospitals  | hospital hospitales    | m | p
museum museums      | museo museos           | m | p
church churches     | iglesia iglesias       | f | p
"""


class _Adjective(NamedTuple):
    en: str
    forms: tuple[str, str, str, str]  # indexed by 2 * plural + feminine
    estar: bool  # predicative use takes estar (a state), else ser
    cats: str  # noun categories it describes


_ADJECTIVE_TABLE = """
black     | negro negra negros negras                 | ser   | ntfp
white     | blanco blanca blancos blancas             | ser   | ntfp
red       | rojo roja rojos rojas                     | ser   | tfp
blue      | azul azul azules azules                   | ser   | tp
green     | verde verde verdes verdes                 | ser   | tfp
yellow    | amarillo amarilla amarillos amarillas     | ser   | tfp
gray      | gris gris grises grises                   | ser   | ntp
brown     | marrón marrón marrones marrones           | ser   | ntp
big       | grande grande grandes grandes             | ser   | hntp
small     | pequeño pequeña pequeños pequeñas         | ser   | hntfp
old       | viejo vieja viejos viejas                 | ser   | hntp
young     | joven joven jóvenes jóvenes               | ser   | hn
new       | nuevo nueva nuevos nuevas                 | ser   | tp
tall      | alto alta altos altas                     | ser   | hp
beautiful | bonito bonita bonitos bonitas             | ser   | hntp
ugly      | feo fea feos feas                         | ser   | hntp
fast      | rápido rápida rápidos rápidas             | ser   | hn
strong    | fuerte fuerte fuertes fuertes             | ser   | hn
rich      | rico rica ricos ricas                     | ser   | h
famous    | famoso famosa famosos famosas             | ser   | hp
kind      | amable amable amables amables             | ser   | h
lazy      | perezoso perezosa perezosos perezosas     | ser   | hn
brave     | valiente valiente valientes valientes     | ser   | hn
expensive | caro cara caros caras                     | ser   | tf
delicious | delicioso deliciosa deliciosos deliciosas | ser   | fd
tired     | cansado cansada cansados cansadas         | estar | hn
happy     | contento contenta contentos contentas     | estar | hn
sad       | triste triste tristes tristes             | estar | hn
angry     | enfadado enfadada enfadados enfadadas     | estar | hn
sick      | enfermo enferma enfermos enfermas         | estar | hn
dirty     | sucio sucia sucios sucias                 | estar | ntp
wet       | mojado mojada mojados mojadas             | estar | hnt
empty     | vacío vacía vacíos vacías                 | estar | tp
broken    | roto rota rotos rotas                     | estar | t
cold      | frío fría fríos frías                     | estar | fdp
hot       | caliente caliente calientes calientes     | estar | fd
"""

# Spanish persons: 0 yo, 1 tú, 2 él/ella, 3 nosotros, 4 ellos.


class _Verb(NamedTuple):
    base: str  # English: "see", "look for"
    s3: str  # "sees"
    past: str  # "saw"
    ing: str  # "seeing"
    pres: tuple[str, ...]  # Spanish present, by person
    pret: tuple[str, ...]  # preterite
    fut: tuple[str, ...]  # future
    ger: str  # gerund: "viendo"
    subj: str  # noun categories of the subject
    obj: str  # noun categories / tags of a direct object; "" if none
    intransitive: bool
    motion: bool  # takes "to/from/toward PLACE"
    needs: str  # "" | "loc" (needs a place) | "dir" (needs a destination)
    stative: bool  # no progressive ("is knowing")


# English forms (with "_" for a space) | infinitive | subject | object | flags
# Flags: i intransitive use, m motion, L needs a location, D needs a
# destination, s stative.
_VERB_TABLE = """
sleep sleeps slept sleeping                      | dormir    | hn | -     | i
run runs ran running                             | correr    | hn | -     | im
walk walks walked walking                        | caminar   | hn | -     | im
sing sings sang singing                          | cantar    | hn | -     | i
dance dances danced dancing                      | bailar    | h  | -     | i
swim swims swam swimming                         | nadar     | hn | -     | i
work works worked working                        | trabajar  | h  | -     | i
play plays played playing                        | jugar     | hn | -     | i
wait waits waited waiting                        | esperar   | hn | -     | i
live lives lived living                          | vivir     | hn | -     | iL
cry cries cried crying                           | llorar    | h  | -     | i
jump jumps jumped jumping                        | saltar    | hn | -     | i
study studies studied studying                   | estudiar  | h  | -     | i
go goes went going                               | ir        | hn | -     | imD
come comes came coming                           | venir     | hn | -     | im
return returns returned returning                | volver    | hn | -     | im
eat eats ate eating                              | comer     | hn | f     | i
cook cooks cooked cooking                        | cocinar   | h  | f     | i
see sees saw seeing                              | ver       | hn | hntfp | s
watch watches watched watching                   | mirar     | hn | hnt   |
buy buys bought buying                           | comprar   | h  | tfd   |
sell sells sold selling                          | vender    | h  | tf    |
carry carries carried carrying                   | llevar    | hn | tf    |
find finds found finding                         | encontrar | hn | hntf  |
open opens opened opening                        | abrir     | h  | x     |
paint paints painted painting                    | pintar    | h  | tp    |
break breaks broke breaking                      | romper    | hn | t     |
draw draws drew drawing                          | dibujar   | h  | hntp  |
want wants wanted wanting                        | querer    | hn | tfd   | s
need needs needed needing                        | necesitar | h  | tfd   | s
have has had having                              | tener     | h  | tf    | s
help helps helped helping                        | ayudar    | h  | hn    |
call calls called calling                        | llamar    | h  | hn    |
visit visits visited visiting                    | visitar   | h  | hp    |
know knows knew knowing                          | conocer   | h  | hp    | s
remember remembers remembered remembering        | recordar  | h  | hntp  | s
look_for looks_for looked_for looking_for        | buscar    | hn | hntf  |
hear hears heard hearing                         | oír       | hn | hn    | s
bring brings brought bringing                    | traer     | h  | tfd   |
follow follows followed following                | seguir    | hn | hn    |
chase chases chased chasing                      | perseguir | hn | hn    |
hug hugs hugged hugging                          | abrazar   | h  | hn    |
catch catches caught catching                    | atrapar   | hn | nt    |
drink drinks drank drinking                      | beber     | hn | d     |
"""

# Irregular Spanish forms (persons 0..4); anything absent is regular.
_IRREGULAR = {
    "dormir": {
        "pres": "duermo duermes duerme dormimos duermen",
        "pret": "dormí dormiste durmió dormimos durmieron",
        "ger": "durmiendo",
    },
    "jugar": {
        "pres": "juego juegas juega jugamos juegan",
        "pret": "jugué jugaste jugó jugamos jugaron",
    },
    "ir": {
        "pres": "voy vas va vamos van",
        "pret": "fui fuiste fue fuimos fueron",
        "ger": "yendo",
    },
    "venir": {
        "pres": "vengo vienes viene venimos vienen",
        "pret": "vine viniste vino vinimos vinieron",
        "fut": "vendré vendrás vendrá vendremos vendrán",
        "ger": "viniendo",
    },
    "volver": {"pres": "vuelvo vuelves vuelve volvemos vuelven"},
    "ver": {
        "pres": "veo ves ve vemos ven",
        "pret": "vi viste vio vimos vieron",
    },
    "encontrar": {"pres": "encuentro encuentras encuentra encontramos encuentran"},
    "querer": {
        "pres": "quiero quieres quiere queremos quieren",
        "pret": "quise quisiste quiso quisimos quisieron",
        "fut": "querré querrás querrá querremos querrán",
    },
    "tener": {
        "pres": "tengo tienes tiene tenemos tienen",
        "pret": "tuve tuviste tuvo tuvimos tuvieron",
        "fut": "tendré tendrás tendrá tendremos tendrán",
    },
    "conocer": {"pres": "conozco conoces conoce conocemos conocen"},
    "recordar": {"pres": "recuerdo recuerdas recuerda recordamos recuerdan"},
    "buscar": {"pret": "busqué buscaste buscó buscamos buscaron"},
    "oír": {
        "pres": "oigo oyes oye oímos oyen",
        "pret": "oí oíste oyó oímos oyeron",
        "fut": "oiré oirás oirá oiremos oirán",
        "ger": "oyendo",
    },
    "traer": {
        "pres": "traigo traes trae traemos traen",
        "pret": "traje trajiste trajo trajimos trajeron",
        "ger": "trayendo",
    },
    "seguir": {
        "pres": "sigo sigues sigue seguimos siguen",
        "pret": "seguí seguiste siguió seguimos siguieron",
        "ger": "siguiendo",
    },
    "perseguir": {
        "pres": "persigo persigues persigue perseguimos persiguen",
        "pret": "perseguí perseguiste persiguió perseguimos persiguieron",
        "ger": "persiguiendo",
    },
    "abrazar": {"pret": "abracé abrazaste abrazó abrazamos abrazaron"},
}

# Regular endings by infinitive class, persons 0..4 (no vosotros).
_ENDINGS = {
    "ar": ("o as a amos an", "é aste ó amos aron", "ando"),
    "er": ("o es e emos en", "í iste ió imos ieron", "iendo"),
    "ir": ("o es e imos en", "í iste ió imos ieron", "iendo"),
}
_FUTURE_ENDINGS = ("é", "ás", "á", "emos", "án")

# Copulas: tense -> persons. English "was" is rendered with the imperfect.
_SER = {
    "pres": ("soy", "eres", "es", "somos", "son"),
    "past": ("era", "eras", "era", "éramos", "eran"),
    "fut": ("seré", "serás", "será", "seremos", "serán"),
}
_ESTAR = {
    "pres": ("estoy", "estás", "está", "estamos", "están"),
    "past": ("estaba", "estabas", "estaba", "estábamos", "estaban"),
    "fut": ("estaré", "estarás", "estará", "estaremos", "estarán"),
}
_BE_PRES = ("am", "are", "is", "are", "are")
_BE_PAST = ("was", "were", "was", "were", "were")


class _Pronoun(NamedTuple):
    en: str
    es: str  # "" where Spanish drops the subject pronoun
    person: int
    fem: bool
    gendered: bool  # gender known from English (he/she), so adjectives agree


_SUBJECT_PRONOUNS = (
    _Pronoun("I", "", 0, False, False),
    _Pronoun("you", "", 1, False, False),
    _Pronoun("he", "él", 2, False, True),
    _Pronoun("she", "ella", 2, True, True),
    _Pronoun("we", "", 3, False, False),
    _Pronoun("they", "ellos", 4, False, False),
)
# English object pronoun -> (Spanish clitic, person).
_OBJECT_PRONOUNS = (
    ("me", "me", 0),
    ("you", "te", 1),
    ("him", "lo", 2),
    ("her", "la", 2),
    ("us", "nos", 3),
    ("them", "los", 4),
)

# Determiner -> Spanish forms indexed by 2 * plural + feminine
# (None: not used with that number).
_DETERMINERS = {
    "the": ("el", "la", "los", "las"),
    "a": ("un", "una", None, None),
    "some": (None, None, "unos", "unas"),
    "this": ("este", "esta", None, None),
    "these": (None, None, "estos", "estas"),
    "my": ("mi", "mi", "mis", "mis"),
    "your": ("tu", "tu", "tus", "tus"),
    "our": ("nuestro", "nuestra", "nuestros", "nuestras"),
    "": ("", "", "", ""),  # bare mass noun: "milk" -> "leche"
}
_NUMBERS = dict(
    zip(
        "two three four five six seven eight nine ten".split(),
        "dos tres cuatro cinco seis siete ocho nueve diez".split(),
    )
)
_NUMBER_WORDS = tuple(_NUMBERS)
for _en, _es in _NUMBERS.items():
    _DETERMINERS[_en] = (None, None, _es, _es)

# Weighted draws are made by uniform choice from tuples with repeats.
_SINGULAR_DETS = ("the",) * 10 + ("a",) * 4 + ("this",) * 2 + ("my", "your", "our")
_PLURAL_DETS = ("the",) * 8 + ("some",) * 3 + ("these",) * 2 + ("my", "your", "our") + (
    "NUMBER",
) * 3
_MASS_DETS = ("the",) * 4 + ("",) * 3 + ("this", "my", "your", "our")
_PP_DETS = ("the",) * 8 + ("a", "this", "my", "your", "our")


class _Preposition(NamedTuple):
    en: str
    es: str
    cats: str  # categories / tags of the nouns it takes


_LOCATIVE_PREPS = (
    _Preposition("in", "en", "pi"),
    _Preposition("in", "en", "pi"),
    _Preposition("near", "cerca de", "pu"),
    _Preposition("behind", "detrás de", "pu"),
    _Preposition("under", "debajo de", "u"),
    _Preposition("in front of", "delante de", "pu"),
    _Preposition("next to", "al lado de", "puhn"),
    _Preposition("on", "sobre", "o"),
)
_HOME_PREPS = (  # where one lives
    _Preposition("in", "en", "p"),
    _Preposition("near", "cerca de", "p"),
)
_COMPANION_PREPS = (
    _Preposition("with", "con", "hn"),
    _Preposition("with", "con", "hn"),
    _Preposition("without", "sin", "hn"),
)
_DIRECTION_PREPS = (
    _Preposition("to", "a", "p"),
    _Preposition("to", "a", "p"),
    _Preposition("from", "de", "p"),
    _Preposition("toward", "hacia", "p"),
)

_FREQUENCY = {"always": "siempre", "sometimes": "a veces", "never": "nunca"}
_FREQUENCY_BY_TENSE = {
    "pres": ("always", "sometimes", "never"),
    "past": ("never",),
    "fut": ("never",),
}

_TIME_ADVERBS = (
    # English, Spanish, tenses it goes with
    ("yesterday", "ayer", "past"),
    ("tomorrow", "mañana", "fut"),
    ("today", "hoy", "pres prog past fut"),
    ("now", "ahora", "pres prog"),
    ("every day", "todos los días", "pres"),
    ("every morning", "todas las mañanas", "pres"),
    ("at night", "por la noche", "pres past fut"),
    ("in the morning", "por la mañana", "pres past fut"),
    ("last week", "la semana pasada", "past"),
    ("last year", "el año pasado", "past"),
    ("next week", "la próxima semana", "fut"),
    ("next year", "el próximo año", "fut"),
)
# Time adverbs that still read well after always/sometimes/never.
_TIME_WITH_FREQUENCY = ("at night", "in the morning")

_ALL_TENSES = ("pres", "pres", "pres", "pres", "prog", "past", "past", "past", "fut", "fut")
_RELATIVE_TENSES = ("pres", "pres", "pres", "prog", "past", "past", "fut")


# ---------------------------------------------------------------------------
# Lexicon parsing and indexes (built once at import)
# ---------------------------------------------------------------------------


def _table_rows(table: str) -> Iterator[list[str]]:
    for line in table.strip().splitlines():
        yield [field.strip() for field in line.split("|")]


def _parse_nouns() -> tuple[_Noun, ...]:
    nouns = []
    for en, es, gender, cats in _table_rows(_NOUN_TABLE):
        en_sg, en_pl = en.split()
        es_sg, es_pl = es.split()
        nouns.append(_Noun(en_sg, en_pl, es_sg, es_pl, gender == "f", cats))
    return tuple(nouns)


def _parse_adjectives() -> tuple[_Adjective, ...]:
    return tuple(
        _Adjective(en, tuple(forms.split()), copula == "estar", cats)
        for en, forms, copula, cats in _table_rows(_ADJECTIVE_TABLE)
    )


def _spanish_forms(infinitive: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str]:
    """Present, preterite, future and gerund, applying _IRREGULAR overrides."""
    # "oír" conjugates like an -ir verb (its irregular forms are all listed).
    stem, kind = infinitive[:-2], infinitive[-2:].replace("í", "i")
    pres_endings, pret_endings, ger_ending = _ENDINGS[kind]
    irregular = _IRREGULAR.get(infinitive, {})

    def forms(tense: str, endings: str) -> tuple[str, ...]:
        if tense in irregular:
            return tuple(irregular[tense].split())
        return tuple(stem + ending for ending in endings.split())

    future = irregular.get("fut", " ".join(infinitive + e for e in _FUTURE_ENDINGS))
    return (
        forms("pres", pres_endings),
        forms("pret", pret_endings),
        tuple(future.split()),
        irregular.get("ger", stem + ger_ending),
    )


def _parse_verbs() -> tuple[_Verb, ...]:
    verbs = []
    for row in _table_rows(_VERB_TABLE):
        english, infinitive, subj, obj, flags = (row + [""])[:5]
        base, s3, past, ing = (form.replace("_", " ") for form in english.split())
        pres, pret, fut, ger = _spanish_forms(infinitive)
        verbs.append(
            _Verb(
                base, s3, past, ing, pres, pret, fut, ger, subj,
                "" if obj == "-" else obj,
                intransitive="i" in flags,
                motion="m" in flags,
                needs="loc" if "L" in flags else "dir" if "D" in flags else "",
                stative="s" in flags,
            )
        )
    return tuple(verbs)


_NOUNS = _parse_nouns()
_ADJECTIVES = _parse_adjectives()
_VERBS = _parse_verbs()
_NOUN_BY_EN = {n.en: n for n in _NOUNS}
_ADJECTIVE_BY_EN = {a.en: a for a in _ADJECTIVES}
_VERB_BY_EN = {v.base: v for v in _VERBS}

_ANIMATE = "hn"


def _nouns_with(cats: str) -> tuple[_Noun, ...]:
    return tuple(n for n in _NOUNS if any(c in n.cats for c in cats))


_NOUN_POOLS: dict[str, tuple[_Noun, ...]] = {}


def _pool(cats: str) -> tuple[_Noun, ...]:
    """Nouns having any of the category/tag letters in `cats` (memoised)."""
    if cats not in _NOUN_POOLS:
        _NOUN_POOLS[cats] = _nouns_with(cats)
    return _NOUN_POOLS[cats]


_PREDICATE_ADJECTIVES = {c: tuple(a for a in _ADJECTIVES if c in a.cats) for c in "hntfdp"}
_ADJECTIVES_FOR = {n: tuple(a for a in _ADJECTIVES if n.cats[0] in a.cats) for n in _NOUNS}
_INTRANSITIVE_FOR = {c: tuple(v for v in _VERBS if v.intransitive and c in v.subj) for c in _ANIMATE}
_TRANSITIVE_FOR = {c: tuple(v for v in _VERBS if v.obj and c in v.subj) for c in _ANIMATE}
# Verbs that can take each noun as direct object (for "the book that I find").
_VERBS_TAKING = {n: tuple(v for v in _VERBS if any(c in v.obj for c in n.cats)) for n in _NOUNS}
_TIME_FOR_TENSE = {
    tense: tuple((en, es) for en, es, tenses in _TIME_ADVERBS if tense in tenses.split())
    for tense in ("pres", "prog", "past", "fut")
}
_TIME_WITH_FREQ = tuple((en, es) for en, es, _ in _TIME_ADVERBS if en in _TIME_WITH_FREQUENCY)


# ---------------------------------------------------------------------------
# Rendering: explicit choices -> (English, Spanish). No randomness here.
# ---------------------------------------------------------------------------


class _Subject(NamedTuple):
    en: str
    es: str  # "" for a dropped pronoun
    person: int
    fem: bool
    plural: bool
    cats: str  # noun categories ("h" for pronouns)
    gendered: bool  # adjectives can agree with it


def _noun_phrase(noun: _Noun, det: str, plural: bool = False, adj: _Adjective | None = None) -> tuple[str, str]:
    """("the black cats", "los gatos negros"): Spanish adjectives follow the noun."""
    index = 2 * plural + noun.fem
    en = noun.en_pl if plural else noun.en
    es = noun.es_pl if plural else noun.es
    if adj is not None:
        en, es = f"{adj.en} {en}", f"{es} {adj.forms[index]}"
    if det:
        es_det = _DETERMINERS[det][index]
        if es_det is None:
            raise ValueError(f"determiner {det!r} does not go with plural={plural}")
        if det == "a" and en[0] in "aeiou":
            det = "an"
        en, es = f"{det} {en}", f"{es_det} {es}"
    return en, es


def _noun_subject(noun: _Noun, det: str, plural: bool = False, adj: _Adjective | None = None,
                  relative: tuple[str, str] | None = None) -> _Subject:
    en, es = _noun_phrase(noun, det, plural, adj)
    if relative is not None:
        en, es = f"{en} {relative[0]}", f"{es} {relative[1]}"
    return _Subject(en, es, 4 if plural else 2, noun.fem, plural, noun.cats[0], True)


def _pronoun_subject(pronoun: _Pronoun) -> _Subject:
    return _Subject(pronoun.en, pronoun.es, pronoun.person, pronoun.fem,
                    pronoun.person >= 3, "h", pronoun.gendered)


def _subject_relative(head: _Noun, predicate: tuple[str, str]) -> tuple[str, str]:
    """("that sees the cat", "que ve al gato"); "who" after people."""
    pronoun = "who" if head.cats[0] == "h" else "that"
    return f"{pronoun} {predicate[0]}", f"que {predicate[1]}"


def _object_relative(subject: _Subject, verb_group: tuple[str, str]) -> tuple[str, str]:
    """("that the dog sees", "que el perro ve"): the gap is the verb's object."""
    en, es = _join((subject.en, subject.es), verb_group)
    return f"that {en}", f"que {es}"


def _negation_or_frequency(neg: bool, freq: str | None) -> str:
    """The Spanish word(s) before the (clitic and) verb: "no ", "nunca "."""
    if neg:
        return "no "
    return f"{_FREQUENCY[freq]} " if freq else ""


def _verb_group(verb: _Verb, tense: str, person: int, neg: bool = False, freq: str | None = None,
                clitic: str = "") -> tuple[str, str]:
    """("does not see", "no lo ve"); an English object pronoun is added by the caller."""
    third = person == 2
    if tense == "pres":
        if neg:
            en = f"{'does' if third else 'do'} not {verb.base}"
        else:
            en = verb.s3 if third else verb.base
            en = f"{freq} {en}" if freq else en
        es = verb.pres[person]
    elif tense == "prog":
        en = f"{_BE_PRES[person]}{' not' if neg else ''} {verb.ing}"
        es = f"{_ESTAR['pres'][person]} {verb.ger}"
    elif tense == "past":
        en = f"did not {verb.base}" if neg else f"{freq} {verb.past}" if freq else verb.past
        es = verb.pret[person]
    else:  # "fut"
        en = f"will {'not ' if neg else ''}{freq + ' ' if freq else ''}{verb.base}"
        es = verb.fut[person]
    if clitic:
        es = f"{clitic} {es}"
    return en, _negation_or_frequency(neg, freq) + es


def _copula(estar: bool, tense: str, person: int, neg: bool = False, freq: str | None = None) -> tuple[str, str]:
    """("is not", "no está"); English "was" is the Spanish imperfect."""
    if tense == "fut":
        en = f"will {'not ' if neg else ''}{freq + ' ' if freq else ''}be"
    else:
        en = (_BE_PAST if tense == "past" else _BE_PRES)[person]
        en = f"{en} not" if neg else f"{en} {freq}" if freq else en
    es = (_ESTAR if estar else _SER)[tense][person]
    return en, _negation_or_frequency(neg, freq) + es


def _prepositional(prep: _Preposition, noun_phrase: tuple[str, str]) -> tuple[str, str]:
    return f"{prep.en} {noun_phrase[0]}", f"{prep.es} {noun_phrase[1]}"


def _direct_object(noun: _Noun, noun_phrase: tuple[str, str]) -> tuple[str, str]:
    """Animate direct objects take the personal "a" ("ve al gato")."""
    if noun.cats[0] in _ANIMATE:
        return noun_phrase[0], f"a {noun_phrase[1]}"
    return noun_phrase


def _join(*parts: tuple[str, str]) -> tuple[str, str]:
    """Concatenate (en, es) parts, skipping empty sides (dropped pronouns)."""
    en, es = parts[0]
    for part_en, part_es in parts[1:]:
        if part_en:
            en = f"{en} {part_en}" if en else part_en
        if part_es:
            es = f"{es} {part_es}" if es else part_es
    return en, es


def _and_es(next_words: str) -> str:
    """Spanish "y" becomes "e" before an /i/ sound ("e iré", but "y hielo")."""
    if next_words[:1] == "i" or (next_words[:2] == "hi" and next_words[2:3] not in "aeou"):
        return "e"
    return "y"


def _connect(first: tuple[str, str], connector: str, second: tuple[str, str]) -> tuple[str, str]:
    """Join two clauses: "X because Y", "X, but Y"."""
    es = {"because": "porque", "but": "pero", "although": "aunque", "when": "cuando",
          "while": "mientras", "if": "si"}.get(connector) or _and_es(second[1])
    comma = "," if connector == "but" else ""
    return f"{first[0]}{comma} {connector} {second[0]}", f"{first[1]}{comma} {es} {second[1]}"


def _front(connector: str, subordinate: tuple[str, str], main: tuple[str, str]) -> tuple[str, str]:
    """Fronted subordinate clause: "When Y, X"."""
    es = {"when": "cuando", "while": "mientras", "if": "si", "although": "aunque"}[connector]
    return f"{connector} {subordinate[0]}, {main[0]}", f"{es} {subordinate[1]}, {main[1]}"


def _sentence(en: str, es: str) -> tuple[str, str]:
    """Contract "a el"/"de el", capitalise and add the final period."""
    es = es.replace(" a el ", " al ").replace(" de el ", " del ")
    return f"{en[0].upper()}{en[1:]}.", f"{es[0].upper()}{es[1:]}."


# ---------------------------------------------------------------------------
# Sampling: random choices, rendered with the functions above.
# ---------------------------------------------------------------------------


def _pick(rng: random.Random, seq):
    """Uniform choice; several times faster than rng.choice on short tuples."""
    return seq[int(rng.random() * len(seq))]


def _sample_np_choices(rng: random.Random, noun: _Noun, adj_p: float = 0.35,
                       dets: tuple[str, ...] = _SINGULAR_DETS) -> tuple[str, bool, _Adjective | None]:
    """Determiner, number and adjective for a noun phrase headed by `noun`."""
    # The hottest function of the generator, hence the inlined _pick calls.
    rand = rng.random
    if "M" in noun.cats:
        plural, det = False, _MASS_DETS[int(rand() * len(_MASS_DETS))]
    elif rand() < 0.35:
        plural, det = True, _PLURAL_DETS[int(rand() * len(_PLURAL_DETS))]
        if det == "NUMBER":
            det = _NUMBER_WORDS[int(rand() * len(_NUMBER_WORDS))]
    else:
        plural, det = False, dets[int(rand() * len(dets))]
    adjectives = _ADJECTIVES_FOR[noun]
    adj = adjectives[int(rand() * len(adjectives))] if adjectives and rand() < adj_p else None
    return det, plural, adj


def _sample_pp(rng: random.Random, preps: tuple[_Preposition, ...]) -> tuple[str, str]:
    prep = _pick(rng, preps)
    noun = _pick(rng, _pool(prep.cats))
    return _prepositional(prep, _noun_phrase(noun, *_sample_np_choices(rng, noun, 0.2, _PP_DETS)))


def _sample_optional_pp(rng: random.Random, verb: _Verb, p: float) -> tuple[str, str]:
    """Where/with whom/whither the action happens, or ("", "")."""
    if verb.needs == "dir":
        return _sample_pp(rng, _DIRECTION_PREPS[:2] + _DIRECTION_PREPS[3:])  # to/toward
    if verb.needs == "loc":
        return _sample_pp(rng, _HOME_PREPS)
    if rng.random() >= p:
        return "", ""
    r = rng.random()
    if verb.motion and r < 0.5:
        return _sample_pp(rng, _DIRECTION_PREPS)
    return _sample_pp(rng, _COMPANION_PREPS if r > 0.8 else _LOCATIVE_PREPS)


def _sample_modifiers(rng: random.Random, tense: str) -> tuple[bool, str | None]:
    """Negation ("not") or a frequency adverb ("always"), or neither."""
    r = rng.random()
    if r < 0.12:
        return True, None
    if r < 0.22 and tense in _FREQUENCY_BY_TENSE:
        return False, _pick(rng, _FREQUENCY_BY_TENSE[tense])
    return False, None


def _sample_relative(rng: random.Random, noun: _Noun, plural: bool) -> tuple[str, str]:
    """A relative clause on `noun`: subject gap ("that sees the cat") or object gap."""
    if rng.random() < 0.35 and _VERBS_TAKING[noun]:
        verb = _pick(rng, _VERBS_TAKING[noun])
        subject = _sample_subject(rng, verb.subj, rel_p=0.0, pronoun_p=0.4)
        tense = _pick(rng, _RELATIVE_TENSES)
        if tense == "prog" and verb.stative:
            tense = "pres"
        neg, freq = _sample_modifiers(rng, tense)
        return _object_relative(subject, _verb_group(verb, tense, subject.person, neg, freq))
    head = _Subject("", "", 4 if plural else 2, noun.fem, plural, noun.cats[0], True)
    predicate = _sample_predicate(rng, head, _pick(rng, _RELATIVE_TENSES), rel_p=0.0, pp_p=0.3)
    return _subject_relative(noun, predicate)


def _sample_subject(rng: random.Random, cats: str = _ANIMATE, rel_p: float = 0.1,
                    pronoun_p: float = 0.25) -> _Subject:
    """A pronoun or a noun phrase (maybe with a relative clause) of categories `cats`."""
    if "h" in cats and rng.random() < pronoun_p:
        return _pronoun_subject(_pick(rng, _SUBJECT_PRONOUNS))
    noun = _pick(rng, _pool(cats))
    det, plural, adj = _sample_np_choices(rng, noun)
    relative = _sample_relative(rng, noun, plural) if rng.random() < rel_p else None
    return _noun_subject(noun, det, plural, adj, relative)


def _sample_object(rng: random.Random, verb: _Verb, subject: _Subject, rel_p: float) -> tuple[tuple[str, str], str]:
    """Direct object as ((English, Spanish), Spanish clitic); clitics go before the verb."""
    if "h" in verb.obj and rng.random() < 0.15:
        en, clitic, person = _pick(rng, _OBJECT_PRONOUNS)
        # Avoid reflexive readings ("I see me", "you see you", "we see me").
        if not ({person, subject.person} <= {0, 3} or person == subject.person == 1):
            return (en, ""), clitic
    noun = _pick(rng, _pool(_pick(rng, verb.obj)))
    det, plural, adj = _sample_np_choices(rng, noun)
    phrase = _noun_phrase(noun, det, plural, adj)
    if rng.random() < rel_p:
        rel = _sample_relative(rng, noun, plural)
        phrase = (f"{phrase[0]} {rel[0]}", f"{phrase[1]} {rel[1]}")
    return _direct_object(noun, phrase), ""


def _sample_copula_predicate(rng: random.Random, subject: _Subject, tense: str) -> tuple[str, str]:
    """ "is tired" / "is in the garden" (estar) / "is black" (ser)."""
    tense = "pres" if tense == "prog" else tense
    neg, freq = _sample_modifiers(rng, tense)
    adjectives = _PREDICATE_ADJECTIVES[subject.cats]
    adj = _pick(rng, adjectives) if subject.gendered and adjectives and rng.random() < 0.55 else None
    # Skip "the strong mice are strong".
    if adj is not None and f" {adj.en} " not in f" {subject.en} ":
        copula = _copula(adj.estar, tense, subject.person, neg, freq)
        return _join(copula, (adj.en, adj.forms[2 * subject.plural + subject.fem]))
    copula = _copula(True, tense, subject.person, neg, freq)
    preps = _COMPANION_PREPS if rng.random() < 0.15 else _LOCATIVE_PREPS
    return _join(copula, _sample_pp(rng, preps))


def _sample_predicate(rng: random.Random, subject: _Subject, tense: str, rel_p: float,
                      pp_p: float = 0.55) -> tuple[str, str]:
    """Everything after the subject: verb group, object, prepositional phrase."""
    r = rng.random()
    cats = subject.cats if subject.cats in _ANIMATE else None
    if cats is None or r < 0.2:
        return _sample_copula_predicate(rng, subject, tense)
    transitive = r >= 0.55
    verb = _pick(rng, (_TRANSITIVE_FOR if transitive else _INTRANSITIVE_FOR)[cats])
    if tense == "prog" and verb.stative:
        tense = "pres"
    neg, freq = _sample_modifiers(rng, tense)
    if not transitive:
        return _join(_verb_group(verb, tense, subject.person, neg, freq), _sample_optional_pp(rng, verb, pp_p))
    obj, clitic = _sample_object(rng, verb, subject, rel_p)
    verb_group = _verb_group(verb, tense, subject.person, neg, freq, clitic)
    return _join(verb_group, (obj[0], "" if clitic else obj[1]), _sample_optional_pp(rng, verb, pp_p * 0.4))


def _sample_clause(rng: random.Random, tenses: tuple[str, ...], rel_p: float, time_p: float) -> tuple[str, str]:
    tense = _pick(rng, tenses)
    subject = _sample_subject(rng, rel_p=rel_p)
    predicate = _sample_predicate(rng, subject, tense, rel_p)
    parts = [(subject.en, subject.es), predicate]
    if rng.random() < time_p:
        # A "prog" predicate may have become "pres" (stative verb, copula);
        # the adverbs allowed with "prog" suit "pres" too.
        has_freq = any(f" {w} " in f" {predicate[0]} " for w in _FREQUENCY)
        parts.append(_pick(rng, _TIME_WITH_FREQ if has_freq else _TIME_FOR_TENSE[tense]))
    return _join(*parts)


# Connector -> (tenses of the main clause, tenses of the subordinate clause
# given the main tense). "when" and "while" keep the indicative in Spanish
# only for present/past events; "if" takes a present-tense condition.
_CONNECTORS = ("because", "because", "and", "and", "but", "although", "when", "when", "while", "if")
_FRONTABLE = ("when", "when", "while", "if", "if", "although")


def _connector_tenses(connector: str, rng: random.Random) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if connector == "when":
        main = _pick(rng, ("pres", "past"))
        return (main,), (("pres", "pres", "prog") if main == "pres" else ("past",))
    if connector == "while":
        return ("pres", "prog"), ("pres", "prog")
    if connector == "if":
        return ("pres", "fut", "fut"), ("pres",)
    return _ALL_TENSES, _ALL_TENSES


def _sample_sentence(rng: random.Random) -> tuple[str, str]:
    r = rng.random()
    if r < 0.5:
        return _sentence(*_sample_clause(rng, _ALL_TENSES, rel_p=0.18, time_p=0.3))
    connector = _pick(rng, _FRONTABLE if r > 0.85 else _CONNECTORS)
    main_tenses, sub_tenses = _connector_tenses(connector, rng)
    main = _sample_clause(rng, main_tenses, rel_p=0.06, time_p=0.1)
    sub = _sample_clause(rng, sub_tenses, rel_p=0.06, time_p=0.1)
    if r > 0.85:
        return _sentence(*_front(connector, sub, main))
    return _sentence(*_connect(main, connector, sub))


def _stream(seed: int) -> Iterator[tuple[str, str]]:
    """Endless (english, spanish) pairs with 4..25 English words, deterministic in seed."""
    rng = random.Random(seed)
    while True:
        en, es = _sample_sentence(rng)
        if _MIN_WORDS <= en.count(" ") + 1 <= _MAX_WORDS:
            yield en, es


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if value > _MAX_SPLIT_SIZE:
        raise ValueError(f"{name}={value} is more than the built-in grammar supplies "
                         f"(at most {_MAX_SPLIT_SIZE} pairs per split)")
    return value


def generate_pairs(num_pairs: int, seed: int) -> list[tuple[str, str]]:
    """(english, spanish) pairs, deterministic in seed; may contain duplicates."""
    if isinstance(num_pairs, bool) or not isinstance(num_pairs, int) or num_pairs < 0:
        raise ValueError(f"num_pairs must be a non-negative int, got {num_pairs!r}")
    return list(itertools.islice(_stream(seed), num_pairs))


def _split_and_key(english: str) -> tuple[str, int]:
    """Stable split of an English sentence (independent of seed and sizes), and its 64-bit hash, which
    stands for the sentence when duplicates are dropped (a set of ints takes far less memory than a set
    of the sentences; a collision among 10M sentences has odds of about 3e-6)."""
    key = int.from_bytes(hashlib.blake2b(english.encode(), digest_size=8).digest(), "little")
    bucket = key % _HASH_BUCKETS
    if bucket in _TEST_BUCKETS:
        return "test", key
    return ("valid" if bucket in _VALID_BUCKETS else "train"), key


def builtin_split(split: str, *, seed: int = 0, train_size: int = 100_000, valid_size: int = 1_000,
                  test_size: int = 1_000, source_lang: str = "en", target_lang: str = "es") -> list[tuple[str, str]]:
    """(source, target) pairs of one split.

    Splits are disjoint: no English sentence (and so no pair) appears in two
    splits; within a split no duplicates either. Deterministic for equal
    arguments. A sentence's split depends only on the sentence (a stable
    hash), so each split depends only on `seed` and its own size: the valid
    and test splits stay the same when `train_size` changes, and a smaller
    split is a prefix of a larger one.

    Raises ValueError naming the bad value for an unknown split, a language
    pair other than en->es or es->en (es->en swaps each pair), or sizes the
    grammar cannot supply.
    """
    return list(iter_builtin_split(split, seed=seed, train_size=train_size, valid_size=valid_size,
                                   test_size=test_size, source_lang=source_lang, target_lang=target_lang))


def iter_builtin_split(split: str, *, seed: int = 0, train_size: int = 100_000, valid_size: int = 1_000,
                       test_size: int = 1_000, source_lang: str = "en",
                       target_lang: str = "es") -> Iterator[tuple[str, str]]:
    """The pairs of `builtin_split`, streamed (bad arguments raise at once, not at the first `next`)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if (source_lang, target_lang) not in (("en", "es"), ("es", "en")):
        from transformer.errors import ConfigError  # a setting the user chose: told as a message, no traceback
        raise ConfigError(f"unsupported language pair data.source_lang={source_lang!r} -> data.target_lang="
                          f"{target_lang!r}: the built-in corpus is en->es or es->en")
    sizes = {"train": _check_count("train_size", train_size),
             "valid": _check_count("valid_size", valid_size),
             "test": _check_count("test_size", test_size)}
    pairs = _collect_split(split, sizes[split], seed)
    return ((es, en) for en, es in pairs) if source_lang == "es" else pairs


def _collect_split(split: str, size: int, seed: int) -> Iterator[tuple[str, str]]:
    """The first `size` distinct pairs of the seed's stream that hash into `split`."""
    seen: set[int] = set()
    # Guard against a grammar that cannot supply enough distinct sentences:
    # a split gets 1/16 or more of the stream, and duplicates are rare.
    budget = 64 * size + 10_000
    for drawn, (en, es) in enumerate(_stream(seed)):
        if len(seen) >= size:
            break
        if drawn >= budget:
            raise ValueError(f"{split} size {size} is more than the built-in grammar supplies "
                             f"(found {len(seen)} distinct sentences)")
        where, key = _split_and_key(en)
        if where == split and key not in seen:
            seen.add(key)
            yield en, es
