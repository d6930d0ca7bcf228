"""The engine's one typed surface to a policy (issue #43): everything the engine asks is declared in the Policy
protocol, with defaults where a policy has nothing to say; every answer is a value the engine carries out (an
OomDecision, a PoolTarget handed back in a PoolResize), so no policy reaches into the engine and no part of a
decision waits in the policy for a later call."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from controller.adaptive import AdaptivePolicy
from controller.limits import Limits
from controller.policy import RECOVER, OomDecision, Policy, PoolResize, PoolTarget, StaticPolicy
from engine.baselines.vllm import VllmPolicy, VllmScheduler
from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.llm_engine import EngineDeadError, LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from tests.fake_backend import FakeBackend

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8]]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


class OutOfMemoryOnce(FakeBackend):
    """The `fail`-th step runs out of memory; the others run."""

    def __init__(self, fail: int = 2) -> None:
        super().__init__()
        self.fail, self.calls = fail, 0

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        self.calls += 1
        if self.calls == self.fail:
            raise torch.OutOfMemoryError("out of memory")
        return super().execute(batch)


class Stops(StaticPolicy):
    """Stops the engine on an OOM: it never sees the engine, only answers."""

    name = "stops"

    def on_oom(self) -> OomDecision:
        return OomDecision(stop="test: the worker died")


def test_the_engine_applies_a_stop_decision_from_on_oom_without_the_policy_touching_it():
    engine = LLMEngine(OutOfMemoryOnce(), Stops(Limits()))
    seqs = [engine.add_request(str(i), p, PARAMS) for i, p in enumerate(PROMPTS)]
    engine.step()
    assert engine.healthy
    outputs = engine.step()
    assert not engine.healthy and engine.stop_reason == "test: the worker died"
    assert sorted(o.request_id for o in outputs) == ["0", "1", "2"]
    assert all(o.finish_reason == "error" for o in outputs) and all(s.finish_reason == "error" for s in seqs)
    assert engine.allocator.num_used == 0 and engine.ooms == 1 and engine.ooms_recovered == 0
    with pytest.raises(EngineDeadError):
        engine.add_request("late", PROMPTS[0], PARAMS)


@pytest.mark.parametrize("policy", [StaticPolicy(Limits()), AdaptivePolicy()], ids=["static", "adaptive"])
def test_recovery_is_the_protocol_default(policy: Policy):
    assert policy.on_oom() == RECOVER
    engine = LLMEngine(OutOfMemoryOnce(), policy)
    seqs = [engine.add_request(str(i), p, PARAMS) for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished():
        engine.step()
    assert engine.healthy and engine.stop_reason is None and engine.ooms == engine.ooms_recovered == 1
    assert all(s.finish_reason == "length" for s in seqs)


def test_the_scheduler_class_is_declared_with_the_engines_own_as_default():
    assert Policy.scheduler_class is None and AdaptivePolicy.scheduler_class is None
    assert type(LLMEngine(FakeBackend(), AdaptivePolicy()).scheduler) is Scheduler
    assert type(LLMEngine(FakeBackend(), StaticPolicy(Limits())).scheduler) is Scheduler
    assert type(LLMEngine(FakeBackend(), VllmPolicy()).scheduler) is VllmScheduler


class ShrinksOnce(StaticPolicy):
    """Asks once for a pool below the blocks in use, to be reached by preempting; keeps what came of it."""

    name = "shrinks-once"

    def __init__(self, target: PoolTarget) -> None:
        super().__init__(Limits())
        self.target: PoolTarget | None = target
        self.resizes: list[PoolResize] = []

    def kv_pool_target(self, memory: object) -> PoolTarget | None:
        target, self.target = self.target, None
        return target

    def observe_pool(self, resize: PoolResize) -> None:
        self.resizes.append(resize)


def test_the_engine_carries_out_one_pool_target_and_hands_it_back_whole():
    """The size to reach and the size below which sequences must be preempted arrive as one value, and the
    policy learns what came of it from the same value, not from a field it left for itself."""
    target = PoolTarget(num_blocks=4, reason="test: memory tight", must_reach=4)
    policy = ShrinksOnce(target)
    engine = LLMEngine(FakeBackend(num_blocks=64, block_size=4), policy)
    policy.target = None  # let the requests take blocks first
    seqs = [engine.add_request(str(i), p * 4, PARAMS) for i, p in enumerate(PROMPTS)]
    engine.step()
    in_use = engine.allocator.num_used
    assert in_use > 4
    policy.target = target
    engine.step()
    (resize,) = policy.resizes
    assert resize.target is target and resize.old == 64 and resize.new == engine.allocator.num_blocks < in_use
    assert resize.error is None and resize.preempted >= 1
    while engine.has_unfinished():
        engine.step()
    assert all(s.finish_reason == "length" for s in seqs)


def _policy_uses(tree: ast.AST) -> tuple[set[str], list[int]]:
    """(attributes read from anything named `policy`, lines of getattr/hasattr calls on such a thing)."""
    names, probes = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (
            (isinstance(node.value, ast.Name) and node.value.id == "policy")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "policy")
        ):
            names.add(node.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and "policy" in ast.unparse(node.args[0])
        ):
            probes.append(node.lineno)
    return names, probes


def test_the_engine_asks_a_policy_only_what_the_protocol_declares():
    """No getattr/hasattr probe of a policy anywhere in engine/, and only Policy members read (but in the
    baselines, whose schedulers read their own policy's rules)."""
    declared = {n for n in [*vars(Policy), *Policy.__annotations__] if not n.startswith("_")}
    undeclared, probed = [], []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        names, probes = _policy_uses(ast.parse(path.read_text(), str(path)))
        probed += [f"{rel}:{line}" for line in probes]
        if not rel.startswith("engine/baselines/"):
            undeclared += [f"{rel}: policy.{n}" for n in sorted(names - declared)]
    assert not probed, f"getattr/hasattr on a policy: {probed}"
    assert not undeclared, "\n".join(undeclared)


def test_a_policy_that_says_it_is_feedback_free_learns_nothing_and_keeps_its_budget() -> None:
    """The decode burst trusts `feedback_free`: every policy of ours that claims it keeps StaticPolicy's observe
    and step_budget, and the adaptive one does not claim it."""
    from controller.adaptive import AdaptivePolicy
    from controller.policy import StaticPolicy
    from engine.baselines import seed, vllm

    claimed = [c for m in (seed, vllm) for c in vars(m).values() if isinstance(c, type) and issubclass(c, StaticPolicy)]
    assert claimed and not AdaptivePolicy.feedback_free
    for kind in (StaticPolicy, *claimed):
        if kind.feedback_free:
            assert kind.observe is StaticPolicy.observe and kind.step_budget is StaticPolicy.step_budget, kind
