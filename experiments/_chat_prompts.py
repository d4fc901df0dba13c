"""Synthetic chat requests for self-distillation: templates in the spirit of the eight MT-Bench
categories (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities) crossed
with a list of everyday and academic subjects. None of them is an evaluation question; the
target's own greedy answers to them are what a chat draft must learn to predict.

    chat_requests(n, seed) -> list[str]      n distinct requests, deterministic in seed
"""

from __future__ import annotations

import numpy as np

SUBJECTS = """
gardening; climate change; the French Revolution; black holes; machine learning; coffee; chess; the Roman Empire;
photosynthesis; electric cars; social media; sleep; the stock market; volcanoes; jazz music; the human heart;
renewable energy; ancient Egypt; vaccines; the internet; honeybees; marathon running; cryptography; the moon landing;
recycling; meditation; the printing press; ocean tides; inflation; video games; the immune system; bread baking;
the Renaissance; earthquakes; quantum computing; public libraries; dinosaurs; time management; the water cycle;
democracy; rainforests; artificial intelligence; the Great Wall of China; plate tectonics; learning a language;
minimalism; the Olympic Games; antibiotics; solar panels; Shakespeare; the Silk Road; remote work; glaciers;
the periodic table; friendship; volunteering; the Industrial Revolution; electric guitars; migratory birds; tea;
photography; the Cold War; deep sea creatures; budgeting; public transport; the Amazon river; genetics; yoga;
the stock exchange; mountain climbing; urban planning; Mars exploration; classical music; nutrition; bicycles;
the Moon; coral reefs; philosophy; cloud computing; the Beatles; wildfires; composting; pirates; nuclear power;
the human brain; chocolate; origami; electric grids; the Vikings; robotics; soccer; hurricanes; bookkeeping;
cybersecurity; impressionist painting; the Pyramids; rivers; houseplants; job interviews; the Internet of Things;
algebra; probability; the Pythagorean theorem; prime numbers; statistics; geometry; calculus; fractions;
sorting algorithms; databases; recursion; binary search; web development; version control; unit testing;
linked lists; hash tables; regular expressions; operating systems; compilers; spreadsheets; email etiquette;
public speaking; negotiation; parenting; pets; dogs; cats; horses; camping; cooking pasta; wine; cheese;
the Mediterranean diet; hiking; skiing; surfing; astronomy; telescopes; satellites; weather forecasting;
economics; supply and demand; taxes; small businesses; marketing; customer service; leadership; teamwork;
the history of medicine; the printing of money; banks; credit cards; insurance; real estate; architecture;
Gothic cathedrals; bridges; skyscrapers; trains; airplanes; ships; submarines; rockets; the Space Station;
poetry; novels; fairy tales; mythology; Greek gods; opera; ballet; theatre; film making; animation; comics;
fashion; the history of jeans; perfume; gardens in Japan; sushi; Indian cuisine; Mexican food; spices;
languages of the world; writing systems; dictionaries; translation; memory; habits; motivation; stress;
happiness; loneliness; ethics; free will; justice; human rights; the United Nations; elections; newspapers;
advertising; smartphones; batteries; semiconductors; lasers; magnets; electricity; sound; light; rainbows;
gravity; friction; energy; atoms; DNA; evolution; cells; bacteria; viruses; fungi; forests; deserts; the Arctic;
penguins; whales; elephants; wolves; ants; butterflies; sharks; octopuses; owls; trees; flowers; soil; farming;
irrigation; fishing; food waste; plastic pollution; air quality; clean water; cities; villages; museums
"""

TEMPLATES = (
    # writing
    "Write a short blog post about {s}.",
    "Compose an engaging travel-style introduction to {s} for a general audience.",
    "Write a persuasive paragraph arguing that everyone should learn about {s}.",
    "Draft a friendly email to a colleague recommending a book about {s}.",
    "Write a short poem about {s}.",
    "Write a two-paragraph story in which {s} plays an important part.",
    "Write a catchy headline and a short summary for a news article about {s}.",
    # roleplay
    "Pretend you are a tour guide. Describe {s} to a group of visitors.",
    "Imagine you are a teacher explaining {s} to ten-year-old students. What do you say?",
    "Act as an expert on {s} and answer: what is the most common misconception about it?",
    "You are a podcast host. Introduce today's episode about {s}.",
    # reasoning
    "What are the pros and cons of {s}?",
    "Compare {s} with {t}. How are they similar and how are they different?",
    "Why does {s} matter? Give three reasons.",
    "What would happen if {s} disappeared tomorrow? Reason step by step.",
    "Give a balanced argument for and against spending more public money on {s}.",
    # STEM and humanities
    "Explain {s} in simple terms.",
    "How does {s} work?",
    "What is the history of {s}? Keep it brief.",
    "Give me five interesting facts about {s}.",
    "What are the main challenges related to {s} today?",
    "Describe the impact of {s} on modern society.",
    "What should a beginner know about {s}?",
    "Summarize the key ideas of {s} in a few bullet points.",
    "How has {s} changed over the last hundred years?",
    "What careers are related to {s}, and what skills do they need?",
    # advice
    "Give me practical tips for getting started with {s}.",
    "I want to learn more about {s}. Where should I begin?",
    "Create a one-week study plan for learning about {s}.",
    # extraction and rewriting
    "List the most important terms related to {s} and define each in one sentence.",
    "Write three quiz questions about {s}, with their answers.",
    "Write a short dialogue between two friends discussing {s}.",
)

MATH = (
    "What is {a} multiplied by {b}? Show your work.",
    "If a shop sells {a} items on Monday and {b} items on Tuesday, how many items did it sell in total? Explain.",
    "Solve for x: {a}x + {b} = {c}.",
    "A train travels {a} kilometres in {b} hours. What is its average speed?",
    "What is the sum of all integers from 1 to {a}?",
    "Is {c} a prime number? Explain how you can tell.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "Convert {a} degrees Celsius to Fahrenheit and explain the formula.",
)

CODING = (
    "Write a Python function that {task}.",
    "Explain how to write a program that {task}, then give the code in Python.",
    "Write a JavaScript function that {task}.",
    "What is an efficient algorithm to {task_bare}? Describe it and give Python code.",
)

TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
    "finds the largest element of a list", "removes duplicates from a list", "computes the factorial of n",
    "returns the n-th Fibonacci number", "checks whether a string is a palindrome", "sorts a list of names",
    "merges two sorted lists", "converts Celsius to Fahrenheit", "counts the vowels in a string",
    "finds the common elements of two lists", "computes the average of a list of numbers",
    "validates an email address", "flattens a nested list", "finds the second largest number in a list",
    "checks whether two strings are anagrams", "computes the greatest common divisor of two numbers",
    "reads a text file and prints its longest line",
)

BARE = {"reverses": "reverse", "checks": "check", "counts": "count", "finds": "find", "removes": "remove",
        "computes": "compute", "returns": "compute", "sorts": "sort", "merges": "merge", "converts": "convert",
        "validates": "validate", "flattens": "flatten", "reads": "read"}  # the tasks' verbs, as "to ..." takes them


def subjects() -> list[str]:
    return [s.strip() for s in SUBJECTS.replace("\n", " ").split(";") if s.strip()]


def chat_requests(n: int, seed: int = 0) -> list[str]:
    """n distinct requests (fewer only if the grid is smaller), about 80% subject templates,
    10% arithmetic and 10% coding, in a deterministic random order."""
    rng = np.random.default_rng(seed)
    subs = subjects()
    out, seen = [], set()
    tasks_bare = [BARE[t.split(" ", 1)[0]] + " " + t.split(" ", 1)[1] for t in TASKS]
    cap = len(TEMPLATES) * len(subs) + len(MATH) * 1000 + len(CODING) * len(TASKS)
    while len(out) < min(n, cap):
        u = rng.random()
        if u < 0.8:
            s, t = rng.choice(subs, 2, replace=False)
            text = TEMPLATES[rng.integers(len(TEMPLATES))].format(s=s, t=t)
        elif u < 0.9:
            a, b = int(rng.integers(2, 200)), int(rng.integers(2, 60))
            text = MATH[rng.integers(len(MATH))].format(a=a, b=b, c=int(rng.integers(2, 500)))
        else:
            i = int(rng.integers(len(TASKS)))
            text = CODING[rng.integers(len(CODING))].format(task=TASKS[i], task_bare=tasks_bare[i])
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
