"""``math_answer`` scores the answer a reader would take as final (issue 28, item 9).

A model that writes ``\\boxed{1}`` as a guess, corrects itself and ends with ``\\boxed{2}``
answered 2: the LAST boxed answer counts, and likewise the last number when nothing is boxed,
the last ``####`` of a GSM8K reference. Every expected value below is worked by hand from the
text of the case, not produced by the code under test.
"""

from __future__ import annotations

import pytest

from posttrain import rewards

CASES = [
    # the last \boxed counts, wherever the others are
    ("first \\boxed{1}, then on reflection \\boxed{2}", 2, 1.0),
    ("first \\boxed{1}, then on reflection \\boxed{2}", 1, 0.0),
    ("\\boxed{3} \\boxed{4} \\boxed{5}", 5, 1.0),
    ("\\boxed{7} and the text goes on with 9", 7, 1.0),  # a boxed answer beats a later plain number
    # nested braces inside the last box
    ("\\boxed{1} so \\boxed{\\frac{6}{8}}", "3/4", 1.0),
    ("so \\boxed{\\frac{-1}{2}}", -0.5, 1.0),
    ("so \\boxed{-\\frac{1}{2}}", -0.5, 1.0),
    ("so \\boxed{-\\frac{1}{2}}", 0.5, 0.0),
    ("\\boxed{1} \\boxed{x^{2}+1}", "x^{2}+1", 1.0),  # text answers, compared as text
    ("\\boxed{1} \\boxed{x^{2}+1}", "x^{3}+1", 0.0),
    # an unclosed last box: fall back to the last number
    ("\\boxed{2} then \\boxed{7", 7, 1.0),
    # no box: the last number
    ("3 apples and 4 pears make 7", 7, 1.0),
    ("3 apples and 4 pears make 7", 3, 0.0),
    ("costs $1,250.50 in total", 1250.5, 1.0),
    ("about .5 of it", 0.5, 1.0),
    # GSM8K's reference: the value after the LAST ####
    ("so 42", "step one #### not this #### 42", 1.0),
    # a boxed reference: its last box
    ("so 9", "we get \\boxed{8} no, \\boxed{9}", 1.0),
    # numeric comparison tolerance is absolute 1e-9 relative to max(1, |answer|): 0.1 apart is wrong
    ("12.1", 12, 0.0),
    ("1000000.0000001", 1000000, 1.0),
    ("nothing to see", 0, 0.0),
    # one side a number, the other not: compared as text, never an error
    ("\\boxed{x}", 3, 0.0),
    ("so 7", "seven", 0.0),
    # a text reference after ####, spaces inside
    ("\\boxed{x + 1}", "so #### x + 1", 1.0),
    # a trailing full stop after a fraction
    ("it is 3/4.", "0.75", 1.0),
]


@pytest.mark.parametrize(("response", "answer", "want"), CASES)
def test_math_answer_takes_the_final_answer(response, answer, want):
    assert rewards.math_answer("prompt", response, answer=answer) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("\\boxed{1} ... \\boxed{2}", "2"),
        ("\\boxed{ 4 }", "4"),  # stripped
        ("\\boxed{a{b}c}", "a{b}c"),
        ("x 2023-2024", "2024"),
        ("-5 and -6", "-6"),
        ("none", None),
    ],
)
def test_extract_answer(text, want):
    assert rewards.extract_answer(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("1,200", 1200.0),
        ("$3.50", 3.5),
        ("-7", -7.0),
        ("3/4", 0.75),
        ("-3/4", -0.75),
        ("3/4.", 0.75),  # a sentence's full stop
        ("\\dfrac{3}{4}", 0.75),
        ("\\frac{1}{2}.", 0.5),
        ("5/0", None),
        ("x", None),
    ],
)
def test_as_number(text, want):
    assert rewards._as_number(text) == want


def test_a_row_without_an_answer_is_named_as_such():
    with pytest.raises(KeyError, match="no 'answer' column"):
        rewards.math_answer("prompt", "\\boxed{1}")
