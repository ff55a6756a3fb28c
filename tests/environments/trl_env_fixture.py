"""A TRL environment class and reward functions, written as a TRL user writes them for
``GRPOTrainer(environment_factory=CalculatorEnv, reward_funcs=[...])``: nothing here knows agentrl.
The tests import it by module name (``trl_env_fixture:CalculatorEnv``), as a run names an installed class."""


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


class BrokenResetEnv(CalculatorEnv):
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
