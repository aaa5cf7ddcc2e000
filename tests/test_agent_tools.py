"""A model's tool call is untrusted input (issue 54, item 5): whatever it writes, a call answers with a result or an
error message and counts in TRL's metrics, never a crash of the run, never a hang; tools and environments that
cannot be set up are one line at the start."""

from __future__ import annotations

import sys
import time

import pytest

from waypoint.agents.toolbox import ToolError, ToolSet, Toolbox, reward_of
from waypoint.rewards.bounded import Interrupted
from waypoint.rewards.scoring import RewardError

TOOLS = '''
import asyncio, sys, time

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b

def explode(x: int) -> int:
    """Raise.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no luck with {x}")

def leave(x: int) -> int:
    """Exit.

    Args:
        x: Anything.
    """
    sys.exit(3)

def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "rested"

async def later(x: int) -> int:
    """Await.

    Args:
        x: A number.
    """
    await asyncio.sleep(0)
    return x * 2

def undocumented(x: int) -> int:
    return x

class Counter:
    made = 0

    def __init__(self):
        Counter.made += 1
        self.count = 0

    def reset(self, seed: int, **row) -> str:
        self.seed, self.row = seed, row
        return f" (start at {seed % 7})"

    def bump(self, by: int) -> int:
        """Bump the counter.

        Args:
            by: How much.
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)

    @property
    def expensive(self):
        raise AssertionError("a property is never evaluated")

class Stuck:
    def reset(self, **row):
        time.sleep(30)

    def act(self, x: int) -> int:
        """Act.

        Args:
            x: A number.
        """
        return x

class NoReset:
    def act(self, x: int) -> int:
        """Act.

        Args:
            x: A number.
        """
        return x
'''


@pytest.fixture
def tools_module(tmp_path, monkeypatch):
    (tmp_path / "agent_tools_under_test.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "agent_tools_under_test"
    sys.modules.pop("agent_tools_under_test", None)


def box(module: str, timeout: float | None = 2.0) -> Toolbox:
    names = ["add", "explode", "leave", "nap", "later"]
    toolset = ToolSet.load([f"{module}.{n}" for n in names], None, timeout)
    return toolset.toolbox({"prompt": []}, seed=0)[0]


@pytest.mark.parametrize("name, arguments, answer", [
    ("add", {"a": 2, "b": 3}, "5"),
    ("later", {"x": 4}, "8"),  # an async tool runs to its result
    ("nope", {"a": 1}, "{'error': 'Tool nope not found.'}"),  # TRL's words for an unknown tool
    ("add", {"a": 1}, "{'error': \"add() missing 1 required positional argument: 'b'\"}"),
    ("add", {"a": 1, "b": 2, "c": 3}, "{'error': \"add() got an unexpected keyword argument 'c'\"}"),
    ("add", "a=1, b=2", "{'error': 'arguments of add must be an object, got str'}"),
    ("explode", {"x": 7}, "{'error': 'no luck with 7'}"),
    ("leave", {"x": 1}, "{'error': 'tool leave called sys.exit()'}"),  # never the run's exit status
])
def test_every_call_answers_the_model(tools_module, name, arguments, answer):
    toolbox = box(tools_module)
    assert toolbox.call(name, arguments) == answer
    assert (toolbox.calls, toolbox.failures) == (1, int(answer.startswith("{'error'")))


def test_a_tool_past_tool_timeout_is_cut_and_answers_with_an_error(tools_module):
    toolbox = box(tools_module, timeout=0.3)
    started = time.monotonic()
    assert toolbox.call("nap", {"seconds": 30}) == "{'error': 'tool nap took longer than tool_timeout=0.3 s'}"
    assert time.monotonic() - started < 5
    assert toolbox.call("nap", {"seconds": 0}) == "rested"
    assert (toolbox.calls, toolbox.failures) == (2, 1)


def test_a_preemption_signal_leaves_a_running_tool(tools_module):
    toolbox = box(tools_module, timeout=None)
    deadline = time.monotonic() + 0.3
    with pytest.raises(Interrupted):
        toolbox.call("nap", {"seconds": 30}, stop=lambda: time.monotonic() > deadline)


def test_each_rollout_gets_a_new_environment_reset_with_its_row_and_seed(tools_module):
    toolset = ToolSet.load([f"{tools_module}.add"], f"{tools_module}.Counter", 2.0)
    assert [s["function"]["name"] for s in toolset.schemas] == ["add", "bump"]  # reset and get_reward are not tools
    assert toolset.env_reward
    first, observation = toolset.toolbox({"prompt": [], "answer": "4"}, seed=12)
    second, _ = toolset.toolbox({"prompt": [], "answer": "5"}, seed=13)
    assert first.environment is not second.environment
    assert (first.environment.seed, first.environment.row["answer"], observation) == (12, "4", " (start at 5)")
    assert first.call("bump", {"by": 3}) == "3" and second.call("bump", {"by": 1}) == "1"
    reward = reward_of("Counter")
    assert reward.__name__ == "Counter"
    assert reward(environments=[first.environment, second.environment]) == [3.0, 1.0]


@pytest.mark.parametrize("tools, environment, message", [
    (["agent_tools_under_test.undocumented"], None, "tools: agent_tools_under_test.undocumented:"),
    (["agent_tools_under_test.missing"], None, "tools: agent_tools_under_test.missing: agent_tools_under_test"),
    (["no_such_module_here.add"], None, "tools: no_such_module_here.add: no module no_such_module_here"),
    (["agent_tools_under_test.add", "agent_tools_under_test.add"], None, "tools: two tools are named add"),
    ([], "agent_tools_under_test.NoReset", "environment_factory: agent_tools_under_test.NoReset: its environment has "
                                           "no reset() method"),
])
def test_a_tool_or_environment_that_cannot_be_had_is_one_line_at_the_start(tools_module, tools, environment, message):
    with pytest.raises((ToolError, RewardError)) as caught:
        ToolSet.load(tools, environment, 1.0)
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_tool_module_that_raises_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_tools_mod.py").write_text("import definitely_not_installed_pkg\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"^tools: broken_tools_mod\.add: importing broken_tools_mod failed: "
                                          r"No module named 'definitely_not_installed_pkg'; install what it imports$"):
        ToolSet.load(["broken_tools_mod.add"], None, 1.0)


def test_an_environment_whose_reset_never_returns_stops_the_run_in_one_line(tools_module):
    toolset = ToolSet.load([], f"{tools_module}.Stuck", 0.3)
    started = time.monotonic()
    with pytest.raises(ToolError, match=r"^environment_factory: Stuck.reset took longer than tool_timeout=0.3 s"):
        toolset.toolbox({"prompt": []}, seed=0)
    assert time.monotonic() - started < 5
