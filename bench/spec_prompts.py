"""Prompt sets for bench/bench_spec_cpu.py: chat messages, rendered by the model's chat template.

input_grounded: the answer copies from the prompt (repeat or edit a paragraph, quote from a
text, rewrite code with a small change), the case prompt lookup drafts well;
open_ended: chat whose answer is not in the prompt, the negative case (speculation must not
cost more than noise).
Every prompt has a unique name; the texts are written for this benchmark.
"""

from __future__ import annotations

_RIVER = (
    "The river town of Ashford grew up around a stone bridge built in 1742. Barges carried "
    "wool and timber downstream to the coast, and the inns along the quay were always full. "
    "When the railway arrived in 1861 the barges disappeared within a decade, the quay fell "
    "quiet, and the warehouses were turned into workshops, a school and, much later, a museum "
    "of river trade that still opens every summer.")

_LAB = (
    "Our lab meeting moves from Tuesday to Thursday next week. Please bring the updated "
    "results for the filter experiment, the list of samples that failed the quality check, "
    "and any questions about the new freezer rules. The meeting starts at 10:00 in room 214 "
    "and should end by 11:30. Coffee will be provided by the department.")

_SOLAR = (
    "Solar panels convert sunlight into electricity using layers of silicon. When light hits "
    "the panel, it knocks electrons loose, and the electric field inside the cell pushes them "
    "into a current. A typical home system has between ten and thirty panels, an inverter "
    "that turns direct current into alternating current, and a meter that records how much "
    "power is sent back to the grid.")

_PY_SUM = '''def total_price(items):
    total = 0
    for item in items:
        price = item["price"]
        quantity = item["quantity"]
        total = total + price * quantity
    return total


def average_price(items):
    if not items:
        return 0
    return total_price(items) / len(items)
'''

_PY_USER = '''class User:
    def __init__(self, name, email):
        self.name = name
        self.email = email

    def greet(self):
        return "Hello, " + self.name

    def contact(self):
        return self.name + " <" + self.email + ">"
'''

_JS_FETCH = '''async function loadUsers(url) {
  const response = await fetch(url);
  if (!response.ok) {
    throw new Error("request failed: " + response.status);
  }
  const users = await response.json();
  return users.map((user) => user.name);
}
'''


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


INPUT_GROUNDED: list[dict] = [
    {"name": "repeat_river", "messages": _user(
        "Repeat the following paragraph exactly, word for word:\n\n" + _RIVER)},
    {"name": "repeat_lab", "messages": _user(
        "Copy this message exactly as it is written:\n\n" + _LAB)},
    {"name": "edit_river_year", "messages": _user(
        "Rewrite the paragraph below, changing only the year 1742 to 1750. Keep every other "
        "word the same.\n\n" + _RIVER)},
    {"name": "edit_lab_day", "messages": _user(
        "Rewrite this message so that the meeting is on Friday instead of Thursday. Keep "
        "everything else unchanged.\n\n" + _LAB)},
    {"name": "quote_solar", "messages": _user(
        "Summarise the text below in two sentences, quoting its own words where you can.\n\n"
        + _SOLAR)},
    {"name": "quote_river", "messages": _user(
        "What happened to the barges in the text below? Answer by quoting the text.\n\n"
        + _RIVER)},
    {"name": "code_rename", "messages": _user(
        "Rewrite this Python code, renaming the function total_price to order_total "
        "everywhere. Return the whole code.\n\n```python\n" + _PY_SUM + "```")},
    {"name": "code_docstring", "messages": _user(
        "Add a one-line docstring to each method of this class and return the whole class."
        "\n\n```python\n" + _PY_USER + "```")},
    {"name": "code_fstring", "messages": _user(
        "Rewrite this class to use f-strings instead of string concatenation. Return the "
        "whole class.\n\n```python\n" + _PY_USER + "```")},
    {"name": "code_js_const", "messages": _user(
        "Repeat this JavaScript function, changing the error message to \"could not load "
        "users\". Return the whole function.\n\n```javascript\n" + _JS_FETCH + "```")},
]

OPEN_ENDED: list[dict] = [
    {"name": "chat_hobby", "messages": _user("What is a good hobby to start this winter?")},
    {"name": "chat_story", "messages": _user("Tell me a short story about a lighthouse keeper.")},
    {"name": "chat_explain", "messages": _user("Why is the sky blue? Explain it simply.")},
    {"name": "chat_recipe", "messages": _user("Give me an idea for a quick vegetarian dinner.")},
    {"name": "chat_advice", "messages": _user(
        "I have a job interview tomorrow. How should I prepare?")},
    {"name": "chat_poem", "messages": _user("Write a short poem about the sea in autumn.")},
    {"name": "chat_compare", "messages": _user(
        "What are the differences between cats and dogs as pets?")},
    {"name": "chat_plan", "messages": _user("Plan a relaxing weekend in a small city.")},
]

SETS: dict[str, list[dict]] = {"input_grounded": INPUT_GROUNDED, "open_ended": OPEN_ENDED}
