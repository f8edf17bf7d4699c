"""Pairs whose preference can only be read against the prompt, and a tokenizer trained on them: the data of
``benchmarks/learning_vs_trl.py``.

    python benchmarks/learning_data.py --data single --out /tmp/pairs     # train.jsonl, eval.jsonl, tokenizer/; stats
    python benchmarks/learning_data.py --data multi --out /tmp/pairs_multi

**The task.** The human asks about one *subject* (an entity and an aspect of it: "what do otters eat?"); the chosen
answer answers that question and names the subject, the rejected one is the answer to another question drawn from
the same distribution (another entity, half the time of the same category, and its own aspect). Pairs come in
*twins*: ``(prompt about X, answer about X, answer about Y)`` and ``(prompt about Y, answer about Y, answer about X)``
with the very same two answer texts, so every answer text is chosen exactly as often as it is rejected, and an
answer-only model (bag of words, length, style) is at exactly 0.5: the answer is right only against the prompt.

**Variety.** 10 categories of 12 entities (``entities`` of each are used: 2 by default, 20 entities), 3 aspects
per category, 4 paraphrases of each question and 3 of each answer, question openers and closers, random details
drawn from per-category word pools.

**Lengths.** Long-tailed: log-normal counts of *topical* sentences (sentences that name the subject: the human's
context after the question, the answer's elaboration; ``topical_scale``) and, off by default, of *filler* sentences
that name no subject, built from a small grammar (``filler_scale``). Multi-turn prompts hold 2-6 earlier exchanges
(chit-chat, or earlier questions about other subjects with their right answers) before the final question, which
alone decides the preference; the prompt then carries most of the tokens, as in HH-RLHF. ``history_decay``: P(k
earlier exchanges) in proportion to ``history_decay ** (k - 2)`` (1: uniform over 2-6); ``history_scale`` scales the
topical sentences of the earlier exchanges (relative to ``topical_scale``, which then only sets the final exchange's);
``history_apart``: the earlier questions are about categories other than the final question's and the rejected
answer's; with ``distractor`` > 0 an earlier exchange is, with that probability, about the rejected answer's entity.
Every side is kept under
:data:`MAX_CHARS` characters, under 512 tokens with this tokenizer (``learning_vs_trl.py`` counts and prints any side
over ``max_length``).

**Why these defaults** (TRL's RewardTrainer, the 4 x 256 Mistral of ``learning_vs_trl.py``, lr 3e-4, 8 pairs a step,
400 steps, one seed each, eval accuracy; 2026-11-29). The loss sits at ln 2 until the model finds the prompt-answer
match, and every token that says nothing about the subject lengthens that plateau: 120 entities with filler 0.48;
40 entities, half the filler, 0.51; 40 entities, little filler, rejected from other categories only, 0.53.
A bare template set (20 one-word topics, "Tell me about X." / "X is a great topic.") reached 1.00 (0.98 at step
100); 0-3 filler sentences added to its answers: 0.51; 0-6 before its question: 0.73; 0-3 after its question and 0-4
topical ones in its answers: 0.78; 0-4 topical sentences in its answers alone: 0.99. Hence topical sentences for the
length spread and 20 entities: TRL 0.69 / 0.85 / 0.85 / 0.96 at steps 100-400 on the default single-turn data. The
plateau's end is a matter of luck as much as of the data: compare trainers over several ``--seeds``.

**Multi-turn defaults** (:data:`MULTI_DEFAULTS`: ``topical_scale`` 2, ``distractor`` 0, ``history_scale`` 0,
``history_decay`` 0.5, ``history_apart``; same run set-up, eval accuracy at step 400, 2026-11-29; "rm with TRL's
schedule" is rm with ``train.optim.lr_scheduler_type=linear train.optim.warmup_ratio=0.0``, since 30a4a23 its default, which gave the very accuracy and loss of TRL's run at
each seed where both ran, 0.724 / 0.5708 and 0.516 / 0.6931 at seeds 1 / 2, so it stood in for TRL at a third of the
time). The first multi-turn set (``topical_scale`` 1, ``distractor`` 0.25, ``history_scale`` 1, uniform 2-6
exchanges; median side 259 tokens) stayed at ln 2 (TRL, seed 1: 0.520). No distractor, earlier exchanges without
topical sentences, 2-6 of them weighted 0.5 ** (k - 2) (median 154): 0.724 / 0.516 at seeds 1 / 2 (TRL); with the
earlier questions of other categories (``history_apart``): 0.512 / 0.617 (rm with TRL's schedule); on seed 2, each
on top of that: rejected answers of other categories only 0.667; 1 entity a category 0.498; ``history_decay`` 0.25
(median 141) 0.569; ``topical_scale`` 2 (the final question and the answers name their subject more often; median 175): 0.893,
then 0.851 / 0.847 at seeds 1 / 3 (0.63 / 0.62 / 0.68 at step 200 on seeds 1 / 3 / 2). The earlier exchanges act as
the filler above (they name no subject of the pair), and more mentions of the subject in the final exchange
shorten the plateau more than fewer or shorter earlier exchanges do. Single-turn data keeps ``topical_scale`` 1
(:data:`SINGLE_DEFAULTS`).

**Held out.** Each (entity, aspect, question paraphrase) and each (entity, aspect, answer paraphrase) combination
belongs to train or eval by a hash (about 1 in 5 to eval); eval pairs use eval combinations only, so every eval
(question, answer) pairing is unseen in training, while every entity is seen (in other paraphrases).

Deterministic: the same ``seed`` gives the same files in any process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

MAX_CHARS = 1900  # per side (prompt + answer); ~4.3 characters a token with this BPE: under 460 tokens
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")  # ids 0-3, rm's own BPE's order
STYLES = {"bos": "<s> $A", "bos_eos": "<s> $A </s>"}  # post-processors: Llama/Mistral-style, and BOS + EOS
EVAL_BUCKET = 5  # 1 in 5 combinations goes to eval
# The knobs whose default depends on the data kind (the module doc's "Multi-turn defaults"); single-turn data has no
# earlier exchanges, so only its topical_scale matters.
SINGLE_DEFAULTS = {"topical_scale": 1.0, "distractor": 0.0, "history_scale": 1.0, "history_decay": 1.0,
                   "history_apart": False}
MULTI_DEFAULTS = {"topical_scale": 2.0, "distractor": 0.0, "history_scale": 0.0, "history_decay": 0.5,
                  "history_apart": True}


def data_knobs(kind: str, **given) -> dict:
    """The kind's defaults (:data:`SINGLE_DEFAULTS`, :data:`MULTI_DEFAULTS`), overridden by the ``given`` knobs that
    are not None."""
    defaults = MULTI_DEFAULTS if kind == "multi" else SINGLE_DEFAULTS
    unknown = set(given) - set(defaults)
    if unknown:
        raise TypeError(f"unknown data knobs {sorted(unknown)}")
    return {k: v if given.get(k) is None else given[k] for k, v in defaults.items()}

# category: (entities, {aspect: (question paraphrases, answer paraphrases)}, detail pool)
# "{e}" is the entity, "{d1}", "{d2}", "{d3}" details drawn from the category's pool.
CATEGORIES: Dict[str, Tuple[List[str], Dict[str, Tuple[List[str], List[str]]], List[str]]] = {
    "animal": (
        ["otters", "herons", "badgers", "octopuses", "penguins", "giraffes", "hedgehogs", "owls", "salmon", "beavers",
         "koalas", "wolves"],
        {"diet": (["what do {e} eat", "what is the usual diet of {e}", "what kind of food do {e} need",
                   "how do {e} find their food"],
                  ["{E} mostly eat {d1} and {d2}, and now and then {d3}.",
                   "In the wild {e} live on {d1}, with {d2} when they can find it.",
                   "The diet of {e} is mainly {d1}; young {e} also take {d2}."]),
         "habitat": (["where do {e} live", "what kind of place do {e} live in", "where could I see {e} in the wild",
                      "what habitat suits {e} best"],
                     ["{E} live near {d1}, usually close to {d2}.",
                      "You will find {e} around {d1} and sometimes by {d2}.",
                      "The natural home of {e} is {d1}, where they shelter among {d2}."]),
         "lifespan": (["how long do {e} live", "what is the lifespan of {e}", "how old can {e} get",
                       "do {e} live for a long time"],
                      ["{E} usually live about {n} years, longer when they avoid {d1}.",
                       "A healthy adult of the {e} can reach {n} years; {d1} shortens that.",
                       "Most {e} live around {n} years in the wild and a little more in care."])},
        ["fish", "insects", "berries", "small frogs", "roots", "seeds", "shellfish", "worms", "leaves", "grasses",
         "rivers", "reed beds", "cliffs", "old forests", "coastal rocks", "meadows", "hollow trees", "icy shores",
         "hunters", "harsh winters", "disease", "traffic"]),
    "city": (
        ["Lisbon", "Oslo", "Nairobi", "Kyoto", "Lima", "Montreal", "Krakow", "Hanoi", "Seville", "Glasgow",
         "Cairo", "Perth"],
        {"sights": (["what should I see in {e}", "what are the best sights in {e}", "what is worth visiting in {e}",
                     "I have two days in {e}, where should I go"],
                    ["In {e}, start with {d1} and then walk to {d2}.",
                     "Visitors to {e} love {d1}; if you have time, see {d2} too.",
                     "The highlights of {e} are {d1}, {d2} and the area around {d3}."]),
         "weather": (["what is the weather like in {e}", "when is the best time to visit {e}",
                      "how warm does {e} get in summer", "does it rain a lot in {e}"],
                     ["{E} is mild in spring; summers reach about {n} degrees and {d1} is common.",
                      "The best months for {e} are in spring, when it is around {n} degrees.",
                      "Expect {d1} in {e}, with summer days near {n} degrees."]),
         "food": (["what food is {e} known for", "what should I eat in {e}", "what are the local dishes of {e}",
                   "where can I find good food in {e}"],
                  ["{E} is famous for {d2}; try it near {d1}.",
                   "In {e} you should eat {d2}, best from the stalls by {d1}.",
                   "Food in {e} means {d2} and {d3}, served all over the old town."])},
        ["the old harbour", "the cathedral", "the central market", "the castle", "the river walk", "the botanical garden",
         "the museum quarter", "the hill park", "morning fog", "light rain", "sea breezes", "dry heat",
         "grilled fish", "street noodles", "spiced stew", "sweet pastries", "fresh bread", "rice dishes"]),
    "food": (
        ["sourdough bread", "risotto", "kimchi", "lasagna", "falafel", "paella", "pancakes", "ramen", "hummus",
         "goulash", "dumplings", "granola"],
        {"recipe": (["how do I make {e}", "what is a simple recipe for {e}", "can you walk me through making {e}",
                     "what do I need to cook {e} at home"],
                    ["For {e}, combine {d1} with {d2}, then cook it slowly for about {n} minutes.",
                     "To make {e} you need {d1}, {d2} and a little {d3}; it takes about {n} minutes.",
                     "Good {e} starts with {d1}; add {d2} and let it rest for {n} minutes."]),
         "storage": (["how long does {e} keep", "how should I store {e}", "can I freeze {e}",
                      "how do I keep {e} fresh"],
                     ["{E} keeps for about {n} days in a sealed box, away from {d1}.",
                      "Store {e} in the fridge for up to {n} days; it also freezes well next to {d1}.",
                      "Wrapped well, {e} lasts {n} days; keep it away from {d1}."]),
         "origin": (["where does {e} come from", "what is the history of {e}", "who first made {e}",
                     "is {e} a traditional dish"],
                    ["{E} comes from a long tradition of home cooking built on {d1}.",
                     "The history of {e} goes back centuries, when cooks had only {d1} and {d2}.",
                     "{E} began as simple food made from {d1} and became popular everywhere."])},
        ["flour", "rice", "chickpeas", "cabbage", "onions", "garlic", "olive oil", "butter", "eggs", "stock", "oats",
         "paprika", "salt", "warm spots", "direct sunlight", "moisture", "strong smells"]),
    "instrument": (
        ["the violin", "the cello", "the banjo", "the harp", "the trumpet", "the accordion", "the clarinet",
         "the ukulele", "the drums", "the flute", "the saxophone", "the piano"],
        {"learning": (["how hard is it to learn {e}", "how do I start learning {e}", "can an adult learn {e}",
                       "how long does it take to get good at {e}"],
                      ["Learning {e} takes patience; practise {d1} for {n} minutes a day.",
                       "Start {e} with {d1}, then move on to {d2} after a few weeks.",
                       "Adults learn {e} well; focus on {d1} and {d2} for the first months."]),
         "care": (["how do I look after {e}", "how should I clean {e}", "how do I store {e}",
                   "what maintenance does {e} need"],
                  ["Keep {e} away from {d3} and check {d2} every few weeks.",
                   "Wipe {e} after playing and store it away from {d3}.",
                   "Caring for {e} means watching {d2} and avoiding {d3}."]),
         "history": (["what is the history of {e}", "how old is {e}", "where was {e} invented",
                      "who made {e} popular"],
                     ["{E} has a history of several centuries and changed a lot with {d1}.",
                      "The first version of {e} was simpler; {d1} shaped it into what we play today.",
                      "{E} became popular through {d1} and later {d2}."])},
        ["scales", "simple songs", "breathing exercises", "finger drills", "rhythm work", "reading music",
         "the strings", "the pads", "the reeds", "the tuning", "damp rooms", "direct heat", "folk musicians",
         "touring bands", "church music", "radio"]),
    "sport": (
        ["tennis", "rowing", "fencing", "cricket", "curling", "badminton", "archery", "surfing", "judo",
         "volleyball", "golf", "climbing"],
        {"rules": (["what are the basic rules of {e}", "how does scoring work in {e}", "how do you win at {e}",
                    "can you explain {e} to a beginner"],
                   ["In {e} you score by {d1}, and a match usually lasts {n} minutes.",
                    "The rules of {e} are simple: {d1}, and avoid {d2}.",
                    "A game of {e} is won by {d1}; fouls include {d2}."]),
         "gear": (["what equipment do I need for {e}", "what should I buy to start {e}", "is {e} expensive to start",
                   "what gear is used in {e}"],
                  ["For {e} you need {d3} and comfortable clothes; expect to spend about {n} dollars.",
                   "Starting {e} costs around {n} dollars for {d3}.",
                   "The only real gear for {e} is {d3}, which clubs often lend."]),
         "fitness": (["is {e} good exercise", "what muscles does {e} train", "how fit do I need to be for {e}",
                      "is {e} safe for older people"],
                     ["{E} trains the legs and shoulders and burns about {n} calories an hour.",
                      "{E} is good exercise for balance; warm up to avoid {d2}.",
                      "Anyone can try {e}; build up slowly to avoid {d2}."])},
        ["reaching the target first", "landing it in the zone", "getting the most points", "touching the opponent",
         "strained wrists", "sore backs", "twisted ankles", "a racket", "a board", "a bow", "a mat", "shoes",
         "a helmet", "gloves"]),
    "plant": (
        ["tulips", "basil", "ferns", "bamboo", "orchids", "tomatoes", "lavender", "cacti", "roses", "mint",
         "sunflowers", "ivy"],
        {"watering": (["how often should I water {e}", "how much water do {e} need", "am I overwatering my {e}",
                       "what is the right way to water {e}"],
                      ["Water {e} about every {n} days and let the soil dry between waterings.",
                       "{E} like {d1}; water them when the top of the soil is dry, roughly every {n} days.",
                       "Give {e} a deep drink every {n} days, less in winter."]),
         "light": (["how much sun do {e} need", "can I grow {e} indoors", "where should I put my {e}",
                    "do {e} like shade"],
                   ["{E} want {d2} for about {n} hours a day.",
                    "Grow {e} in {d2}; indoors, a bright window works.",
                    "Place {e} where they get {d2}, away from {d3}."]),
         "pests": (["what pests attack {e}", "why are my {e} dying", "what is wrong with my {e}",
                    "how do I keep bugs off my {e}"],
                   ["{E} are often hit by {d3}; wash the leaves and remove damaged parts.",
                    "The usual trouble for {e} is {d3}, which a mild soap spray controls.",
                    "If your {e} look weak, check for {d3} under the leaves."])},
        ["moist soil", "dry soil", "full sun", "partial shade", "bright indirect light", "cold drafts", "heaters",
         "aphids", "spider mites", "slugs", "root rot", "mildew"]),
    "craft": (
        ["knitting", "pottery", "woodworking", "origami", "calligraphy", "photography", "embroidery", "welding",
         "bookbinding", "glassblowing", "quilting", "leatherwork"],
        {"start": (["how do I get started with {e}", "is {e} hard for a beginner", "what is a good first project in {e}",
                    "where can I learn {e}"],
                   ["A good first project in {e} is {d1}; a local class helps a lot.",
                    "Begin {e} with {d1} and practise for {n} hours a week.",
                    "Most people start {e} at a community workshop making {d1}."]),
         "tools": (["what tools do I need for {e}", "what should I buy to start {e}", "how much does {e} cost",
                    "what supplies does {e} need"],
                   ["For {e} you need {d2}; a starter set costs about {n} dollars.",
                    "The basic kit for {e} is {d2} and a quiet place to work.",
                    "Buy {d2} for {e} first; it costs around {n} dollars."]),
         "safety": (["is {e} dangerous", "how do I stay safe doing {e}", "what are the risks of {e}",
                     "do I need protective gear for {e}"],
                    ["{E} is safe if you use {d3} and keep the workspace tidy.",
                     "The main risk in {e} is carelessness; always use {d3}.",
                     "Stay safe in {e} with {d3} and good ventilation."])},
        ["a small bowl", "a simple scarf", "a paper crane", "a photo walk", "a cutting board", "a notebook",
         "needles and yarn", "clay and a wheel", "a saw and clamps", "good paper", "a camera", "goggles",
         "gloves", "a mask", "a fire blanket"]),
    "planet": (
        ["Mars", "Jupiter", "Saturn", "Venus", "Mercury", "Neptune", "Uranus", "the Moon", "Pluto", "Titan",
         "Europa", "Io"],
        {"size": (["how big is {e}", "what is the size of {e}", "is {e} larger than the Earth",
                   "how heavy is {e}"],
                  ["{E} is about {n} thousand kilometres across, with {d1}.",
                   "The diameter of {e} is roughly {n} thousand kilometres.",
                   "{E} measures about {n} thousand kilometres and has {d1}."]),
         "surface": (["what is the surface of {e} like", "could people walk on {e}", "what is {e} made of",
                      "what would I see on {e}"],
                     ["The surface of {e} is covered with {d2} and {d3}.",
                      "On {e} you would find {d2}, under {d1}.",
                      "{E} is made mostly of rock and ice, with {d2} on top."]),
         "visit": (["has anyone been to {e}", "have we sent probes to {e}", "could we travel to {e}",
                    "how long would it take to reach {e}"],
                   ["Probes have studied {e}; a trip there takes about {n} months.",
                    "Reaching {e} would take {n} months with today's rockets.",
                    "Several missions have flown past {e}, the first about {n} years ago."])},
        ["a thin atmosphere", "thick clouds", "strong winds", "red dust", "deep craters", "frozen plains",
         "volcanoes", "ice cracks", "sulphur plumes"]),
    "language": (
        ["Python", "Rust", "Haskell", "Java", "Go", "Ruby", "Fortran", "Kotlin", "Lua", "Erlang", "Swift", "Perl"],
        {"use": (["what is {e} used for", "what kind of projects is {e} good for", "why would I pick {e}",
                  "who uses {e}"],
                 ["{E} is used for {d1} and {d2}.",
                  "People pick {e} for {d1}; it also shines in {d2}.",
                  "Teams use {e} mostly for {d1}."]),
         "learn": (["is {e} easy to learn", "how do I start learning {e}", "how long does it take to learn {e}",
                    "what is the best book for {e}"],
                   ["{E} takes about {n} weeks to learn well; start with {d3}.",
                    "Begin {e} with {d3} and write small programs every day.",
                    "Most people learn {e} in {n} weeks by building {d3}."]),
         "speed": (["is {e} fast", "how fast is {e}", "is {e} slow compared to others",
                    "can {e} handle heavy workloads"],
                   ["{E} is fast enough for {d1}, and its tools make it faster.",
                    "Programs in {e} run quickly when written with care; {d1} is a common use.",
                    "{E} handles heavy loads well, which is why it is used for {d1}."])},
        ["web servers", "data analysis", "games", "embedded devices", "telecom systems", "scripting",
         "scientific computing", "mobile apps", "small command line tools", "the official tutorial", "toy projects"]),
    "job": (
        ["nurses", "electricians", "pilots", "librarians", "plumbers", "architects", "chefs", "firefighters",
         "teachers", "farmers", "dentists", "translators"],
        {"training": (["how do I become one of the {e}", "what training do {e} need", "how long does it take to train as one of the {e}",
                       "what qualifications do {e} have"],
                      ["Training for {e} takes about {n} years and includes {d1}.",
                       "Most {e} study for {n} years, with {d1} along the way.",
                       "To join the {e} you need {d1} and a few years of practice."]),
         "day": (["what does a normal day look like for {e}", "what do {e} do all day", "are {e} busy",
                  "what hours do {e} work"],
                 ["A day for {e} is full of {d2}; shifts often last {n} hours.",
                  "{E} spend their days on {d2} and talking to people.",
                  "Most {e} work {n} hours a day, much of it on {d2}."]),
         "pay": (["how much do {e} earn", "is the pay good for {e}", "do {e} make a good living",
                  "what is the salary of {e}"],
                 ["{E} earn about {n} thousand dollars a year, more with {d3}.",
                  "Pay for {e} starts near {n} thousand dollars and grows with {d3}.",
                  "{E} make a steady living, about {n} thousand a year with {d3}."])},
        ["a formal course", "an apprenticeship", "exams", "practical placements", "paperwork", "meetings",
         "hands-on work", "experience", "extra certificates", "night shifts"]),
}

OPENERS = ["", "", "", "Hi! ", "Hello, ", "Quick question: ", "I was wondering, ", "Hey, ", "Sorry to bother you, but ",
           "My friend and I were arguing about this. ", "I have a question. ", "Can you help me? "]
CLOSERS = ["?", "?", "?", "? Thanks!", "? Thank you.", "? I'd love a short answer.", "? Any tips are welcome.",
           "? I'm curious."]
# An answer never starts with the entity: "Otters" and " otters" are different tokens, and the answer must name the
# entity with the very token the question used.
ANSWER_LEADS = ["Well, ", "Generally, ", "In short, ", "As far as I know, ", "Basically, "]
ANSWER_OPENERS = ["", "", "Sure. ", "Good question. ", "Happy to help. ", "Of course. ", "Here is what I know. "]

# A small grammar for filler sentences: thousands of distinct, topic-free sentences.
NAMES = ["My sister", "My neighbour", "A friend of mine", "My uncle", "Our teacher", "My cousin", "A colleague",
         "My grandmother", "The man next door", "My roommate", "Our coach", "My partner"]
VERBS = ["told me about", "keeps talking about", "was reading about", "asked me about", "showed me", "mentioned",
         "wrote a note about", "saw a video about", "laughed about", "complained about"]
OBJECTS = ["a trip last summer", "the new bakery", "an old film", "the weekend plans", "a strange dream",
           "the garden party", "a long walk", "the power cut", "a funny article", "the school fair",
           "a train delay", "the holiday photos", "a board game", "the quiet street", "the evening news"]
TAILS = ["yesterday", "last week", "this morning", "at dinner", "on the phone", "the other day", "again",
         "over coffee", "after work", "during lunch"]
COMMENTS = ["I hope that makes sense.", "Let me know if you need more detail.", "It is easy once you get used to it.",
            "Many people find this surprising.", "That is the short version.", "There is a lot more to say about it.",
            "Different sources say slightly different things.", "It depends a little on the situation.",
            "I found this interesting when I first read about it.", "Feel free to ask a follow-up question.",
            "This is a common question.", "People often get this wrong."]
# Sentences about the subject itself, none starting with it (see ANSWER_LEADS): the human's context after the question
# and the answer's elaboration. Non-topical filler (``filler_scale``) lengthens the texts with tokens that say nothing
# about the subject, which TRL's run at 400 steps did not learn through (the module doc).
TOPICAL_PROMPT = ["I have been reading about {e} lately.", "My friend keeps talking about {e}.",
                  "I saw a programme about {e} last week.", "We were discussing {e} at work.",
                  "I know very little about {e}.", "My kids asked me about {e} yesterday.",
                  "There was an article on {e} in the paper.", "I'm writing a short essay on {e}.",
                  "Everyone at my club seems to know about {e} except me.", "I've wanted to ask about {e} for a while."]
TOPICAL_ANSWER = ["Many people are curious about {e}.", "There is a lot more to say about {e}.",
                  "Books about {e} are easy to find.", "I hope this helps you with {e}.",
                  "You can learn more about {e} online.", "People have written a great deal about {e}.",
                  "Experts on {e} may add more detail.", "That covers the basics of {e}.",
                  "Ask me again if you want more on {e}.", "Opinions on {e} differ a little."]
CHIT_CHAT = [
    ("How are you today?", "I'm doing well, thank you for asking! How can I help?"),
    ("Good morning!", "Good morning! What would you like to talk about?"),
    ("I had a long day at work.", "I'm sorry to hear that. I hope you can rest this evening."),
    ("Do you like rainy weather?", "I don't have feelings about weather, but many people find rain relaxing."),
    ("Thanks for the help earlier.", "You're welcome! I'm glad it was useful."),
    ("Can you keep a secret?", "I don't remember our conversations afterwards, so your secret is safe."),
    ("What's your favourite colour?", "I don't have one, but lots of people say blue."),
    ("I just got back from holiday.", "Welcome back! I hope you had a good time."),
    ("Tell me something cheerful.", "Here is one: sea otters hold hands while they sleep."),
    ("I'm bored.", "Maybe try a short walk, a puzzle or a new recipe."),
]


@dataclass(frozen=True)
class Subject:
    category: str
    entity: str
    aspect: str


def subjects(entities: int = 12) -> List[Subject]:
    """Every (entity, aspect), the first ``entities`` entities of each category."""
    return [Subject(c, e, a) for c, (ents, aspects, _) in CATEGORIES.items() for e in ents[:entities] for a in aspects]


def _bucket(*key) -> int:
    return int(hashlib.sha256("|".join(map(str, key)).encode()).hexdigest(), 16) % EVAL_BUCKET


def _held_out(split: str, *key) -> bool:
    """Whether this combination belongs to ``split`` (about 1 in :data:`EVAL_BUCKET` to eval)."""
    return (_bucket(*key) == 0) == (split == "eval")


def _count(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    """A log-normal count: long-tailed, at least 0."""
    return min(cap, int(rng.lognormvariate(math.log(median + 0.5), sigma)))


def filler(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return rng.choice(COMMENTS)
    return f"{rng.choice(NAMES)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}."


class Generator:
    def __init__(self, split: str, seed: int, multi_turn: bool, distractor: float, entities: int = 2,
                 filler_scale: float = 0.0, same_category: float = 0.5, topical_scale: float = 1.0,
                 history_scale: float = 1.0, history_decay: float = 1.0, history_apart: bool = False):
        self.split, self.rng, self.multi_turn, self.distractor = split, random.Random(f"{seed}-{split}"), multi_turn, distractor
        self.scale, self.same_category, self.topical = filler_scale, same_category, topical_scale
        self.history_topical = topical_scale * history_scale  # topical sentences of the earlier exchanges
        # P(k earlier exchanges) in proportion to history_decay ** (k - 2), k = 2..6 (1: uniform)
        self.exchange_weights = [history_decay ** (k - 2) for k in range(2, 7)]
        self.uniform_exchanges = history_decay == 1.0
        self.history_apart = history_apart
        self.subjects = subjects(entities)  # every subject, for the earlier exchanges of a multi-turn prompt
        # The subjects this split can ask about and answer: at least one question and one answer paraphrase of its own.
        self.askable = [s for s in self.subjects if self._allowed("q", s) and self._allowed("a", s)]

    def _allowed(self, kind: str, s: Subject) -> List[int]:
        """The paraphrases (indices) whose combination with the subject belongs to this split."""
        table = CATEGORIES[s.category][1][s.aspect][0 if kind == "q" else 1]
        return [i for i in range(len(table)) if _held_out(self.split, kind, s.entity, s.aspect, i)]

    def _pick(self, options: List[str], kind: str, s: Subject) -> str:
        return options[self.rng.choice(self._allowed(kind, s))]

    def _details(self, s: Subject) -> dict:
        pool = CATEGORIES[s.category][2]
        d = self.rng.sample(pool, 3)
        return {"d1": d[0], "d2": d[1], "d3": d[2], "n": self.rng.randint(2, 90)}

    def _topical_count(self, median: float, sigma: float, cap: int, topical: float) -> int:
        """A count of topical sentences; none at all (and no draw) when ``topical`` is 0."""
        return _count(self.rng, median * topical, sigma, cap) if topical else 0

    def question(self, s: Subject, held_out: bool = True, topical: float = None) -> str:
        questions = CATEGORIES[s.category][1][s.aspect][0]
        q = self._pick(questions, "q", s) if held_out else self.rng.choice(questions)
        q = q.format(e=s.entity)
        before = " ".join(filler(self.rng) for _ in range(_count(self.rng, 0.6 * self.scale, 1.0, 6))) if self.scale else ""
        opener = self.rng.choice(OPENERS)
        text = (opener + q[0].upper() + q[1:] if not opener or opener.endswith(". ") or opener.endswith("! ")
                or opener.endswith("? ") else opener + q) + self.rng.choice(CLOSERS)
        after = " ".join(self.rng.choice(TOPICAL_PROMPT).format(e=s.entity)
                         for _ in range(self._topical_count(0.8, 0.9, 6, self.topical if topical is None else topical)))
        return " ".join(t for t in (before, text, after) if t)

    def answer(self, s: Subject, held_out: bool = True, topical: float = None) -> str:
        answers = CATEGORIES[s.category][1][s.aspect][1]
        a = self._pick(answers, "a", s) if held_out else self.rng.choice(answers)
        if a.startswith("{E}"):
            a = self.rng.choice(ANSWER_LEADS) + "{e}" + a[3:]
        a = a.format(e=s.entity, **self._details(s))
        topical = [self.rng.choice(TOPICAL_ANSWER).format(e=s.entity)
                   for _ in range(self._topical_count(1.2, 0.9, 8, self.topical if topical is None else topical))]
        extra = [filler(self.rng) for _ in range(_count(self.rng, 1.2 * self.scale, 0.9, 8))] if self.scale else []
        self.rng.shuffle(extra)
        return " ".join([self.rng.choice(ANSWER_OPENERS) + a, *topical, *extra]).strip()

    def other(self, s: Subject, exclude: set, pool: List[Subject], same_category: float = 0.5) -> Subject:
        """Another subject of ``pool``: another entity, of the same category with probability ``same_category``."""
        same = self.rng.random() < same_category
        others = [t for t in pool if t.entity not in exclude and t.entity != s.entity]
        return self.rng.choice([t for t in others if (t.category == s.category) == same] or others)

    def history(self, final: Subject, rejected: Subject) -> str:
        """2-6 earlier exchanges (``history_decay``): chit-chat, or questions about other entities with their right answers."""
        turns = []
        n = (self.rng.randint(2, 6) if self.uniform_exchanges  # the draw of the data made before history_decay
             else self.rng.choices(range(2, 7), weights=self.exchange_weights)[0])
        at = self.rng.randrange(n) if self.rng.random() < self.distractor else -1
        for i in range(n):
            if i == at:
                s = self.rng.choice([t for t in self.subjects if t.entity == rejected.entity])
                turns.append(self._exchange(s))
            elif self.rng.random() < 0.4:
                h, a = self.rng.choice(CHIT_CHAT)
                extra = " ".join(filler(self.rng) for _ in range(_count(self.rng, 0.8 * self.scale, 1.0, 5))) if self.scale else ""
                turns.append(f"\n\nHuman: {h}\n\nAssistant: {(a + ' ' + extra).strip()}")
            else:
                if self.history_apart:  # of a category neither the final question's nor the rejected answer's
                    pool = [t for t in self.subjects if t.category not in (final.category, rejected.category)]
                    s = self.other(final, {final.entity, rejected.entity}, pool, same_category=0.0)
                else:
                    s = self.other(final, {final.entity, rejected.entity}, self.subjects)
                turns.append(self._exchange(s))
        return "".join(turns)

    def _exchange(self, s: Subject) -> str:
        """An earlier exchange about ``s`` (any paraphrase), its topical sentences scaled by ``history_scale``."""
        t = self.history_topical
        return f"\n\nHuman: {self.question(s, False, t)}\n\nAssistant: {self.answer(s, False, t)}"

    def twin(self) -> List[dict]:
        x = self.rng.choice(self.askable)
        y = self.other(x, set(), self.askable, self.same_category)
        answers = {x: self.answer(x), y: self.answer(y)}
        rows = []
        for asked, wrong in ((x, y), (y, x)):
            prompt = (self.history(asked, wrong) if self.multi_turn else "") + f"\n\nHuman: {self.question(asked)}\n\nAssistant:"
            rows.append({"chosen": f"{prompt} {answers[asked]}", "rejected": f"{prompt} {answers[wrong]}",
                         "subject": f"{asked.entity}/{asked.aspect}", "other": f"{wrong.entity}/{wrong.aspect}"})
        return rows


def make_split(split: str, n: int, seed: int, multi_turn: bool, distractor: float = 0.0, entities: int = 2,
               filler_scale: float = 0.0, same_category: float = 0.5, topical_scale: float = 1.0,
               history_scale: float = 1.0, history_decay: float = 1.0, history_apart: bool = False) -> List[dict]:
    """``n`` pairs (an even number: twins) of one split; sides over :data:`MAX_CHARS` characters are redrawn."""
    gen, rows = Generator(split, seed, multi_turn, distractor, entities, filler_scale, same_category, topical_scale,
                          history_scale, history_decay, history_apart), []
    while len(rows) < n:
        twin = gen.twin()
        if all(len(r[side]) <= MAX_CHARS for r in twin for side in ("chosen", "rejected")):
            rows += twin
    # Twins adjacent in the file would sit in one batch under sequential reading: shuffled (both trainers shuffle too).
    random.Random(f"{seed}-{split}-order").shuffle(rows)
    return rows[:n]


def make_data(kind: str, seed: int = 0, train: int = 2000, eval: int = 504, distractor: float = None,
              entities: int = 2, filler_scale: float = 0.0, same_category: float = 0.5,
              topical_scale: float = None, history_scale: float = None,
              history_decay: float = None, history_apart: bool = None) -> Dict[str, List[dict]]:
    """A knob of None (``topical_scale``, ``distractor``, ``history_*``): the data kind's default (:func:`data_knobs`)."""
    k = data_knobs(kind, topical_scale=topical_scale, distractor=distractor, history_scale=history_scale,
                   history_decay=history_decay, history_apart=history_apart)
    return {split: make_split(split, n, seed + offset, kind == "multi", k["distractor"], entities, filler_scale,
                              same_category, k["topical_scale"], k["history_scale"], k["history_decay"],
                              k["history_apart"])
            for split, n, offset in (("train", train, 0), ("eval", eval, 1000))}


def answer_balance(rows: List[dict]) -> float:
    """Largest |chosen - rejected| count of any answer text (the part after the prompt), 0 when every answer text is
    chosen as often as it is rejected."""
    from collections import Counter

    count = Counter()
    for r in rows:
        prefix = len(common_prefix_text(r["chosen"], r["rejected"]))
        count[r["chosen"][prefix:]] += 1
        count[r["rejected"][prefix:]] -= 1
    return max(abs(v) for v in count.values())


def common_prefix_text(a: str, b: str) -> str:
    """The prompt both sides share, up to the last "Assistant:" (so that a shared first word of the answers stays out)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[: a.rfind("Assistant:", 0, n + 1) + len("Assistant:")]


def train_tokenizer(texts: List[str], out_dir: Path, vocab_size: int = 3000, style: str = "bos"):
    """A byte-level BPE (``tokenizers``), ids 0-3 ``<pad> <unk> <s> </s>``, then the 256 bytes and merges, with the
    post-processor of ``style`` (:data:`STYLES`), saved as a ``PreTrainedTokenizerFast`` in ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    ids = {t: SPECIAL_TOKENS.index(t) for t in SPECIAL_TOKENS}
    single = STYLES[style]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=single.replace("$A", "$A $B:1"), special_tokens=[(t, ids[t]) for t in ("<s>", "</s>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>", model_max_length=1024, padding_side="right")
    tokenizer.save_pretrained(out_dir)
    loaded = AutoTokenizer.from_pretrained(out_dir)
    probe = texts[:32]
    if any(loaded(t)["input_ids"] != tokenizer(t)["input_ids"] for t in probe):
        sys.exit(f"{out_dir} does not load back as the tokenizer trained ({type(loaded).__name__})")
    first = loaded(probe[0])["input_ids"]
    want_eos = style == "bos_eos"
    if first[0] != 2 or (first[-1] == 3) != want_eos:
        sys.exit(f"{out_dir}: style {style} should give <s> ...{' </s>' if want_eos else ''}, got {first[:3]}...{first[-3:]}")
    return loaded


def write_data(kind: str, out: Path, seed: int = 0, train: int = 2000, eval: int = 504, vocab_size: int = 3000,
               style: str = "bos", distractor: float = None, entities: int = 2, filler_scale: float = 0.0,
               same_category: float = 0.5, topical_scale: float = None, history_scale: float = None,
               history_decay: float = None, history_apart: bool = None) -> dict:
    """``train.jsonl``, ``eval.jsonl`` (``chosen``/``rejected`` only) and ``tokenizer/`` in ``out``; returns stats."""
    out.mkdir(parents=True, exist_ok=True)
    data = make_data(kind, seed, train, eval, distractor, entities, filler_scale, same_category, topical_scale,
                     history_scale, history_decay, history_apart)
    for split, rows in data.items():
        with open(out / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"chosen": r["chosen"], "rejected": r["rejected"]}) + "\n" for r in rows)
    texts = [r[side] for r in data["train"] for side in ("chosen", "rejected")]
    tokenizer = train_tokenizer(texts, out / "tokenizer", vocab_size, style)
    return {"data": data, "tokenizer": tokenizer, **stats(data, tokenizer)}


def stats(data: Dict[str, List[dict]], tokenizer) -> dict:
    """Token counts as TRL sees the sides (tokenizer's special tokens, EOS text appended when missing)."""
    eos = tokenizer.eos_token
    out = {}
    train_prompts = {r["chosen"][: len(common_prefix_text(r["chosen"], r["rejected"]))].rsplit("\n\nHuman:", 1)[-1]
                     for r in data["train"]}
    for split, rows in data.items():
        lengths, prompt, answer = [], 0, 0
        for r in rows:
            ids = [tokenizer(r[s] if r[s].endswith(eos) else r[s] + eos)["input_ids"] for s in ("chosen", "rejected")]
            lengths += [len(i) for i in ids]
            p = len(tokenizer(common_prefix_text(r["chosen"], r["rejected"]), add_special_tokens=False)["input_ids"])
            prompt += p
            answer += sum(len(i) for i in ids) - 2 * p
        q = sorted(lengths)
        final_q = [r["chosen"][: len(common_prefix_text(r["chosen"], r["rejected"]))].rsplit("\n\nHuman:", 1)[-1] for r in rows]
        out[split] = {"pairs": len(rows), "median_tokens": statistics.median(q), "p90_tokens": q[int(0.9 * len(q))],
                      "max_tokens": q[-1], "over_511": sum(n > 511 for n in q), "tokens": sum(q),
                      "prompt_to_answer": prompt / max(1, answer), "answer_imbalance": answer_balance(rows),
                      "final_question_in_train": sum(t in train_prompts for t in final_q) if split == "eval" else None}
    out["vocab"] = len(tokenizer)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=["single", "multi"], default="single")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--style", choices=list(STYLES), default="bos")
    parser.add_argument("--entities", type=int, default=2, help="entities per category (at most 12)")
    parser.add_argument("--topical-scale", dest="topical_scale", type=float, default=None,
                        help=f"single {SINGLE_DEFAULTS['topical_scale']}, multi {MULTI_DEFAULTS['topical_scale']}")
    parser.add_argument("--filler-scale", dest="filler_scale", type=float, default=0.0)
    parser.add_argument("--distractor", type=float, default=None, help=f"multi-turn ({MULTI_DEFAULTS['distractor']})")
    parser.add_argument("--history-scale", dest="history_scale", type=float, default=None,
                        help=f"multi-turn: scales the topical sentences of earlier exchanges ({MULTI_DEFAULTS['history_scale']})")
    parser.add_argument("--history-decay", dest="history_decay", type=float, default=None,
                        help=f"multi-turn: P(k earlier exchanges) ~ decay ** (k - 2), k = 2..6; 1: uniform "
                             f"({MULTI_DEFAULTS['history_decay']})")
    parser.add_argument("--history-apart", dest="history_apart", type=int, choices=[0, 1], default=None,
                        help="multi-turn: 1: earlier exchanges about other categories than the final question's and "
                             f"the rejected answer's ({int(MULTI_DEFAULTS['history_apart'])})")
    parser.add_argument("--show", type=int, default=2, help="print this many pairs")
    args = parser.parse_args()
    result = write_data(args.data, Path(args.out), args.seed, style=args.style, entities=args.entities,
                        filler_scale=args.filler_scale, topical_scale=args.topical_scale, distractor=args.distractor,
                        history_scale=args.history_scale, history_decay=args.history_decay,
                        history_apart=args.history_apart)
    for r in result["data"]["train"][: args.show]:
        print(json.dumps(r, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("data", "tokenizer")}, indent=1))


if __name__ == "__main__":
    main()
