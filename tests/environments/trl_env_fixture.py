"""A TRL environment class and reward functions, written as a TRL user writes them for
``GRPOTrainer(environment_factory=CalculatorEnv, reward_funcs=[...])``: nothing here knows agentrl.
The tests import it by module name (``trl_env_fixture:CalculatorEnv``), as a run names an installed class."""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only + - * / of numbers")


class CalculatorEnv:
    def __init__(self):
        self.answer = None
        self.calls = 0

    def reset(self, **kwargs):
        self.answer = kwargs["answer"]
        self.calls = 0
        return " Use the tools."

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        self.calls += 1
        return a * b

    def divide(self, a: int, b: int) -> float:
        """Divide one integer by another.

        Args:
            a: The dividend.
            b: The divisor.
        """
        self.calls += 1
        return a / b

    def _helper(self):
        return "not a tool"


class ScoredEnv(CalculatorEnv):
    """The environment owns its reward (``get_reward``, TRL adds it as a reward function)."""

    def get_reward(self) -> float:
        return 0.5 * self.calls


class ArithEnv:
    """One calculator tool, described as the prompts the tiny skilled model was taught with."""

    def reset(self, **kwargs):
        self.calls = 0

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

        Args:
            expression: the expression to evaluate, for example 4821 * 37
        """
        self.calls += 1
        value = _evaluate(ast.parse(expression, mode="eval"))
        return str(int(value) if float(value).is_integer() else value)


class BrokenResetEnv(ArithEnv):
    def reset(self, **kwargs):
        raise RuntimeError("the simulator did not start")


def used_tools(completions, environments, **kwargs):
    return [1.0 if env.calls > 0 else 0.0 for env in environments]


def says_answer(completions, answer, **kwargs):
    return [1.0 if str(a) in (c[-1]["content"] or "") else 0.0 for c, a in zip(completions, answer)]


def no_opinion(completions, **kwargs):
    return [None for _ in completions]


def raises(completions, **kwargs):
    raise ValueError("the judge is down")


def odd_length(completion_ids, **kwargs):
    return [float(len(ids) % 2) for ids in completion_ids]


def shortest_first(completion_ids, prompts, completions, environments, answer, log_metric, **kwargs):
    """Rank within the batch (TRL calls it with the whole batch): 1 for the shortest completion,
    down to 0 for the longest, ties sharing the better rank; a length penalty relative to the group."""
    for name, column in (("prompts", prompts), ("completions", completions), ("environments", environments), ("answer", answer)):
        assert len(column) == len(completion_ids), f"{name} has {len(column)} entries for {len(completion_ids)} completions"
    log_metric("batch_size", len(completion_ids))
    lengths = [len(ids) for ids in completion_ids]
    if len(lengths) == 1:
        return [1.0]
    return [1.0 - sum(other < mine for other in lengths) / (len(lengths) - 1) for mine in lengths]
