"""The conversations the demo model is fine-tuned on (``train_demo_model.py --finetune-from``):
greetings and short questions answered with a line of text, and tool calls in the chat
template's ``<tool_call>`` format. Every value comes from the lists below, the Shakespeare text
itself and a seeded ``random.Random``: nothing is fetched, nothing is written by another model.

Each builder returns messages (and tools) in OpenAI's shape; ``train_demo_model.py`` renders
them through the chat template with transformers, exactly as a server renders a request, so
what the model learns is what it will be shown. This file is a tool, not part of the package.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

# --------------------------------------------------------------------------- greetings

GREETINGS = [
    "hi", "hello", "hey", "hi there", "hello there", "hey there", "good morning", "good evening",
    "good afternoon", "good day", "greetings", "howdy", "hiya", "yo", "morning", "evening",
    "how are you", "how are you doing", "how do you do", "how goes it", "nice to meet you",
    "thanks", "thank you", "thank you so much", "bye", "goodbye", "see you", "good night", "ok",
    "okay", "yes", "no", "sure", "cool", "great", "nice", "test", "testing", "ping", "hm", "hmm",
    "lol", "wow", "sorry", "please", "welcome", "cheers", "hey you", "hi friend", "hello friend",
    "hi bot", "hello assistant", "anyone there", "are you there", "you there",
]
SHORT_QUESTIONS = [
    "why", "what", "who", "how", "when", "where", "really", "who are you", "what are you",
    "what is this", "what is your name", "whats your name", "name", "help", "can you help me",
    "what can you do", "tell me a story", "say something", "tell me a joke", "are you real",
    "what time is it", "where are you", "how old are you", "do you love me", "is it true",
    "what now", "what happened", "who is the king", "what should I do", "any news",
    "what do you think", "can you hear me", "why not", "how so", "and then", "is that so",
]
GREETING_REPLIES = [
    "Good morrow to you, friend. What would you have of me?",
    "Hail, and well met! How may I serve you?",
    "Welcome, gentle friend. Speak, and I will hear thee.",
    "Good day to you, sir. What news?",
    "Well met, good friend. What is your pleasure?",
    "Greetings to you. I am glad to see you here.",
    "Good even to you. What brings you hither?",
    "God save you, friend. How fares the day with you?",
    "Welcome, welcome! Come, tell me your mind.",
    "Good morrow. I am at your service.",
    "Hail to thee. What wouldst thou know?",
    "Why, good day to you! Sit, and speak your heart.",
    "Well, I am here, my lord. What is it you would have?",
    "I thank you, and I am well. And how do you?",
    "Farewell, good friend, and fare you well.",
    "Good night, sweet friend. Sleep well.",
    "Nay, the thanks are mine, good sir.",
    "Ay, my lord, it shall be so.",
    "Alas, I know not. But I will hear thee out.",
    "Then so be it, and let us speak of it.",
]
QUESTION_REPLIES = [
    "Why, because the world is so, my lord.",
    "I am a poor player, that speaks what I have learned.",
    "Marry, sir, I cannot tell. Ask me again, and I will try.",
    "A fellow of no name, sir, but at your service.",
    "Even so, my lord; it is true.",
    "I will tell you, if you will hear me.",
    "Here, my lord, and ready to speak.",
    "Let me think on it, and then I will answer you.",
    "O, that is a tale too long for this short hour.",
    "In good time, sir, all shall be known.",
    "I know not, my lord, but I will learn.",
    "Ask what thou wilt, and I will answer as I can.",
    "Speak on, good friend. I hear you well.",
    "Nay, I cannot say; the stars have not told me.",
    "Now, sir, the king is well, and all is quiet.",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.", "You are a friendly assistant.", "Be brief.",
    "You are a helpful assistant. Answer briefly.", "Answer in one sentence.",
]


def _surface(text: str, rng: random.Random) -> str:
    """The ways people type a short message: case and an ending mark."""
    shape = rng.random()
    if shape < 0.45:
        text = text[:1].upper() + text[1:]
    elif shape < 0.5:
        text = text.upper()
    elif shape < 0.6:
        text = text.title()
    return text + rng.choice(["", "", "!", ".", "?", "!!", " :)"])


def _short_speeches(scenes: list[list[str]]) -> list[str]:
    return [s for scene in scenes for s in scene if 4 <= len(s.split()) <= 24]


def greeting_conversation(rng: random.Random, speeches: list[str]) -> list[Message]:
    """A greeting or a short question, answered with a line (sometimes two) of text."""
    if rng.random() < 0.6:
        user, replies = rng.choice(GREETINGS), GREETING_REPLIES
    else:
        user, replies = rng.choice(SHORT_QUESTIONS), QUESTION_REPLIES
    reply = rng.choice(replies)
    if rng.random() < 0.5:
        reply += " " + rng.choice(speeches)
    messages: list[Message] = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if rng.random() < 0.15:  # a turn before: the short message comes mid-conversation
        messages += [{"role": "user", "content": rng.choice(speeches)},
                     {"role": "assistant", "content": rng.choice(speeches)}]
    return [*messages, {"role": "user", "content": _surface(user, rng)},
            {"role": "assistant", "content": reply}]


# --------------------------------------------------------------------------- tools

CITIES = [
    "Paris", "London", "Rome", "Verona", "Venice", "Vienna", "Berlin", "Madrid", "Lisbon", "Athens",
    "Oslo", "Dublin", "Tokyo", "Seoul", "Lima", "Cairo", "Nairobi", "Sydney", "Boston", "Chicago",
    "Denver", "Austin", "Toronto", "Mexico City", "New York", "San Francisco", "Mumbai", "Delhi",
    "Beijing", "Shanghai", "Zurich", "Geneva", "Prague", "Warsaw", "Stockholm", "Helsinki",
    "Edinburgh", "Glasgow", "Padua", "Milan", "Naples", "Florence", "Denmark", "Elsinore",
]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Latin", "Greek", "Dutch", "Japanese"]
PEOPLE = ["Anna", "Ben", "Clara", "David", "Emma", "Frank", "Grace", "Henry", "Isabel", "Jack",
          "Kate", "Leo", "Maria", "Nick", "Olivia", "Paul", "Rosalind", "Orlando", "Viola", "Hal"]
SKIES = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "stormy", "clear"]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, str]  # name -> JSON type ("string" or "integer"); all required
    ask: tuple[str, ...]  # questions; {name} fields are the arguments
    draw: Callable[[random.Random, list[str]], dict[str, Any]]  # arguments, from the words
    answer: Callable[[random.Random, dict[str, Any]], tuple[dict[str, Any], str]]  # result, reply

    def schema(self) -> dict[str, Any]:
        properties = {name: {"type": kind} for name, kind in self.parameters.items()}
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties,
                           "required": list(self.parameters)}}}


def _arithmetic(expression: str) -> float:
    left, op, right = expression.split()
    a, b = int(left), int(right)
    return round({"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op], 2)


def _sum(rng: random.Random) -> str:
    return f"{rng.randint(2, 999)} {rng.choice('+-*/')} {rng.randint(2, 99)}"


def _clock(rng: random.Random) -> str:
    return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"


def _phrase(rng: random.Random, words: list[str], most: int = 3) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, most)))


TOOLS = [
    Tool("get_weather", "Get the current weather in a city", {"city": "string"},
         ("What is the weather in {city}?", "What's the weather like in {city}?",
          "Is it raining in {city}?", "How warm is it in {city} today?", "weather in {city}",
          "Tell me the weather in {city}.", "Will it be sunny in {city}?"),
         lambda rng, words: {"city": rng.choice(CITIES)},
         lambda rng, a: ((r := {"city": a["city"], "temperature_c": rng.randint(-5, 35),
                                "sky": rng.choice(SKIES)}),
                         f"In {a['city']} it is {r['sky']} and {r['temperature_c']} degrees.")),
    Tool("get_time", "Get the local time in a city", {"city": "string"},
         ("What time is it in {city}?", "What is the time in {city}?", "time in {city}",
          "Tell me the hour in {city}."),
         lambda rng, words: {"city": rng.choice(CITIES)},
         lambda rng, a: ((r := {"city": a["city"], "time": _clock(rng)}),
                         f"It is {r['time']} in {a['city']}.")),
    Tool("search_web", "Search the web", {"query": "string"},
         ("Search the web for {query}.", "Look up {query}.", "Find {query} online.",
          "search {query}", "Can you search for {query}?"),
         lambda rng, words: {"query": _phrase(rng, words)},
         lambda rng, a: ({"results": [f"{a['query']} - a page about it"]},
                         f"I found a page about {a['query']}.")),
    Tool("calculate", "Evaluate an arithmetic expression", {"expression": "string"},
         ("What is {expression}?", "Compute {expression}.", "calculate {expression}",
          "How much is {expression}?"),
         lambda rng, words: {"expression": _sum(rng)},
         lambda rng, a: ((r := {"value": _arithmetic(a["expression"])}),
                         f"{a['expression']} is {r['value']}.")),
    Tool("send_email", "Send an email", {"to": "string", "subject": "string"},
         ("Send an email to {to} about {subject}.", "Email {to} about {subject}.",
          "Write to {to}, subject {subject}."),
         lambda rng, words: {"to": rng.choice(PEOPLE), "subject": _phrase(rng, words)},
         lambda rng, a: ({"sent": True}, f"The letter to {a['to']} is sent.")),
    Tool("set_timer", "Set a timer", {"minutes": "integer"},
         ("Set a timer for {minutes} minutes.", "Timer {minutes} minutes", "Wake me in {minutes} minutes."),
         lambda rng, words: {"minutes": rng.randint(1, 90)},
         lambda rng, a: ({"set": True}, f"A timer of {a['minutes']} minutes is set.")),
    Tool("translate", "Translate text into a language", {"text": "string", "language": "string"},
         ("Translate {text} into {language}.", "How do you say {text} in {language}?",
          "Say {text} in {language}."),
         lambda rng, words: {"text": _phrase(rng, words), "language": rng.choice(LANGUAGES)},
         lambda rng, a: ({"translation": a["text"]}, f"In {a['language']} that is {a['text']}.")),
    Tool("define_word", "Look up what a word means", {"word": "string"},
         ("What does {word} mean?", "Define {word}.", "What is the meaning of {word}?"),
         lambda rng, words: {"word": rng.choice(words)},
         lambda rng, a: ({"definition": "an old word"}, f"{a['word'].capitalize()} is an old word.")),
    Tool("add_todo", "Add an item to the to-do list", {"item": "string"},
         ("Add {item} to my list.", "Remind me to {item}.", "Put {item} on my to-do list."),
         lambda rng, words: {"item": _phrase(rng, words)},
         lambda rng, a: ({"added": True}, f"I have added {a['item']} to your list.")),
    Tool("play_music", "Play a song", {"title": "string"},
         ("Play {title}.", "Put on the song {title}.", "I want to hear {title}."),
         lambda rng, words: {"title": _phrase(rng, words)},
         lambda rng, a: ({"playing": True}, f"Now playing {a['title']}.")),
]


def tool_conversation(rng: random.Random, words: list[str]) -> tuple[list[Message], list[dict[str, Any]]]:
    """Tools offered, then: a call (most often), a call with its result and a worded answer, or
    a greeting answered with text (a model with tools need not call one)."""
    offered = rng.sample(TOOLS, rng.choice([1, 1, 2, 2, 3]))
    tool = rng.choice(offered)
    messages: list[Message] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    shape = rng.random()
    if shape < 0.15:
        messages += [{"role": "user", "content": _surface(rng.choice(GREETINGS), rng)},
                     {"role": "assistant", "content": rng.choice(GREETING_REPLIES)}]
        return messages, [t.schema() for t in offered]
    arguments = tool.draw(rng, words)
    question = rng.choice(tool.ask).format(**arguments)
    call = {"type": "function", "function": {"name": tool.name, "arguments": arguments}}
    messages += [{"role": "user", "content": question},
                 {"role": "assistant", "content": None, "tool_calls": [call]}]
    if shape < 0.45:
        result, reply = tool.answer(rng, arguments)
        messages += [{"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result)},
                     {"role": "assistant", "content": reply}]
    return messages, [t.schema() for t in offered]


def conversations(scenes: list[list[str]], words: list[str], seed: int, greetings: int,
                  tool_calls: int) -> list[tuple[list[Message], list[dict[str, Any]] | None]]:
    rng = random.Random(seed)
    speeches = _short_speeches(scenes)
    made: list[tuple[list[Message], list[dict[str, Any]] | None]] = [
        (greeting_conversation(rng, speeches), None) for _ in range(greetings)]
    made += [tool_conversation(rng, words) for _ in range(tool_calls)]
    rng.shuffle(made)
    return made
