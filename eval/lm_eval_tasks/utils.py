"""Document processing for the local lm-eval tasks (``pydoc_choice``); lm-eval imports this by path.

``continuation_choices`` turns documents with a ``text`` field into multiple-choice items,
deterministically (no randomness, only the documents' order):

1. Words are the runs of non-space characters of each text. A document of ``n`` words gives
   ``min(ITEMS_PER_DOC, n // (CONTEXT_WORDS + CONTINUATION_WORDS))`` items, one at the start of
   each of as many equal blocks of the document; documents too short for one item give none.
2. An item's context is the original text of ``CONTEXT_WORDS`` words (whitespace and newlines
   kept); its true continuation is the text of the next ``CONTINUATION_WORDS`` words including
   the whitespace before them (hence ``target_delimiter: ""``).
3. Items are numbered ``j = 0 .. N-1`` in document order. Item ``j``'s distractors are the true
   continuations of items ``j + k * (N // CHOICES)`` (mod ``N``) for ``k = 1 .. CHOICES - 1``, each
   moved on by one item while it falls in item ``j``'s document or repeats a chosen one.
4. The true continuation goes to position ``j % CHOICES`` (the label), so chance is ``1 / CHOICES``
   and the label is balanced over positions.
"""

from __future__ import annotations

import re

CONTEXT_WORDS = 64
CONTINUATION_WORDS = 16
ITEMS_PER_DOC = 4
CHOICES = 4


def _items(doc_index: int, text: str) -> list[dict]:
    words = [m.span() for m in re.finditer(r"\S+", text)]
    span = CONTEXT_WORDS + CONTINUATION_WORDS
    count = min(ITEMS_PER_DOC, len(words) // span)
    items = []
    for k in range(count):
        start = k * (len(words) // count)
        cut = words[start + CONTEXT_WORDS - 1][1]
        items.append({
            "doc": doc_index,
            "context": text[words[start][0] : cut],
            "continuation": text[cut : words[start + span - 1][1]],
        })
    return items


def build_items(texts: list[str]) -> list[dict]:
    """The multiple-choice items of ``texts``: ``{"doc", "context", "choices", "label"}`` each (module docstring)."""
    items = [item for i, text in enumerate(texts) for item in _items(i, text)]
    n = len(items)
    if len({item["doc"] for item in items}) < CHOICES:
        raise ValueError(f"need items from at least {CHOICES} documents for {CHOICES} choices, got {n} items")
    step = max(n // CHOICES, 1)
    out = []
    for j, item in enumerate(items):
        picked: list[int] = []
        for k in range(1, CHOICES):
            c = (j + k * step) % n
            while items[c]["doc"] == item["doc"] or c in picked:
                c = (c + 1) % n
            picked.append(c)
        choices = [items[c]["continuation"] for c in picked]
        label = j % CHOICES
        choices.insert(label, item["continuation"])
        out.append({"doc": item["doc"], "context": item["context"], "choices": choices, "label": label})
    return out


def continuation_choices(dataset):
    """lm-eval ``process_docs``: a ``datasets.Dataset`` of documents -> one of multiple-choice items."""
    from datasets import Dataset

    return Dataset.from_list(build_items(list(dataset["text"])))
