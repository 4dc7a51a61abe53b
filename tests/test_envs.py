"""Tests for envs.py (tooluse-v1, the first tool use; the default one is in test_tooluse.py): the scripted expert is always right, the held-out set is
balanced and disjoint from training, and untrusted agent text never raises, never hangs,
and gets reward 0 with an error observation when malformed."""
import json
import os
import random
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import envs  # noqa: E402
from plugins import tooluse_v1  # noqa: E402


@pytest.fixture(scope="module")
def env():
    return envs.make_env("tooluse-v1")


def world_key(w):
    return json.dumps(w, sort_keys=True)


def test_scripted_expert_solves_every_held_out_task(env):
    rng = random.Random(0)
    for task in env.eval_tasks:
        ep = envs.play(env, task, env.demo(task, rng))
        assert ep.done and ep.reward == 1.0, (task.prompt, ep.turns)
        assert ep.feedback == "correct"
        assert len(ep.turns) == len(tooluse_v1.FAMILIES[task.family]) + 1 <= env.max_turns
        assert ep.turns[-1] == (f"answer {task.answer}", "")


def test_scripted_expert_solves_training_tasks(env):
    rng = random.Random(1)
    assert all(envs.play(env, t, env.demo(t, rng)).reward == 1.0 for t in env.train_tasks[:500])


def test_reference_solution_is_the_expert_trajectory(env):
    rng = random.Random(0)
    for task in env.eval_tasks[:50]:
        ep = envs.play(env, task, env.demo(task, rng))
        assert env.trajectory_text(ep) == task.solution


def test_eval_set_balanced_by_family(env):
    assert len(env.eval_tasks) == 250
    counts = Counter(t.family for t in env.eval_tasks)
    assert set(counts) == set(tooluse_v1.FAMILIES)
    assert len(set(counts.values())) == 1  # 25 each


def test_eval_set_disjoint_from_training(env):
    assert not {t.task_id for t in env.eval_tasks} & {t.task_id for t in env.train_tasks}
    assert not {world_key(t.world) for t in env.eval_tasks} & {world_key(t.world) for t in env.train_tasks}
    assert len({t.task_id for t in env.eval_tasks}) == len(env.eval_tasks)


def test_tasks_are_fixed_by_the_seed(env):
    again = envs.make_env("tooluse-v1")
    assert [(t.prompt, t.answer, t.task_id) for t in again.eval_tasks] == \
        [(t.prompt, t.answer, t.task_id) for t in env.eval_tasks]
    other = envs.make_env("tooluse-v1", seed=1)
    assert [t.task_id for t in other.eval_tasks] != [t.task_id for t in env.eval_tasks]


def test_unseen_family_is_absent_from_warmup(env):
    assert tooluse_v1.UNSEEN in env.families
    assert tooluse_v1.UNSEEN not in env.warmup_families
    assert set(env.warmup_families) == set(env.families) - {tooluse_v1.UNSEEN}
    pool = env.make_tasks(200, seed=3, families=env.warmup_families)
    assert all(t.family != tooluse_v1.UNSEEN for t in pool)


def test_noisy_expert_is_well_formed(env):
    """Noisy demos are still type-correct tool calls that end in an answer, within max_turns."""
    rng = random.Random(0)
    for task in env.train_tasks[:300]:
        actions = env.demo(task, rng, noisy=True)
        assert actions[-1].startswith("answer ") and len(actions) <= env.max_turns
        ep = envs.play(env, task, actions)
        assert ep.done and len(ep.turns) == len(actions)
        assert all(not o.startswith("error") for _, o in ep.turns)


def test_random_plan_is_uniform_over_the_18_type_correct_plans_of_1_to_4_calls():
    assert len(tooluse_v1.GUESSES) == 18 and len(tooluse_v1.ALL_PLANS) == 31
    rng = random.Random(0)
    counts = Counter(tuple(tooluse_v1.random_plan(rng)) for _ in range(18_000))
    assert set(counts) == {tuple(p) for p in tooluse_v1.GUESSES}
    assert all(800 < c < 1200 for c in counts.values())        # 1000 expected each
    for plan in tooluse_v1.ALL_PLANS:  # + the answer fits in max_turns; every plan type-checks
        assert 1 <= len(plan) <= tooluse_v1.MAX_CALLS == envs.ENVS["tooluse-v1"].max_turns - 1
        world = tooluse_v1.random_world(rng)
        value, kind = world['people'][0], 'person'
        for tool in plan:
            assert tooluse_v1.TOOLS[tool] == kind
            value, err = tooluse_v1.call_tool(world, tool, value)
            assert err is None
            kind = 'team' if tool == 'team' else 'city' if tool == 'city' else 'person'
        assert kind != 'team'
    avoid = tooluse_v1.FAMILIES['quandle X']
    assert all(tooluse_v1.random_plan(rng, avoid=avoid) != avoid for _ in range(2000))


def test_only_the_family_plan_reaches_the_answer(env):
    """No lucky wins: every other plan of up to 5 calls gives another result than the answer."""
    for task in env.eval_tasks + env.train_tasks[:500]:
        x, plan = task.prompt.split()[-1], tooluse_v1.FAMILIES[task.family]
        assert tooluse_v1.run_plan(task.world, plan, x) == task.answer
        hits = [p for p in tooluse_v1.ALL_PLANS if tooluse_v1.run_plan(task.world, p, x) == task.answer]
        assert hits == [plan], (task.prompt, hits)


def test_answer_is_never_the_person_in_the_prompt(env):
    """Answers 'can only be known by calling the tools'."""
    echo = [t for t in env.eval_tasks if t.answer == t.prompt.split()[-1]]
    assert echo == []


def test_answer_without_tools_is_allowed(env):
    task = env.eval_tasks[0]
    ep = env.reset(task)
    step = env.step(ep, f"  answer {task.answer} ")
    assert step.done and step.reward == 1.0 and ep.reward == 1.0 and len(ep.turns) == 1


@pytest.mark.parametrize("action,err", [
    ("city(", "error: write tool(arg) or answer X"),
    ("city(bo", "error: write tool(arg) or answer X"),
    ("City(bo)", "error: write tool(arg) or answer X"),
    ("city(bo, ed)", "error: write tool(arg) or answer X"),
    ("lookup", "error: write tool(arg) or answer X"),
    ("answer", "error: write tool(arg) or answer X"),   # no space: not an answer
    ("", "error: write tool(arg) or answer X"),
    ("foo(bo)", "error: unknown tool 'foo'"),
    ("city(nobody)", "error: no person 'nobody'"),
    ("city(people)", "error: no person 'people'"),      # the world's own keys are not people
    ("lead(zzz)", "error: no team 'zzz'"),
    ("x" * 70 + "(bo)", "error: write tool(arg) or answer X"),  # longer than MAX_ACTION_CHARS
])
def test_malformed_call_gets_error_observation_and_reward_0(env, action, err):
    ep = env.reset(env.eval_tasks[0])
    step = env.step(ep, action)
    assert step.obs == err and step.reward == 0.0 and not step.done


def test_wrong_tool_argument_types(env):
    task = env.eval_tasks[0]
    person, team = task.world["people"][0], task.world["teams"][0]
    ep = env.reset(task)
    assert env.step(ep, f"lead({person})").obs.startswith("error: no team")
    assert env.step(ep, f"city({team})").obs.startswith("error: no person")
    assert env.step(ep, f"city({person})").obs == task.world[person]["city"]


def test_wrong_answer_gets_0_and_feedback(env):
    task = env.eval_tasks[0]
    ep = env.reset(task)
    step = env.step(ep, "answer nobody")
    assert step.done and step.reward == 0.0 and "wrong" in step.feedback and ep.reward == 0.0


def test_episode_ends_after_max_turns(env):
    ep = env.reset(env.eval_tasks[0])
    for i in range(env.max_turns):
        assert not ep.done
        step = env.step(ep, "city(nobody)")
    assert ep.done and step.done and ep.reward == 0.0 and len(ep.turns) == env.max_turns
    assert ep.turns[-1][1] == "" and "no answer" in ep.feedback
    # stepping a finished episode changes nothing
    after = env.step(ep, f"answer {ep.task.answer}")
    assert after.done and after.reward == 0.0 and len(ep.turns) == env.max_turns


junk = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=50),
    st.binary(max_size=100).map(lambda b: b.decode("utf-8", errors="replace")),
    st.text(min_size=1, max_size=3).map(lambda s: s * 100_000),         # huge strings
    st.sampled_from(["answer ", "answer", "answer\x00bo", "city()", "lead(\n)", "<|eot|>", "\u202e(bo)",
                     "city(bo)" * 20, "manager(" + "a" * 60 + ")"]),
    st.builds(lambda t, a: f"{t}({a})", st.sampled_from(list(tooluse_v1.TOOLS) + ["x", "lookup"]),
              st.sampled_from(envs.NAMES + envs.TEAMS + ["", "people", "teams", "lead"])),
    st.none(), st.integers(), st.binary(max_size=20), st.just(["city(bo)"]),  # not even text
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(junk, min_size=1, max_size=10), i=st.integers(0, 249))
def test_junk_actions_never_raise_and_episodes_end(env, actions, i):
    task = env.eval_tasks[i]
    ep = env.reset(task)
    n = 0
    for a in actions + ["city(nobody)"] * env.max_turns:
        if ep.done:
            break
        step = env.step(ep, a)
        n += 1
        assert isinstance(step.obs, str) and step.reward in (0.0, 1.0)
        assert step.reward == 0.0 or (isinstance(a, str) and a.strip() == f"answer {task.answer}")
        if not isinstance(a, str) or a.strip()[:7] != "answer ":
            assert step.reward == 0.0
    assert ep.done and n <= env.max_turns and len(ep.turns) <= env.max_turns
    assert all(len(act) <= 2 * envs.MAX_ACTION_CHARS for act, _ in ep.turns)
    assert len(env.trajectory_text(ep)) < 10_000


def test_action_types_call_answer_blind_answer_malformed(env):
    t = env.eval_tasks[0]
    ep = envs.play(env, t, ["hello", "boss(al)", f"answer {t.answer}"])
    assert [env.action_kind(ep, i) for i in range(3)] == ["malformed", "call", "answer"]
    blind = envs.play(env, t, ["answer nobody"])
    assert env.action_kind(blind, 0) == "blind answer" and envs.action_stats(env, [blind])["blind answer"] == 1.0
