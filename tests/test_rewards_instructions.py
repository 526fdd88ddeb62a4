"""Instruction-following constraints: each type on a passing and a failing response."""

import pytest

from hcjax.rewards import instructions as ins

C = ins.Constraint

# (constraint, a response that satisfies it, one that does not)
CASES = [
    (C("word_count", {"relation": "at_least", "n": 5}), "one two three four five", "one two"),
    (C("word_count", {"relation": "at_most", "n": 3}), "don't stop-now please", "a b c d"),
    (C("sentence_count", {"relation": "exactly", "n": 2}), "Hi there. How are you?", "Hi. A. B."),
    (C("paragraph_count", {"relation": "exactly", "n": 2}), "p one\n\np two", "p one\n***\np2\n\np3"),
    (C("keywords_present", {"keywords": ["apple", "pie"]}), "Apple pie!", "apples and pies"),
    (C("keywords_absent", {"keywords": ["never"]}), "nevertheless fine", "I never do"),
    (C("keyword_frequency", {"keyword": "cat", "relation": "at_least", "n": 2}),
     "cat, Cat and a dog", "cat, catalog"),
    (C("letter_frequency", {"letter": "z", "relation": "at_least", "n": 3}), "Zig zag z", "zoo"),
    (C("json_format"), '```json\n{"a": [1, 2]}\n```', "{'a': 1}"),
    (C("bullet_count", {"n": 2}), "* one\n- two\ntext", "* one\n* two\n* three"),
    (C("highlighted_sections", {"n": 2}), "*a* and *b*", "*a* only"),
    (C("sections", {"n": 2}), "SECTION 1\nx\nSECTION 2\ny", "SECTION 1\nonly"),
    (C("title"), "<<My Poem>>\nroses", "My Poem\nroses"),
    (C("starts_with", {"phrase": "Dear Sir"}), "  dear sir, hello", "Hello, dear sir"),
    (C("ends_with", {"phrase": "Any other questions?"}), "Done. Any other questions?\n", "Bye."),
    (C("lowercase"), "all lower here 123", "Not lower"),
    (C("uppercase"), "ALL UPPER 1", "ALL Upper"),
    (C("capital_words", {"relation": "at_least", "n": 2}), "NASA and ESA", "NASA only"),
    (C("placeholders", {"n": 2}), "Dear [name], at [address]", "Dear [name]"),
    (C("postscript"), "Body\nP.S. see you", "Body only, P.S. inline"),
    (C("no_commas"), "no commas here", "one, two"),
    (C("quoted"), '"whole answer"', 'a "quoted" word'),
    (C("repeat_prompt", {"prompt": "Write a haiku."}), "Write a haiku. Leaves fall", "A haiku"),
    (C("two_responses"), "first one ****** second one", "same ****** same"),
]


def test_at_least_fifteen_constraint_types():
    assert len(ins.CHECKS) >= 15
    assert {c.kind for c, _, _ in CASES} == set(ins.CHECKS)


@pytest.mark.parametrize("constraint, good, bad", CASES, ids=[c.kind for c, _, _ in CASES])
def test_constraint_pass_and_fail(constraint, good, bad):
    assert constraint.check(good)[0], constraint.check(good)[1]
    assert not constraint.check(bad)[0], constraint.check(bad)[1]


def test_reward_needs_every_necessary_constraint():
    constraints = [C("lowercase"), C("word_count", {"relation": "at_most", "n": 4}),
                   C("postscript", necessary=False)]
    assert ins.grade("short and lower", constraints).reward == 1.0  # optional P.S. missing
    failed = ins.grade("short and lower but far too long", constraints)
    assert failed.reward == 0.0 and "word_count: FAIL (7 words (at most 4))" in failed.reason
    assert ins.grade("Short", constraints).reward == 0.0


def test_counts_are_exact():
    assert ins.words("It's a well-known fact, isn't it?") == ["It's", "a", "well-known", "fact",
                                                               "isn't", "it"]
    assert len(ins.sentences("Who? Yes! 3.5 is fine.")) == 3  # a decimal point ends nothing
    assert ins.paragraphs("a\n\n\nb\n***\nc") == ["a", "b", "c"]


def test_bad_constraints_are_named():
    with pytest.raises(ValueError, match="kind='nonsense'"):
        C("nonsense")
    with pytest.raises(ValueError, match="relation='roughly'"):
        C("word_count", {"relation": "roughly", "n": 3}).check("x")
    with pytest.raises(ValueError, match="do not fit 'title'"):
        C("title", {"n": 1}).check("x")
    with pytest.raises(ValueError, match="letter='ab'"):
        C("letter_frequency", {"letter": "ab", "relation": "at_least", "n": 1}).check("x")
    with pytest.raises(ValueError, match="constraints=\\[\\]"):
        ins.grade("x", [])
