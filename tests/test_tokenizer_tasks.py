import collections
import re

import numpy as np
import pytest

from specdraft.tasks import Arithmetic, CharTokenizer, Countdown, Example
from specdraft.tasks.countdown import evaluate
from specdraft.tasks.tokenizer import BOS, EOS, PAD


def test_tokenizer_round_trip():
  tok = CharTokenizer()
  text = "12+34=4+2+0=6,3+1+0=4|46 (Hello, world!)\n"
  ids = tok.encode(text, bos=True, eos=True)
  assert ids[0] == BOS and ids[-1] == EOS
  assert len(set(ids)) > 10 and PAD not in ids
  assert tok.decode(ids) == text
  assert tok.decode(ids + [5, 6]) == text  # stops at EOS
  assert tok.vocab_size == 3 + 96


def test_tokenizer_rejects_unknown_characters():
  with pytest.raises(ValueError, match="not in the tokenizer's alphabet"):
    CharTokenizer().encode("naïve")


def test_arithmetic_scratchpad_by_hand():
  t = Arithmetic()
  assert t.solve([57, 68]) == "7+8+0=15,5+6+1=12,1=1|125"
  assert t.solve([5, 3]) == "5+3+0=8|8"
  assert t.solve([57, 68], "direct") == "125"
  assert t.solve([57, 68], "sums") == "15,12,1|125"
  assert t.solve([57, 68], "semicolon") == "7+8+0=15;5+6+1=12;1=1|125"
  assert t.solve([57, 68], "symbols") == "7&8&0:15/5&6&1:12/1:1|125"
  assert Arithmetic(num_operands=3).solve([9, 9, 9]) == "9+9+9+0=27,2=2|27"


def test_arithmetic_reward():
  t = Arithmetic()
  ex = Example("57+68=", "whatever")
  assert t.reward(ex, "7+8+0=15,5+6+1=12,1=1|125") == 1.0
  assert t.reward(ex, "125") == 1.0  # only the final answer is checked
  assert t.reward(ex, "7+8+0=15|124") == 0.0
  assert t.reward(ex, "") == 0.0


@pytest.mark.parametrize(
  "task",
  [
    Arithmetic(min_digits=2, max_digits=4, num_operands=3),
    Arithmetic(max_digits=4, num_operands=3, free_order=True, space_prob=0.9),
    Countdown(num_numbers=4, max_number=30, ops="+-*/"),
  ],
)
def test_generated_examples_are_correct_and_bounded(task):
  rng = np.random.default_rng(0)
  for _ in range(300):
    ex = task.sample(rng)
    assert task.reward(ex, ex.answer) == 1.0, ex
    assert len(ex.prompt) + len(ex.answer) <= task.max_length()
    assert len(ex.prompt) <= task.max_prompt_length()
  a = [task.sample(np.random.default_rng(7)) for _ in range(1)]
  b = [task.sample(np.random.default_rng(7)) for _ in range(1)]
  assert a == b


def test_countdown_parser_and_reward():
  assert evaluate("(15-13)*11") == (22, [15, 13, 11])
  assert evaluate("7/2*2")[0] == 7
  for bad in ("2+", "(1+2", "1+2)", "a", "1++2", "3/0", ""):
    with pytest.raises(ValueError):
      evaluate(bad)
  t = Countdown()
  ex = Example("11,13,15->22:", "")
  assert t.reward(ex, "(15-13)*11") == 1.0
  assert t.reward(ex, "11*(15-13)") == 1.0
  assert t.reward(ex, "11+11") == 0.0  # 11 used twice
  assert t.reward(ex, "(15-13)*11+0") == 0.0  # 0 not given
  assert t.reward(ex, "15+13-11") == 0.0  # wrong value
  assert Countdown(use_all=False).reward(Example("2,3,9->5:", ""), "2+3") == 1.0
  assert t.reward(Example("2,3,9->5:", ""), "2+3") == 0.0  # use_all


def test_arithmetic_format_mixture_and_reward_format():
  from specdraft.tasks.arithmetic import format_of

  t = Arithmetic(formats="columns:0.8,sums:0.2", reward_format="sums")
  rng = np.random.default_rng(0)
  fmts = [format_of(t.sample(rng).answer) for _ in range(2000)]
  assert set(fmts) == {"columns", "sums"}
  assert 0.15 < fmts.count("sums") / len(fmts) < 0.25
  ex = Example("57+68=", "")
  assert t.reward(ex, "15,12,1|125") == 1.0
  assert t.reward(ex, "7+8+0=15,5+6+1=12,1=1|125") == 0.0  # right answer, wrong format
  assert format_of("125") == "direct"
  assert format_of("7+8+0=15;5+6+1=12;1=1|125") == "semicolon"
  assert format_of("7&8&0:15/5&6&1:12/1:1|125") == "symbols"
  paid = Arithmetic(formats="columns:0.9,symbols:0.1", reward_format="symbols")
  assert paid.reward(ex, "7 & 8&0: 15/ 5&6 &1:12/1:1|125") == 1.0
  assert paid.reward(ex, "7&8&0:15/5&6&1:12/1:1|124") == 0.0
  assert paid.reward(ex, "7+8+0=15;5+6+1=12;1=1|125") == 0.0
  with pytest.raises(ValueError, match="formats"):
    Arithmetic(formats="columns,essay")


def _canonical(answer: str) -> str:
  """An answer with its free variation undone: spaces dropped, each column written 'terms=sum'
  with its terms in the canonical order (digits by operand, then the carry)."""
  from specdraft.tasks.arithmetic import SYMBOLS, format_of

  work, total = answer.replace(" ", "").split("|")
  plus, eq, sep = SYMBOLS[format_of(answer)]
  cols = []
  for col in work.split(sep):
    a, b = col.split(eq)
    lhs, s = (a, b) if plus in a or a == b else (b, a)
    cols.append((sorted(lhs.split(plus)), s))
  return sep.join(plus.join(terms) + eq + s for terms, s in cols) + "|" + total


def test_arithmetic_free_variation_keeps_the_work_and_the_answer():
  from specdraft.tasks.arithmetic import format_of

  t = Arithmetic(formats="columns:0.4,semicolon:0.3,symbols:0.3", free_order=True, space_prob=0.5)
  rng = np.random.default_rng(0)
  varied, fmts = 0, set()
  for _ in range(400):
    ex = t.sample(rng)
    nums = [int(x) for x in ex.prompt[:-1].split("+")]
    fmt = format_of(ex.answer)
    fmts.add(fmt)
    assert t.reward(ex, ex.answer) == 1.0
    assert _canonical(ex.answer) == _canonical(t.solve(nums, fmt)), ex
    varied += ex.answer != t.solve(nums, fmt)
  assert varied > 380  # nearly every answer differs from the canonical text
  assert fmts == {"columns", "semicolon", "symbols"}
  assert t.solve([57, 68]) == "7+8+0=15,5+6+1=12,1=1|125"  # no rng: canonical


def test_arithmetic_entropy_per_token_matches_the_sampled_answers():
  """Exact count against a plug-in estimate for one problem: 57+68 has columns (7, 8, 0) and
  (5, 6, 1), each 3! orders x 2 directions, so 144 equally likely answers without spaces."""
  t = Arithmetic(free_order=True)
  rng = np.random.default_rng(0)
  answers = [t.solve([57, 68], "columns", rng) for _ in range(40000)]
  _, counts = np.unique(answers, return_counts=True)
  p = counts / counts.sum()
  assert len(counts) == 144
  assert abs(-(p * np.log(p)).sum() - np.log(144)) < 0.01
  # per token over the task's problems: the same count, divided by the answers' length
  one = Arithmetic(min_digits=2, max_digits=2, free_order=True)
  h = one.entropy_per_token(np.random.default_rng(1), n=500)
  assert 0.15 < h < 0.35
  spaced = Arithmetic(min_digits=2, max_digits=2, free_order=True, space_prob=0.5)
  assert spaced.entropy_per_token(np.random.default_rng(1), n=500) > h + 0.1
  # spaces alone, exact: "7+8+0=15,5+6+1=12,1=1|125" has 2 * (4 '+' + 3 '=') + 2 ',' = 16 places,
  # each a fair coin: 2^16 answers, 16 ln 2 nats
  sp = Arithmetic(space_prob=0.5)
  answers = [sp.solve([57, 68], "columns", rng) for _ in range(20000)]
  assert {a.replace(" ", "") for a in answers} == {"7+8+0=15,5+6+1=12,1=1|125"}
  assert set(range(3, 14)) <= {a.count(" ") for a in answers} <= set(range(17))
  n_spaces = np.array([a.count(" ") for a in answers])
  assert abs(n_spaces.mean() - 8.0) < 0.1 and abs(n_spaces.var() - 4.0) < 0.25  # Binomial(16, 1/2)
  # the two places around the first '+': four patterns, each a quarter (independent places)
  first_gaps = collections.Counter(re.match(r"7( ?)\+( ?)8", a).groups() for a in answers)
  assert len(first_gaps) == 4 and min(first_gaps.values()) > 4500
  assert Arithmetic().entropy_per_token(np.random.default_rng(1), n=50) == 0.0
  # every worked format has the same places for spaces (so the same entropy)
  from specdraft.tasks.arithmetic import _space_slots

  assert {
    _space_slots(Arithmetic().solve([57, 68], f)) for f in ("columns", "semicolon", "symbols")
  } == {16}
  spaced = [sp.solve([57, 68], "symbols", rng) for _ in range(2000)]
  assert {a.replace(" ", "") for a in spaced} == {"7&8&0:15/5&6&1:12/1:1|125"}
  assert abs(np.mean([a.count(" ") for a in spaced]) - 8.0) < 0.3


def test_task_knob_errors():
  with pytest.raises(ValueError, match="space_prob"):
    Arithmetic(space_prob=1.0)
  with pytest.raises(ValueError, match="min_digits"):
    Arithmetic(min_digits=3, max_digits=2)
  with pytest.raises(ValueError, match="ops"):
    Countdown(ops="+^")


def test_the_prompt_width_is_the_longest_prompt_not_prompt_and_answer(tmp_path):
  """Rollouts and evaluation pad prompts to `prompt_len_for`: the task's longest prompt plus BOS,
  not the longest example (an answer-sized gap of padding widened every rollout's prefill and KV
  cache and every RL training row). A task without max_prompt_length falls back to max_length."""
  from specdraft.tasks import JsonlTask
  from specdraft.tasks.base import max_prompt_length
  from specdraft.train.evaluate import prompt_len_for

  task = Arithmetic(max_digits=3, num_operands=2, formats="columns")
  assert task.max_prompt_length() == len("999+999=")
  assert prompt_len_for(task) == len("999+999=") + 1
  assert task.max_length() == len("999+999=") + len(task.solve([999, 999], "columns"))
  assert Countdown(num_numbers=3, max_number=20).max_prompt_length() == len("20,20,20->8000:")
  ones = Countdown(num_numbers=12, max_number=1, ops="+")  # a sum of ones outgrows 1 ** 12
  assert ones.max_prompt_length() == len(",".join(["1"] * 12) + "->12:")
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "abcd", "answer": "xyzxyzxyz"}\n{"prompt": "ab", "answer": "x"}\n')
  assert JsonlTask(str(path)).max_prompt_length() == 4

  class Bare:  # a user's task with the old protocol
    def max_length(self):
      return 30

  assert max_prompt_length(Bare()) == 30
