"""The trigger search every line goes through before it is parsed (`gpuwarden scan`, the
collector's prefilter, the matchers' index): one regular expression, built as a trie of the
words so that the engine tries one branch per first character at each place in a line, not
one per word. It must find exactly what a plain alternation of the words finds."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from collectors.kernel_log.finding import TriggerIndex, _kept, trie_pattern, trigger_search
from collectors.kernel_log.matchers import MatcherSet

# Few letters, so that words share prefixes and texts hold them.
WORD = st.text(alphabet="ab :(", min_size=1, max_size=6)


@given(st.lists(WORD, min_size=1, max_size=12), st.text(alphabet="ab :(x", max_size=40))
def test_the_trie_finds_what_the_plain_alternation_finds(words: list[str], text: str) -> None:
    kept = _kept(words)
    plain = re.compile("|".join(re.escape(w) for w in kept))
    trie = re.compile(trie_pattern(kept))
    assert [m[0] for m in trie.finditer(text)] == [m[0] for m in plain.finditer(text)]
    assert (trigger_search(words)(text) is not None) == any(w in text for w in words)


def test_the_real_words_each_found_alone_and_by_their_owners() -> None:
    matchers = MatcherSet()
    search = trigger_search(matchers.triggers)
    for word in matchers.triggers:
        assert search(f"xx {word} yy") is not None, word
    index = TriggerIndex([(i, [w]) for i, w in enumerate(matchers.triggers)])
    for i, word in enumerate(matchers.triggers):
        assert i in index.hits(f"xx {word} yy"), word
    assert search("an ordinary line: eth0 renamed, nothing here") is None


def test_the_trie_has_one_branch_per_first_character() -> None:
    """What it is for: at each place in a line, one alternative per first character of the
    words (34 for 62 words), not one per word."""
    words = _kept(MatcherSet().triggers)
    top = trie_pattern(words)
    assert top.startswith("(?:")
    depth, branches = 0, 1
    for i, char in enumerate(top[3:-1], 3):
        escaped = i > 0 and top[i - 1] == "\\"
        if char == "(" and not escaped:
            depth += 1
        elif char == ")" and not escaped:
            depth -= 1
        elif char == "|" and not escaped and depth == 0:
            branches += 1
    assert branches == len({w[0] for w in words}) < len(words), (branches, len(words))
